"""Replay of a full trajectory on a cluster (docs/design.md §8): against a stand-in hub on 127.0.0.1
serving revisions of a tiny model the test builds, through the real huggingface_hub client.

Bounded disk and prefetch, retries of 503s, workers of every launcher sharing one store (real
processes: three srun tasks at once, torchrun, a worker killed with SIGKILL), the plan, placement,
the out-of-memory retry, the paper protocol's memory order and stages."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import warnings
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from local_hub import LocalHub, patched_endpoint
from tiny_models import build, config_for
from torchrun import free_port

import sinkwatch.monitor
import sinkwatch.replay.measure
from sinkwatch import InductionProbe, Monitor, MonitorConfig, StageConfig, StageTracker
from sinkwatch.cli import main
from sinkwatch.models.placement import ModelShape, place
from sinkwatch.replay import FetchConfig, detect_worker, merged_records, read_ablation, record_files, replay
from sinkwatch.reporting.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
REPO = "org/tiny"
STEPS = (0, 100, 200, 300)
NAMES = [f"step{s}" for s in STEPS]
PROBES = [InductionProbe(n=8, seq_len=64)]
PROBE_ARGS = ["--probe", "induction", "--n", "8", "--seq-len", "64", "--no-progress", "--wandb", "disabled"]
FAST = dict(fetch=FetchConfig(retries=2, backoff_s=0.01, backoff_max_s=0.05))  # the retry policy, minus the waiting
# The stage rules reduced to one signal every record meets (a head at >= 0x; none reaches 1e9x): whether a
# record's stored induction state is right depends only on the records before it in step order (patience).
ALWAYS_FORMING = dict(forming_min_selectivity=0.0, formed_min_selectivity=1e9)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Four revisions of a tiny Llama, each holding both weights formats (as Pythia's branches do)."""
    d = tmp_path_factory.mktemp("revisions")
    with LocalHub() as h:
        for i, name in enumerate(NAMES):
            model = build("llama", seed=i)
            model.save_pretrained(d / name)
            torch.save(model.state_dict(), d / name / "pytorch_model.bin")
            h.add_revision(REPO, name, d / name)
        yield h


@pytest.fixture()
def online(hub):
    hub.log.clear()
    with patched_endpoint(hub.endpoint):
        yield hub
    hub.on_request = None
    hub.clear_faults()
    hub.throttle(None)


def run(out, cache, **kw):
    kw = {**FAST, **kw}
    return replay(REPO, out_dir=out, probes=PROBES, cache_dir=str(cache), progress=False, **kw)


def ok_rows(store) -> list[dict]:
    return [r for p in record_files(store) for r in read_jsonl(p) if r.get("status") == "ok"]


def snapshots(cache) -> list[str]:
    """The revisions (commits) a Hugging Face cache holds."""
    return sorted(p.name for p in (Path(cache) / "models--org--tiny" / "snapshots").glob("*"))


def downloaded(store) -> list[str]:
    """The revisions (commits) the task folders of a store hold right now."""
    return sorted(p.name for p in (Path(store) / "cache").glob("*/models--org--tiny/snapshots/*"))


def stages_in_step_order(records: list[dict], config: StageConfig) -> list[str]:
    """Induction states a fresh tracker declares over ``records`` (given in step order), their stored stages ignored."""
    tracker, out = StageTracker(config), []
    for r in records:
        rec = {k: v for k, v in r.items() if not k.startswith(("p0_stage", "induction_state"))}
        tracker.update(rec)
        out.append(rec["induction_state"])
    return out


def commits(hub) -> dict[str, str]:
    return {n: hub.commit_of(REPO, n) for n in NAMES}


