"""The manifest and the record files, against the stand-in hub through huggingface_hub
and local folders of tiny models.

3. duplicate groups are found over the whole run, not among the revisions one call measures;
6. bounds: a worker start with a manifest makes no hub request; a second start reads no checkpoint byte
   already hashed; a done lookup is O(1) in the store's size.
"""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from local_hub import LocalHub, patched_endpoint
from tiny_models import build

from sinkwatch import InductionProbe
from sinkwatch.replay import FetchConfig, record_files, replay
from sinkwatch.reporting.jsonl import read_jsonl

PROBES = [InductionProbe(n=8, seq_len=64)]
FAST = FetchConfig(retries=1, backoff_s=0.01, backoff_max_s=0.05)
MANY = [f"step{s}" for s in (0, 100, 200, 300, 400, 500)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    for seed in range(4):
        build("llama", seed=seed).save_pretrained(root / f"w{seed}")
    return root


@pytest.fixture(scope="module")
def hub(folders):
    with LocalHub() as h:
        # pythia#205: step branches serving the final weights (step150, step250, step300 and main: w3)
        for branch, w in (("step100", "w0"), ("step200", "w1"), ("step300", "w3"), ("step150", "w3"), ("step250", "w3"), ("main", "w3")):
            h.add_revision("org/dup", branch, folders / w)
        for i, name in enumerate(MANY):
            files = _files(folders / f"w{i % 4}")
            h.add_revision("org/many", name, files if i < 4 else {**files, "extra.txt": name.encode()})
        with patched_endpoint(h.endpoint):
            yield h


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def rows(store) -> list[dict]:
    return [r for p in record_files(store) for r in read_jsonl(p)]


def run(model, out, **kw):
    kw.setdefault("probes", PROBES)
    return replay(model, out_dir=out, cache_dir=str(out / "hf_cache"), progress=False, fetch=FAST, **kw)


# ---- item 3 ------------------------------------------------------------------------------------------------------------
def test_a_subset_of_revisions_is_flagged_by_the_duplicate_groups_of_the_whole_run(hub, tmp_path):
    """Formerly: duplicates were found only among the revisions of one call: --revisions step150,step200
    drew step150 (serving the final weights, as step250, step300 and main do) as a trajectory point."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run("org/dup", tmp_path / "store", revisions=["step150", "step200"])
    flags = {r["revision"]: r["duplicate_of"] for r in got}
    assert flags == {"step150": "main", "step200": None}, flags


def test_per_revision_units_flag_duplicates_and_finalize_leaves_them_out(hub, tmp_path):
    """Formerly, the documented unit: five one-revision calls flagged nothing (duplicate_of all None), and
    the final replay drew all five. Units read the manifest's whole-run groups; identical weights are measured once."""
    from sinkwatch.replay import finalize, merged_records, replay_revision, write_manifest

    store = tmp_path / "store"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = write_manifest("org/dup", out_dir=store, probes=PROBES)
        assert m.tasks() == [["step100"], ["step150", "step250", "step300"], ["step200"]]
        for name in ("step100", "step150", "step200", "step250", "step300"):
            replay_revision("org/dup", name, out_dir=store, probes=PROBES, fetch=FAST)
        summary = finalize("org/dup", out_dir=store, probes=PROBES, ablate=True, ablation_revision="step200")
    flags = {r["revision"]: r["duplicate_of"] for r in rows(store)}
    assert flags == {"step100": None, "step150": "main", "step200": None, "step250": "main", "step300": None}  # step300: the final step
    assert [r["revision"] for r in merged_records(store)] == ["step100", "step200", "step300"]
    assert [t["revision"] for t in summary["trajectory"]] == ["step100", "step200", "step300"]
    assert summary["done"] == ["step100", "step150", "step200", "step250", "step300"] and summary["failed"] == {}
    assert summary["ablation"]["status"] == "ok" and summary["ablation"]["screen"] == "record"  # run once, from step200's record
    assert hub.downloads("org/dup/resolve/" + hub.commit_of("org/dup", "step250")) == []  # measured as step150, once
    # a store of the old layout (one records*.jsonl per worker) still reads: done, merged, finalized
    legacy = store / "records.old-worker.jsonl"
    legacy.write_text("".join(p.read_text() for p in sorted((store / "records").glob("*.json"))))
    for p in (store / "records").glob("*.json"):
        p.unlink()
    hub.log.clear()
    assert replay_revision("org/dup", "step100", out_dir=store, probes=PROBES, fetch=FAST)["revision"] == "step100"
    assert hub.downloads() == [] and [r["revision"] for r in merged_records(store)] == ["step100", "step200", "step300"]
    assert finalize("org/dup", out_dir=store, probes=PROBES)["done"] == summary["done"]


# ---- item 6 ------------------------------------------------------------------------------------------------------------
def test_a_worker_start_with_a_manifest_asks_the_hub_nothing(hub, tmp_path):
    """Formerly: 1 + N sequential metadata requests at every worker start (158 for Pythia-1b's 154 revisions).
    The manifest is the plan: a start that finds one lists nothing at all."""
    store = tmp_path / "store"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [r["status"] for r in run("org/many", store)] == ["ok"] * len(MANY)
    hub.log.clear()
    # a second worker starts (a fresh process, as on a cluster): everything is done
    cmd = [sys.executable, "-m", "sinkwatch", "replay", "org/many", "--out", str(store), "--cache-dir", str(store / "hf_cache"),
           "--probe", "induction", "--n", "8", "--seq-len", "64", "--no-progress", "--wandb", "disabled"]  # fmt: skip
    env = {**hub.env(), "PYTHONPATH": os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parent.parent)}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0 and "replayed 0 revision(s)" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    assert [p for m, p, s in hub.log if p.startswith("/api/models/")] == []  # was: 1 + 1 + N, then 1


