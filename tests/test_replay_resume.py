"""The plan written once, a resume that converges, and wrong branches that are never trajectory points,
against the stand-in hub through huggingface_hub, with real processes and real signals.

- the docs' manifest line on Pythia-1b's 154 real branch names prints the array range 0-153, and every engine's
  finalize asks for a GPU and a time limit;
- the manifest is the plan: a rerun of --manifest-only or a worker with another revision list never rewrites it;
  --rewrite-manifest keeps every task's name and index, appends, and is refused while a task runs;
- --task N writes every member of its task, even when the first was recorded before a full disk stopped it;
- a unit killed by SIGKILL mid-probe leaves its folder and marker in the store: --failed-tasks lists it, finalize
  records it and sweeps the folder, the resubmission converges;
- wrong branches: the duplicate check covers the whole listing (local folders too), a step serving main's weights
  is flagged unless it is the final step, a revision whose metadata failed is asked again when its task runs,
  the report takes the groups from the manifest, and the engines honour --skip-duplicates.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import replay_faults
from local_hub import LocalHub, patched_endpoint
from tiny_models import build

from sinkwatch import InductionProbe
from sinkwatch.cli import main
from sinkwatch.replay import (
    FetchConfig,
    failed_tasks,
    finalize,
    merged_records,
    read_manifest,
    record_files,
    replay,
    replay_revision,
    write_manifest,
)
from sinkwatch.replay.store import ReplayStore
from sinkwatch.report import build_report
from sinkwatch.reporting.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "docs" / "replay.md").read_text()
PROBES = [InductionProbe(n=8, seq_len=64)]
PROBE_ARGS = ["--probe", "induction", "--n", "8", "--seq-len", "64", "--no-progress", "--wandb", "disabled", "--retries", "0"]
FAST = FetchConfig(retries=0, backoff_s=0.01, backoff_max_s=0.05)
# Pythia-1b's branches as the hub lists them: step0, the powers of two to 512, then every 1000 steps to 143000
PYTHIA_1B = ["step0", *(f"step{2**k}" for k in range(10)), *(f"step{1000 * k}" for k in range(1, 144))]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    for seed in range(4):
        build("llama", seed=seed).save_pretrained(root / f"w{seed}")
    return {f"w{seed}": {p.name: p.read_bytes() for p in (root / f"w{seed}").iterdir()} for seed in range(4)}


@pytest.fixture(scope="module")
def hub(weights):
    with LocalHub() as h:
        for name in PYTHIA_1B:  # metadata only: nothing of these is downloaded
            h.add_revision("EleutherAI/pythia-1b", name, {"config.json": b"{}", "model.safetensors": name.encode()})
        h.add_revision("EleutherAI/pythia-1b", "main", {"config.json": b"{}", "model.safetensors": b"step143000"})
        for branch, w in (("step100", "w0"), ("step200", "w1"), ("step300", "w1"), ("step400", "w2")):
            h.add_revision("org/pair", branch, weights[w])  # step200 and step300: one task of two members
        for branch, w in (("step100", "w0"), ("step200", "w1"), ("main", "w0")):
            h.add_revision("org/mainish", branch, weights[w])  # step100 serves main's weights and is not the final step
        with patched_endpoint(h.endpoint):
            yield h


@pytest.fixture()
def online(hub):
    hub.log.clear()
    yield hub
    hub.clear_faults()


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory):
    """``sinkwatch`` on PATH as this interpreter's module: the docs' lines run as written."""
    d = tmp_path_factory.mktemp("bin")
    (d / "sinkwatch").write_text(f'#!/bin/sh\nexec {sys.executable} -m sinkwatch "$@"\n')
    (d / "sinkwatch").chmod(0o755)
    return d


def rows(store) -> list[dict]:
    return [r for p in record_files(store) for r in read_jsonl(p)]


def cli(*argv: str) -> int:
    return main(["replay", *argv])


def docs_block(after: str, lang: str) -> str:
    at = DOCS.index(after, DOCS.index("## A full trajectory on a cluster"))
    start = DOCS.index(f"```{lang}\n", at) + len(f"```{lang}\n")
    return DOCS[start : DOCS.index("```", start)]


# ---- the plan, written once ------------------------------------------------------------------------------------------
def test_the_docs_manifest_line_on_pythia_1bs_154_branches_prints_0_153(online, bin_dir, tmp_path):
    """The Slurm lines measured the recipe's 10 revisions while the array was sized for 154 (tasks 10-153 exited 2):
    the docs' manifest line, run as written on the real branch names, prints the range the array takes."""
    line = next(x for x in docs_block("**Slurm**", "bash").splitlines() if x.startswith("ARRAY=$(sinkwatch replay pythia-1b"))
    script = line.replace("/shared/runs/pythia-1b", str(tmp_path / "store")) + '\necho "$ARRAY"\n'
    e = {**online.env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=e, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == "0-153\n"
    assert read_manifest(tmp_path / "store").task_names() == PYTHIA_1B  # the array index is the position in this list
    assert "0-153" in line.split("#", 1)[1]  # and the docs say so


def test_every_engines_finalize_gets_a_gpu_and_a_time_limit_and_the_driver_a_limit_on_its_wait():
    """The paper protocol's finalize (a float16 group ablation of a 1B model) ran on the CPU for hours: the docs'
    finalize job asked for no GPU, and the submitit, Ray and pool examples called finalize() in the driver."""
    finals = [x for x in docs_block("**Slurm**", "bash").splitlines() if "--finalize" in x]
    assert finals and all("--gpus=1" in x and re.search(r"--time=\d+", x) and "afterany" in x for x in finals), finals
    submitit = docs_block("**submitit**", "python")
    assert "executor.submit(finalize, MODEL, out_dir=OUT)" in submitit and 'gpus_per_node=1, dependency=f"afterany' in submitit
    ray = docs_block("**Ray**", "python")
    assert "ray.remote(num_gpus=1)(finalize)" in ray and "run_with_limit(final, [(MODEL,)], out_dir=OUT, limit_s=3600)" in ray
    for block in (submitit, ray):
        assert not re.search(r"^(summary = )?finalize\(", block, re.MULTILINE)  # never called in the driver
    # and the drivers never wait without a limit: finalize's job through as_completed's timeout, a fresh Ray worker per task
    assert re.search(r"as_completed\(\[final\], timeout=[\d *]+\)\)\.result\(\)", submitit) and submitit.count(".result()") == 1
    assert "max_calls=1" in ray.split("(replay_revision)")[0]


def test_the_manifest_is_written_once_and_rewritten_only_on_request(online, weights, tmp_path, capsys):
    """A run into the same --out with another revision list or moved commits rewrote manifest.json (so did the
    --manifest-only rerun the docs advised for moved branches), and tasks were addressed by index into it."""
    online.add_revision("org/moving", "step100", weights["w0"])
    old = online.add_revision("org/moving", "step200", weights["w1"])
    store = tmp_path / "store"
    common = ["org/moving", "--out", str(store), *PROBE_ARGS]
    assert cli(*common, "--manifest-only") == 0 and capsys.readouterr().out == "0-1\n"
    written = (store / "manifest.json").read_bytes()
    new = online.move_branch("org/moving", "step200", weights["w2"])
    online.add_revision("org/moving", "step300", weights["w3"])
    online.log.clear()
    assert cli(*common, "--manifest-only") == 0 and capsys.readouterr().out == "0-1\n"  # the plan as written, no hub request
    assert (store / "manifest.json").read_bytes() == written and online.log == []
    assert cli(*common, "--revisions", "step100,step300", "--manifest-only") == 2
    assert "--rewrite-manifest" in capsys.readouterr().err
    with pytest.raises(ValueError, match="plans 2 task.*this run asks for revisions step100, step300.*--rewrite-manifest"):
        replay("org/moving", out_dir=store, revisions=["step100", "step300"], probes=PROBES, progress=False)
    assert (store / "manifest.json").read_bytes() == written
    assert cli(*common, "--task", "1") == 0  # task 1 is step200 at the commit the plan holds
    assert [(r["revision"], r["commit"]) for r in rows(store)] == [("step200", old)]
    capsys.readouterr()
    assert cli(*common, "--all-revisions", "--manifest-only", "--rewrite-manifest") == 0 and capsys.readouterr().out == "0-2\n"
    m = read_manifest(store)
    assert m.task_names() == ["step100", "step200", "step300"] and m.entries["step200"]["commit"] == new  # names and indices kept
    assert cli(*common, "--failed-tasks") == 0 and capsys.readouterr().out == "0-2\n"  # step200 moved: to measure again
    for task in ("0", "1", "2"):
        assert cli(*common, "--task", task) == 0
    c = {n: online.commit_of("org/moving", n) for n in ("step100", "step300")}
    want = [("step100", c["step100"]), ("step200", old), ("step200", new), ("step300", c["step300"])]
    assert sorted((r["revision"], r["commit"]) for r in rows(store)) == sorted(want)


# ---- a resume that converges ---------------------------------------------------------------------------------------------
def test_a_task_writes_every_member_even_when_the_first_is_recorded(online, tmp_path, monkeypatch, capsys):
    """--task N returned early once its task's first member was recorded: after a full disk between the two members'
    records the second was never written, and --failed-tasks listed the task forever."""
    store = tmp_path / "store"
    m = write_manifest("org/pair", out_dir=store, probes=PROBES)
    assert m.tasks() == [["step100"], ["step200", "step300"], ["step400"]]
    real = ReplayStore.write

    def full_disk(self, row):
        if row["revision"] == "step300" and row.get("status") == "ok":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, row)

    monkeypatch.setattr(ReplayStore, "write", full_disk)
    with pytest.raises(OSError, match="No space left"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replay_revision("org/pair", "step200", out_dir=store, probes=PROBES, fetch=FAST)
    monkeypatch.undo()
    assert {r["revision"]: r["status"] for r in rows(store)} == {"step200": "ok", "step300": "failed"}
    assert failed_tasks("org/pair", out_dir=store, probes=PROBES) == ["step100", "step200", "step400"]  # 0 and 2 never ran
    online.log.clear()
    capsys.readouterr()
    assert cli("org/pair", "--out", str(store), *PROBE_ARGS, "--failed-tasks") == 0 and capsys.readouterr().out == "0-2\n"
    assert cli("org/pair", "--out", str(store), *PROBE_ARGS, "--task", "1") == 0
    by = {r["revision"]: r for r in rows(store)}
    assert by["step300"]["status"] == "ok" and by["step300"]["measured_as"] == "step200"  # the recorded measurement, reused
    assert by["step300"]["selectivity"] == by["step200"]["selectivity"] and online.downloads() == []
    assert not list((store / "records").glob("*.failed.json"))
    assert failed_tasks("org/pair", out_dir=store, probes=PROBES) == ["step100", "step400"]


def test_a_unit_killed_by_sigkill_is_recorded_by_finalize_and_its_folder_swept(online, tmp_path, capsys):
    """A unit killed with SIGKILL left its whole revision in $TMPDIR and no failed row. Its folder is in the store
    (a retry on any node finds it), its marker says it began (a dead attempt's: --rewrite-manifest is not refused), --failed-tasks
    lists it, finalize records it and sweeps, and the resubmission converges."""
    store, faults = tmp_path / "store", tmp_path / "faults"
    args = ["org/pair", "--out", str(store), *PROBE_ARGS]
    assert cli(*args, "--manifest-only") == 0
    replay_faults.plant(faults, "step100", "kill")
    e = replay_faults.env(faults, online.env())
    e["PYTHONPATH"] += os.pathsep + (os.environ.get("PYTHONPATH") or str(ROOT))
    unit = subprocess.Popen([sys.executable, "-m", "sinkwatch", "replay", *args, "--task", "0"], env=e, stderr=subprocess.DEVNULL)
    try:
        pid = replay_faults.ready(faults, "step100", 240, alive=lambda: unit.poll() is None)
        assert pid == unit.pid
    finally:
        os.kill(unit.pid, signal.SIGKILL)
        unit.wait()
    left = [p for p in (store / "cache").rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in left) and list((store / "running").glob("*.json"))
    assert rows(store) == []  # nothing written: SIGKILL runs no handler
    capsys.readouterr()
    assert cli(*args, "--manifest-only", "--rewrite-manifest") == 0  # a dead attempt's marker (its lock died with it) blocks nothing
    capsys.readouterr()
    assert cli(*args, "--failed-tasks") == 0 and capsys.readouterr().out == "0-2\n"
    assert cli(*args, "--finalize", "--no-ablate") == 1
    assert "failed: step100: Killed: the attempt started" in capsys.readouterr().out
    assert not (store / "cache").exists() and not list((store / "running").glob("*.json"))
    for task in ("0", "1", "2"):
        assert cli(*args, "--task", task) == 0
    assert cli(*args, "--failed-tasks") == 0 and capsys.readouterr().out.splitlines()[-1] == ""
    assert sorted(r["revision"] for r in rows(store)) == ["step100", "step200", "step300", "step400"]
    assert all(r["status"] == "ok" for r in rows(store)) and not [p for p in (store / "cache").rglob("*") if p.is_file()]


def test_a_task_a_limit_ended_twice_is_not_resubmitted_and_finalize_says_what_limit_to_ask(online, tmp_path, capsys):
    """A revision slower than --time was killed at the same point every round of the docs' resubmission loop, and
    nothing said to raise the limit. After the second SIGTERM in a row (Slurm's --time) --failed-tasks leaves it out,
    and finalize says how far it got and the limit to ask for."""
    store, faults = tmp_path / "store", tmp_path / "faults"
    args = ["org/pair", "--out", str(store), *PROBE_ARGS]
    assert cli(*args, "--manifest-only") == 0
    e = replay_faults.env(faults, online.env())
    e["PYTHONPATH"] += os.pathsep + (os.environ.get("PYTHONPATH") or str(ROOT))
    listed = []
    for _ in range(2):
        replay_faults.plant(faults, "step100", "hang")
        unit = subprocess.Popen([sys.executable, "-m", "sinkwatch", "replay", *args, "--task", "0"], env=e, stderr=subprocess.DEVNULL)
        os.kill(replay_faults.ready(faults, "step100", 240, alive=lambda p=unit: p.poll() is None), signal.SIGTERM)
        assert unit.wait(60) == 143
        (faults / "step100.ready").unlink()
        listed.append(failed_tasks("org/pair", out_dir=store, probes=PROBES))
    assert listed == [["step100", "step200", "step400"], ["step200", "step400"]]
    assert cli(*args, "--task", "2") == 0  # one revision recorded: the report needs one
    capsys.readouterr()
    assert cli(*args, "--finalize", "--no-ablate") == 1
    said = capsys.readouterr().out
    assert re.search(r"over the limit: step100: ended by the engine's limit 2 times in a row, the last after \d+ s in probe; "
                     r"not listed by --failed-tasks: resubmit task 0 with a limit of \d+ min or more", said), said  # fmt: skip
    assert json.loads((store / "trajectory.json").read_text())["over_limit"]["step100"]["count"] == 2
    md = build_report([store], tmp_path / "rep").read_text()
    assert re.search(r"`step100`: .* over the limit: ended by it 2 times in a row, the last after \d+ s in probe: ask for \d+ min", md)


# ---- wrong branches --------------------------------------------------------------------------------------------------
def test_a_step_serving_mains_weights_is_flagged_unless_it_is_the_final_step(online, tmp_path):
    """A step branch serving another ref's weights was drawn unless two *step* branches shared them."""
    with pytest.warns(RuntimeWarning, match="step100, main serve identical weights — step100 flagged"):
        got = replay("org/mainish", out_dir=tmp_path, probes=PROBES, progress=False, fetch=FAST)
    assert {r["revision"]: r["duplicate_of"] for r in got} == {"step100": "main", "step200": None}
    assert [r["revision"] for r in merged_records(tmp_path)] == ["step200"]


def test_the_engines_honour_skip_duplicates(online, tmp_path):
    """Engines ignored --skip-duplicates: the manifest planned the flagged revision and the unit measured it."""
    m = write_manifest("org/mainish", out_dir=tmp_path / "a", probes=PROBES, skip_duplicates=True)
    assert m.tasks() == [["step200"]]  # never a task, never downloaded
    write_manifest("org/mainish", out_dir=tmp_path / "b", probes=PROBES)  # planned without it, asked at the task
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = replay_revision("org/mainish", "step100", out_dir=tmp_path / "b", probes=PROBES, fetch=FAST, skip_duplicates=True)
    assert row is None and rows(tmp_path / "b") == [] and online.downloads("model.") == []
    assert failed_tasks("org/mainish", out_dir=tmp_path / "b", probes=PROBES, skip_duplicates=True) == ["step200"]


def test_a_revision_whose_metadata_failed_is_asked_again_when_its_task_runs(online, weights, tmp_path):
    """A revision whose metadata request failed was warned about, recorded with a null fingerprint and drawn. Its
    task asks again: step100 then turns out to serve main's weights (flagged, not drawn); step200's metadata keeps
    failing, so it is drawn marked unverified, and the report says so."""
    for branch, w in (("step100", "w0"), ("step200", "w1"), ("step300", "w2"), ("main", "w0")):
        online.add_revision("org/meta", branch, weights[w])
    c = {b: online.commit_of("org/meta", b) for b in ("step100", "step200")}
    online.fail(f"/api/models/org/meta/revision/{c['step100']}", times=1, status=503)  # the manifest's request only
    online.fail(f"/api/models/org/meta/revision/{c['step200']}", times=3, status=503)  # the manifest's, step100's task's, its own task's
    store = tmp_path / "store"
    with pytest.warns(RuntimeWarning, match="no weights fingerprint for step100 .*step200 "):
        write_manifest("org/meta", out_dir=store, probes=PROBES, fetch=FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for task in ("step100", "step200", "step300"):
            replay_revision("org/meta", task, out_dir=store, probes=PROBES, fetch=FAST)
    by = {r["revision"]: r for r in rows(store)}
    assert by["step100"]["duplicate_of"] == "main" and by["step100"]["weights_fingerprint"] is not None
    assert "503" in by["step200"]["weights_unverified"] and by["step200"]["duplicate_of"] is None
    assert [r["revision"] for r in merged_records(store)] == ["step200", "step300"]
    md = build_report([store], tmp_path / "rep").read_text()
    assert "Unverified weights" in md and "`step200`" in md[md.index("Unverified weights") :]
    assert "step100" in md[md.index("Duplicated weights") :]


def test_every_wrong_branch_layout_is_flagged_though_the_manifest_could_not_read_the_original(online, weights, tmp_path):
    """The manifest's metadata request for the original failed — a tag, main, an unplanned step — and the tasks asked
    again only for their own members, so a step serving those weights was drawn unflagged. Each task now asks again
    for every ref it could copy: step100 (a tag's weights), step200 (main's), step300 (an unplanned step's) flagged;
    the final step step400 never."""
    for branch, w in (("step100", "w0"), ("step200", "w1"), ("step250", "w2"), ("step300", "w2"), ("step400", "w3"), ("main", "w1")):
        online.add_revision("org/layout", branch, weights[w])
    online.add_tag("org/layout", "v1.0", weights["w0"])
    for ref in ("v1.0", "main", "step250"):  # the manifest's request only
        online.fail(f"/api/models/org/layout/revision/{online.commit_of('org/layout', ref)}", times=1, status=503)
    store = tmp_path / "store"
    with pytest.warns(RuntimeWarning, match="no weights fingerprint for"):
        m = write_manifest("org/layout", out_dir=store, revisions=["step100", "step200", "step300", "step400", "main"], probes=PROBES,
                           fetch=FAST)  # fmt: skip
    assert {n for n, e in m.entries.items() if e.get("metadata_error")} == {"v1.0", "main", "step250"} and m.groups() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for task in m.task_names():
            replay_revision("org/layout", task, out_dir=store, probes=PROBES, fetch=FAST)
    by = {r["revision"]: r for r in rows(store)}
    assert {n: r["duplicate_of"] for n, r in by.items()} == {
        "step100": "v1.0",
        "step200": "main",
        "step300": "step250",
        "step400": None,
        "main": None,
    }  # pinned main: measured, never flagged
    assert not any("weights_unverified" in r for r in by.values())
    assert [r["revision"] for r in merged_records(store)] == ["step400", "main"]  # the report too: no wrong branch drawn


def test_a_step_that_could_copy_an_unreadable_ref_is_marked_unverified(online, weights, tmp_path):
    """main serves step100's weights, and its metadata can never be read: step100 cannot be told from its copy, so its
    record says weights_unverified naming main; the final step's record does not (it keeps whatever it shares)."""
    for branch, w in (("step100", "w0"), ("step200", "w1"), ("main", "w0")):
        online.add_revision("org/unread", branch, weights[w])
    online.fail(f"/api/models/org/unread/revision/{online.commit_of('org/unread', 'main')}", times=50, status=503)
    store = tmp_path / "store"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = write_manifest("org/unread", out_dir=store, probes=PROBES, fetch=FAST)
        for task in m.task_names():
            replay_revision("org/unread", task, out_dir=store, probes=PROBES, fetch=FAST)
    by = {r["revision"]: r for r in rows(store)}
    assert "main: " in by["step100"]["weights_unverified"] and "503" in by["step100"]["weights_unverified"]
    assert "weights_unverified" not in by["step200"] and [r["revision"] for r in merged_records(store)] == ["step100", "step200"]
    assert all(r["duplicate_of"] is None and r["status"] == "ok" for r in by.values())
    online.clear_faults()


def test_the_report_takes_the_duplicate_groups_from_the_manifest(online, weights, tmp_path):
    """The report trusted each record's stamped duplicate_of: a branch found later to serve step100's weights left
    step100 drawn, since its record was written before and says duplicate_of: null."""
    online.add_revision("org/late", "step100", weights["w0"])
    online.add_revision("org/late", "step200", weights["w1"])
    store = tmp_path / "store"
    assert [r["duplicate_of"] for r in replay("org/late", out_dir=store, probes=PROBES, progress=False, fetch=FAST)] == [None, None]
    online.add_revision("org/late", "step150", weights["w0"])  # published later: step100's weights again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_manifest("org/late", out_dir=store, probes=PROBES, rewrite=True)
    assert json.loads(next(p for p in (store / "records").glob("*.json")).read_text())["duplicate_of"] is None  # the stamp
    assert [r["revision"] for r in merged_records(store)] == ["step200"]
    md = build_report([store], tmp_path / "rep").read_text()
    assert "step100, step150" in md[md.index("Duplicated weights") :]


def test_a_local_subset_is_checked_against_the_whole_folder(tmp_path):
    """A checkpoint in a local subset holding the weights of one outside the subset was not flagged."""
    run = tmp_path / "run"
    for step, seed in ((100, 0), (200, 1), (300, 1), (400, 2)):
        build("llama", seed=seed).save_pretrained(run / f"checkpoint-{step}")
    with pytest.warns(RuntimeWarning, match="checkpoint-200, checkpoint-300 serve identical weights"):
        got = replay(str(run), out_dir=tmp_path / "store", revisions=["checkpoint-100", "checkpoint-200"], probes=PROBES,
                     progress=False)  # fmt: skip
    assert {r["revision"]: r["duplicate_of"] for r in got} == {"checkpoint-100": None, "checkpoint-200": "checkpoint-200"}
    assert [r["revision"] for r in merged_records(tmp_path / "store")] == ["checkpoint-100"]
    summary = finalize(str(run), out_dir=tmp_path / "store", probes=PROBES, ablate=False)
    assert summary["done"] == ["checkpoint-100", "checkpoint-200"] and summary["missing"] == []