# ---- bounded disk, prefetch, one download per revision ------------------------------------------------------------------
def test_a_worker_holds_at_most_two_downloaded_revisions_and_ends_with_none(online, tmp_path, monkeypatch):
    """Formerly: replay kept every downloaded revision (4 of 4) and left the device idle while the next downloaded.
    Each task downloads into a folder of its own in the store, emptied once its record is written; the user's
    cache (--cache-dir) is read first and never written."""
    import threading

    from huggingface_hub import snapshot_download

    cache, store, c = tmp_path / "cache", tmp_path / "store", commits(online)
    snapshot_download(REPO, revision=c["step200"], cache_dir=cache)  # the user's own copy: read, never downloaded again
    before = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    online.log.clear()
    others_at_start = []  # other revisions in the store's task folders whenever a weights download starts
    next_started = threading.Event()

    def look(method, path):
        if method == "GET" and path.endswith("model.safetensors"):
            others_at_start.append([s for s in downloaded(store) if s not in path])
            if c["step100"] in path:
                next_started.set()

    # the probe of step0 lasts until step100's download has started (at most 20 s): with prefetch that
    # download starts while step0 is probed, whatever the machine's speed; without it, never (a tiny
    # model's probe is otherwise so fast that an overlap would depend on thread timing)
    probe = Monitor.probe

    def slow_probe(self, model, **kw):
        if kw.get("revision") == "step0":
            next_started.wait(timeout=20)
        return probe(self, model, **kw)

    monkeypatch.setattr(Monitor, "probe", slow_probe)
    online.on_request = look
    rows = run(store, cache)
    assert [(r["revision"], r["status"]) for r in rows] == [(n, "ok") for n in NAMES]
    assert all(len(o) <= 1 for o in others_at_start), others_at_start  # never more than two revisions on disk...
    assert max(len(o) for o in others_at_start) == 1  # ...because the next one downloads while one is probed
    assert [r["commit"] for r in rows] == [c[n] for n in NAMES]
    fetched = online.downloads("model.safetensors")
    assert sorted(fetched) == sorted(f"/{REPO}/resolve/{c[n]}/model.safetensors" for n in NAMES if n != "step200")  # once each
    assert online.downloads("pytorch_model.bin") == []  # one weights format
    assert downloaded(store) == [] and not list((store / "running").glob("*"))  # ends with none on disk, no attempt open
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) == before  # the user's cache, untouched
    # --keep-cache keeps what it downloads
    rows = run(tmp_path / "kept", tmp_path / "cache2", revisions=NAMES[:2], fetch=FetchConfig(keep_cache=True))
    assert [r["status"] for r in rows] == ["ok", "ok"] and downloaded(tmp_path / "kept") == sorted([c["step0"], c["step100"]])


def test_503s_on_a_weights_file_are_retried_and_a_revision_that_keeps_failing_is_recorded_failed(online, tmp_path):
    """Formerly: a 503 on a weights file failed the revision at once, with no retry."""
    c = commits(online)
    online.fail(f"{c['step100']}/model.safetensors", times=2, status=503, method="GET")
    online.fail(f"{c['step200']}/model.safetensors", times=10_000, status=503, method="GET")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        rows = run(tmp_path / "store", tmp_path / "cache")
    assert [(r["revision"], r["status"]) for r in rows] == [("step0", "ok"), ("step100", "ok"), ("step200", "failed"), ("step300", "ok")]
    said = [str(w.message) for w in said]
    assert sum("download org/tiny@step100: HfHubHTTPError" in m and "503" in m for m in said) == 2  # each retry says so
    assert any("org/tiny@step200 failed" in m for m in said)
    assert "503" in rows[2]["error"] and "after 3 attempts" in rows[2]["error"]
    # the failed row says which measurement failed, as the ok ones do
    assert (rows[2]["replay_key"], rows[2]["dtype"], rows[2]["commit"]) == (rows[0]["replay_key"], rows[0]["dtype"], c["step200"])
    assert len(online.downloads(f"{c['step100']}/model.safetensors")) == 1  # the third try got it
    assert [s for m, p, s in online.log if m == "GET" and p.endswith(f"{c['step200']}/model.safetensors")] == [503, 503, 503]
    online.clear_faults()
    retried = run(tmp_path / "store", tmp_path / "cache")  # a later job retries the failed revision, and only it
    assert [(r["revision"], r["status"]) for r in retried] == [("step200", "ok")]
    assert downloaded(tmp_path / "store") == []


# ---- workers of any launcher share one store ------------------------------------------------------------------------------
DOCS = (ROOT / "docs" / "replay.md").read_text()


def docs_command(prefix: str) -> list[str]:
    """The argv of the docs' command line that starts with ``prefix`` (docs/replay.md, cluster section)."""
    line = next((x.strip() for x in DOCS.splitlines() if x.strip().startswith(prefix)), None)
    assert line is not None, f"docs/replay.md has no command starting with {prefix!r}"
    return line.split("#")[0].split()