def test_a_second_start_reads_no_checkpoint_byte_already_hashed(tmp_path):
    """Formerly: a local run was hashed in full at every start of every worker (100 x 2 GB ~ 14 min)."""
    run_dir = tmp_path / "run"
    for step, seed in ((10, 0), (20, 1)):
        build("llama", seed=seed).save_pretrained(run_dir / f"step{step}")
    store = tmp_path / "store"
    first = replay(str(run_dir), out_dir=store, probes=PROBES, progress=False)
    assert [r["status"] for r in first] == ["ok", "ok"]
    # rewrite step10's weights in place, same size, same mtime, same inode: only reading the bytes would tell
    w = run_dir / "step10" / "model.safetensors"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    with open(w, "r+b") as f:
        f.write(data)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.stat().st_ino == st.st_ino and w.stat().st_size == st.st_size
    assert replay(str(run_dir), out_dir=store, probes=PROBES, progress=False) == []  # not read: its hash is the cached one
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: hashed again, a new checkpoint for a new plan
    with pytest.warns(RuntimeWarning, match="step10 changed on disk since .* --rewrite-manifest"):
        assert replay(str(run_dir), out_dir=store, probes=PROBES, progress=False) == []  # the plan's weights are recorded
    again = replay(str(run_dir), out_dir=store, probes=PROBES, progress=False, rewrite_manifest=True)
    assert [r["revision"] for r in again] == ["step10"]


def test_a_done_lookup_opens_no_file_and_lists_no_folder_whatever_the_store_size(tmp_path, monkeypatch):
    """Formerly: store bookkeeping was O(store) per revision (replay_revision 6.5 s and +0.42 GB at 5,000 records)."""
    from sinkwatch.replay.store import ReplayStore, done_key

    store = ReplayStore(tmp_path)
    key = {"model": "m", "dtype": "float32", "protocol": "sinkwatch", "probes": {}}
    for i in range(3000):
        (store.path / f"{i:016x}.json").write_text(json.dumps({"revision": f"r{i}", "status": "ok", "n_layers": 1}) + "\n")
    row = {"model": "m", "revision": "step1", "commit": "c", "replay_key": key, "status": "ok", "n_layers": 1}
    assert store.write(row)
    assert not store.write({**row, "written_at": 2.0})  # one record per done key: the second is refused
    fresh = ReplayStore(tmp_path)  # a worker's store (it looks for legacy records*.jsonl once, in the store's top folder)
    opened: list[str] = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (opened.append(os.fspath(f)), real_open(f, *a, **k))[1])
    for name in ("scandir", "listdir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda path=".", _real=real: (opened.append(f"list {path}"), _real(path))[1])
    assert fresh.is_done(done_key(key, "step1", "c")) and not fresh.is_done(done_key(key, "step2", "c"))
    monkeypatch.undo()
    assert opened == [], opened[:5]
    failed = {**row, "revision": "step2", "status": "failed", "error": "x"}
    assert store.write(failed) and not store.is_done(done_key(key, "step2", "c"))  # a failed row is never done
    assert store.write({**failed, "status": "ok"}) and store.is_done(done_key(key, "step2", "c"))
    assert not store.record_path(done_key(key, "step2", "c"), failed=True).exists()  # the success replaced it
    assert not store.write(failed)  # and a failure never replaces a success