def as_test(argv: list[str], tmp: Path) -> list[str]:
    """A docs command line run here: the recipe becomes one of the hub's tiny model with a small probe (a YAML
    recipe: torchrun's own parser rejects ``--n`` after the script, an ambiguous prefix of its options), the
    store and cache the test's."""
    recipe = tmp / "tiny.yaml"
    recipe.write_text(f"model: {REPO}\nname: tiny\nprobes:\n  induction: {{n: 8, seq_len: 64}}\n")
    argv = [str(recipe) if a == "pythia-1b" else a for a in argv]
    argv[argv.index("--out") + 1] = str(tmp / "store")
    argv.remove("--all-revisions")  # the recipe lists no revisions: every listed one is measured either way
    return [*argv, "--cache-dir", str(tmp / "cache"), "--no-progress", *([] if "--wandb" in argv else ["--wandb", "disabled"])]


def test_three_srun_workers_started_at_once_record_each_revision_once(online, tmp_path):
    """Formerly: `srun -n K` ran K full copies (Slurm's variables were not read), and three processes on one
    store measured every revision three times. The docs' srun command, run as srun runs it: each worker takes
    its stride of the tasks, then what is missing; each revision is recorded once."""
    argv = docs_command("srun ")
    assert argv[:3] == ["srun", "-n", "8"] and argv[3:5] == ["sinkwatch", "replay"]
    cmd = [sys.executable, "-m", "sinkwatch", *as_test(argv[4:], tmp_path)]
    procs = []
    for i in range(3):
        env = {**online.env(), "SLURM_PROCID": str(i), "SLURM_NTASKS": "3", "SLURM_LOCALID": str(i), "SLURM_JOB_ID": "7"}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    rows = ok_rows(tmp_path / "store")
    assert sorted(r["revision"] for r in rows) == NAMES  # each exactly once
    assert {r["worker"].split(".")[0] for r in rows} <= {"srun-0of3", "srun-1of3", "srun-2of3"}
    assert len(online.downloads("model.safetensors")) <= len(NAMES) + 2  # at most a duplicated measurement per other worker
    assert downloaded(tmp_path / "store") == [] and not list((tmp_path / "store" / "running").glob("*"))


@pytest.fixture(scope="module")
def two_rounds(hub, tmp_path_factory):
    """A run of step0 and step200, then one of step100 and step300 added to its plan (--rewrite-manifest), asked
    for the ablation at step300."""
    d = tmp_path_factory.mktemp("two_rounds")
    cfg = MonitorConfig(stages=StageConfig(patience=2, **ALWAYS_FORMING))
    kw = dict(monitor_config=cfg, ablate=True, ablation_revision="step300")
    with patched_endpoint(hub.endpoint):
        first = run(d / "store", d / "cache", revisions=["step0", "step200"], monitor_config=cfg)
        second = run(d / "store", d / "cache", revisions=["step100", "step300"], rewrite_manifest=True, **kw)
    return d, cfg, kw, first, second


def test_stages_are_derived_from_the_whole_store_in_step_order(two_rounds):
    """Formerly: stored stages were derived from the worker's own shard only. Each record's stages are derived
    over every record in the store when it was written (any worker's), in step order; the report's over the
    whole store, in step order, with the same StageConfig."""
    d, cfg, _, first, second = two_rounds
    assert [r["revision"] for r in first] == ["step0", "step200"] and [r["revision"] for r in second] == ["step100", "step300"]
    stored = {r["revision"]: r for r in ok_rows(d / "store")}
    written = ["step0", "step200", "step100", "step300"]  # the first run's, then the second's
    for i, name in enumerate(written):
        seen = [stored[n] for n in NAMES if n in written[: i + 1]]
        assert stored[name]["induction_state"] == stages_in_step_order(seen, cfg.stages)[seen.index(stored[name])], name
    # step100, the second run's first record: declared "forming" at its second probe in step order, step0 — the first run's
    assert stored["step100"]["induction_state"] == "forming"
    whole = stages_in_step_order([stored[n] for n in NAMES], cfg.stages)
    assert [r["induction_state"] for r in merged_records(d / "store")] == whole
    assert [stored[n]["induction_state"] for n in ("step0", "step100", "step300")] == [whole[0], whole[1], whole[3]]


def test_the_ablation_runs_once_on_the_record_of_its_revision(two_rounds):
    """Formerly: the ablation ran on a worker that probed step300 itself though another measured it."""
    d, _, _, _, _ = two_rounds
    a = read_ablation(d / "store")
    assert a["status"] == "ok" and a["revision"] == "step300" and a["screen"] == "record"
    assert downloaded(d / "store") == [] and not list((d / "store" / "running").glob("*"))


def test_a_two_round_run_resumed_with_three_workers_then_one_measures_nothing_again(two_rounds, hub, monkeypatch):
    """Formerly: after shards 0/2 and 1/2 a single-process rerun measured all 4 revisions again (done was per shard file).
    Three srun workers, then one process: nothing to measure, no download, no hub request."""
    d, _, kw, _, _ = two_rounds
    before = (d / "store" / "ablation.json").read_text()
    hub.log.clear()
    with patched_endpoint(hub.endpoint):
        for rank in range(3):
            with monkeypatch.context() as m:
                for k, v in {"SLURM_PROCID": rank, "SLURM_NTASKS": 3}.items():
                    m.setenv(k, str(v))
                assert run(d / "store", d / "cache", revisions=NAMES, **kw) == []
        assert run(d / "store", d / "cache", revisions=NAMES, **kw) == []
    assert hub.log == [] and (d / "store" / "ablation.json").read_text() == before
    assert sorted(r["revision"] for r in ok_rows(d / "store")) == NAMES


def test_local_rank_without_world_size_skips_nothing(online, tmp_path, monkeypatch):
    """Formerly: LOCAL_RANK without WORLD_SIZE silently skipped the first revisions."""
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        rows = run(tmp_path / "store", tmp_path / "cache")
    assert [r["revision"] for r in rows] == NAMES
    assert any("LOCAL_RANK=1 without WORLD_SIZE: this process is one worker of an unknown number" in str(w.message) for w in said)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, (3, 4, "torchrun", 1)),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, (5, 8, "srun", 1)),
        ({"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_COUNT": "4"}, (2, 4, "slurm-array", None)),
        (
            {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"},
            (5, 8, "slurm-array+srun", 1),
        ),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (0, 1, "srun", None)),
        ({"LOCAL_RANK": "2"}, (2, None, "local-rank", 2)),
        ({}, (0, 1, "single", None)),
    ],
)
def test_every_launcher_is_recognised(env, expected):
    w = detect_worker(env)
    assert (w.index, w.count, w.launcher, w.local_rank) == expected
    assert str(w.pid) in w.id and w.host in w.id


def test_a_worker_killed_mid_download_is_resumed_by_the_next_run(online, tmp_path):
    """A worker SIGKILLed while downloading its revision leaves that task's folder and marker; no lease holds the
    task: the next run measures it (its attempt empties the folder first) and ends with nothing left on disk."""
    online.throttle(20_000)  # bytes/s: one revision's weights take ~7 s
    started = threading.Event()
    online.on_request = lambda method, path: started.set() if method == "GET" and path.endswith("model.safetensors") else None
    cmd = [sys.executable, "-m", "sinkwatch", "replay", REPO, "--out", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache")]
    killed = subprocess.Popen([*cmd, *PROBE_ARGS], env=online.env(), cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        assert started.wait(120), "the worker never started downloading"
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
    online.throttle(None)
    online.on_request = None
    assert [json.loads(p.read_text())["task"] for p in (tmp_path / "store" / "running").glob("*.json")] == ["step0"]
    assert list((tmp_path / "store" / "cache").glob("*/models--org--tiny"))  # its half-downloaded revision, in the store
    rows = run(tmp_path / "store", tmp_path / "cache")
    assert sorted(r["revision"] for r in rows) == NAMES and sorted(r["revision"] for r in ok_rows(tmp_path / "store")) == NAMES
    assert downloaded(tmp_path / "store") == [] and not list((tmp_path / "store" / "running").glob("*"))


def test_the_torchrun_command_of_the_docs_with_one_wandb_run_per_worker_grouped_by_the_store(online, tmp_path):
    argv = docs_command("torchrun ")
    assert argv[:3] == ["torchrun", "--nproc-per-node", "8"] and argv[3:6] == ["-m", "sinkwatch", "replay"]
    rest = as_test(argv[5:], tmp_path)
    assert rest[rest.index("--wandb") + 1] == "offline"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "sinkwatch",
        *rest,
    ]
    res = subprocess.run(cmd, env=online.env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = ok_rows(tmp_path / "store")
    assert sorted(r["revision"] for r in rows) == NAMES
    assert {r["worker"].split(".")[0] for r in rows} <= {"torchrun-0of2", "torchrun-1of2"}
    group = json.loads((tmp_path / "store" / "store.json").read_text())["id"]
    runs = [_wandb_run(p) for p in (tmp_path / "store" / "wandb").glob("offline-run-*/run-*.wandb")]
    assert len(runs) == 2 and {g for g, _ in runs} == {group}
    assert sorted(n.split()[1].split(".")[0] for _, n in runs) == ["torchrun-0of2", "torchrun-1of2"]


def _wandb_run(path: Path) -> tuple[str, str]:
    """(group, name) of an offline W&B run, read from its transaction log (32 KiB blocks of records with
    7-byte headers: crc32, length, kind; kinds 1 = whole, 2/3/4 = first/middle/last piece)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "run":
                return rec.run.run_group, rec.run.display_name
    raise AssertionError(f"no run record in {path}")


# ---- the plan, placement, memory --------------------------------------------------------------------------------------------
def test_plan_prints_the_sizes_the_hub_serves_and_fetches_no_weights(online, tmp_path, capsys):
    """Formerly: replay said nothing before it started (no revisions, sizes, disk, memory or time)."""
    c = commits(online)
    cmd = ["replay", REPO, "--out", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache"), *PROBE_ARGS]
    assert main([*cmd, "--plan", "--workers", "3"]) == 0
    out = capsys.readouterr().out
    size = len((online.repos[REPO].commits[c["step0"]]["model.safetensors"]).data)
    for n in NAMES:
        line = next(x for x in out.splitlines() if x.strip().startswith(n + " "))
        assert c[n][:8] in line and line.rstrip().endswith("to do")
    assert out.count(f"model.safetensors  {size} bytes") == 4 and "pytorch_model.bin" not in out
    assert re.search(r"~2 revision\(s\) each", out) and "workers: 3 (--workers)" in out
    from sinkwatch.models.placement import human

    one = sum(len(f.data) for p, f in online.repos[REPO].commits[c["step0"]].items() if p != "pytorch_model.bin")
    assert f"peak {human(2 * one)} with eviction" in out and f"{human(4 * one)} without (--keep-cache)" in out
    assert "float16" in out and "fits on the CPU" in out and "time: ~" in out
    assert online.downloads(".safetensors") == [] and online.downloads(".bin") == []
    assert not (tmp_path / "cache").exists() or snapshots(tmp_path / "cache") == []
    assert not (tmp_path / "store").exists()  # a plan writes nothing


def test_a_revision_that_cannot_fit_the_device_is_refused_before_it_downloads(online, tmp_path, capsys):
    """Formerly: a model too big for the device was downloaded in full, failed out of memory, and the next did the same."""
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        rows = run(tmp_path / "store", tmp_path / "cache", revisions=NAMES[:2], max_memory="64KiB")
    assert [r["status"] for r in rows] == ["failed", "failed"] and "It was not downloaded" in rows[0]["error"]
    assert "needs about" in rows[0]["error"] and "a device with more memory" in rows[0]["error"]
    assert online.downloads("model.") == []
    cmd = ["replay", REPO, "--out", str(tmp_path / "p"), "--cache-dir", str(tmp_path / "cache"), *PROBE_ARGS, "--max-memory", "64KiB"]
    assert main([*cmd, "--plan"]) == 0 and "REFUSED" in capsys.readouterr().out


def test_placement_on_one_device_split_over_gpus_or_refused():
    """The placement decision, on CPU with empty weights and memory budgets (the real split is in benchmarks/gpu_check.sh)."""
    from accelerate.utils import compute_module_sizes

    shape = ModelShape.from_config(config_for("llama", num_hidden_layers=4, hidden_size=64, intermediate_size=128))
    w, act = shape.weights["float32"], shape.activations("float32", 512, 64)
    assert all(p.device.type == "meta" for p in shape.empty.parameters())  # nothing allocated
    assert shape.weights["float16"] * 2 == w == 4 * (shape.params + sum(b.numel() for b in shape.empty.buffers()))
    one = place(shape, "float32", {"cpu": w + act}, batch_tokens=512, seq_len=64)
    assert one.device_map == {"": "cpu"} and not one.split
    budget = act + int(0.8 * w)
    split = place(shape, "float32", {0: budget, 1: budget}, batch_tokens=512, seq_len=64)
    assert split.split and set(split.device_map.values()) == {"cuda:0", "cuda:1"}
    sizes = compute_module_sizes(shape.empty, dtype=torch.float32)
    for dev in ("cuda:0", "cuda:1"):
        assert sum(sizes[m] for m, d in split.device_map.items() if d == dev) <= budget - act
    refused = place(shape, "float32", {0: act + int(0.3 * w), 1: act + int(0.3 * w)}, batch_tokens=512, seq_len=64)
    assert not refused.fits and "It was not downloaded" in refused.reason and "or a device with more memory" in refused.reason
    half = place(shape, "float32", {"cpu": shape.need("bfloat16", 512, 64)}, batch_tokens=512, seq_len=64)
    assert not half.fits and "--dtype bfloat16" in half.reason


def test_an_out_of_memory_probe_is_retried_at_half_batch_tokens(online, tmp_path, monkeypatch):
    """Formerly: an out-of-memory probe failed its revision; it is retried once at half batch_tokens.
    The fault is injected at the probe's forward (a CUDA OOM cannot happen on this CPU; gpu_check.sh has the real one)."""
    plain = run(tmp_path / "plain", tmp_path / "cache", revisions=["step0"], batch_tokens=512)[0]
    original = sinkwatch.monitor.Monitor._forward
    limit = {"tokens": 256}

    def oom_above(self, target, probe, *, with_sinks, share=None):
        if self.config.batch_tokens > limit["tokens"]:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected above batch_tokens={limit['tokens']})")
        return original(self, target, probe, with_sinks=with_sinks, share=share)

    monkeypatch.setattr(sinkwatch.monitor.Monitor, "_forward", oom_above)
    with pytest.warns(RuntimeWarning, match="out of memory at batch_tokens=512; retrying at 256"):
        retried = run(tmp_path / "oom", tmp_path / "cache", revisions=["step0"], batch_tokens=512)[0]
    assert retried["status"] == "ok" and retried["oom_batch_tokens"] == 256
    np.testing.assert_allclose(  # the same numbers; 1e-5: float32 matmuls over 4- vs 8-sequence micro-batches
        np.asarray(retried["selectivity"]["induction"], dtype=float), np.asarray(plain["selectivity"]["induction"], dtype=float), rtol=1e-5
    )
    limit["tokens"] = 128  # half is not enough either: the revision fails, the job goes on
    with pytest.warns(RuntimeWarning, match="step0 failed"), pytest.warns(RuntimeWarning, match="retrying at 256"):
        failed = run(tmp_path / "oom2", tmp_path / "cache", revisions=["step0"], batch_tokens=512)[0]
    assert failed["status"] == "failed" and "OutOfMemoryError" in failed["error"]


def test_the_paper_protocol_frees_float32_before_the_float16_pr_pass_and_stores_the_stages_the_report_shows(online, tmp_path, monkeypatch):
    """Formerly: the float32 model stayed alive while the paper protocol's float16 PR copy loaded.
    Formerly: stages were stored before the PR was added, and the report re-derived them with the default StageConfig."""
    loads, alive = [], []
    real = sinkwatch.replay.measure.load_model

    def watched(*args, **kw):
        loads.append((kw.get("dtype"), sum(ref() is not None for ref in alive)))  # models still alive when this one loads
        model = real(*args, **kw)
        alive.append(weakref.ref(model))
        return model

    monkeypatch.setattr(sinkwatch.replay.measure, "load_model", watched)
    stages = StageConfig(patience=1, **ALWAYS_FORMING)
    rows = run(tmp_path / "store", tmp_path / "cache", revisions=NAMES[:2], protocol="paper", monitor_config=MonitorConfig(stages=stages))
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[0]["pr_dtype"] == "float16"
    assert loads == [("float32", 0), ("float16", 0), ("float32", 0), ("float16", 0)]
    want = stages_in_step_order(rows, stages)  # independently: the complete records, with the replay's StageConfig
    assert want[0] == "forming"  # stored once the record is complete, float16 PR pass included
    assert [r["induction_state"] for r in rows] == want
    assert [r["induction_state"] for r in merged_records(tmp_path / "store")] == want  # what the report draws
