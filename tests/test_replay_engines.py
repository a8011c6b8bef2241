"""Replay on the engines clusters already run (issue 26): a real one-node Slurm cluster (slurmctld, slurmd,
munged, started once per session in a private directory, stopped by PID), submitit's SlurmExecutor on it,
and a local Ray cluster — each running the docs' commands against the stand-in hub through huggingface_hub.

Under CI=true an engine that is missing fails these tests instead of skipping them (scripts/test.sh --system
installs them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import slurm_cluster
import torch
from local_hub import LocalHub, patched_endpoint
from tiny_models import build

from sinkwatch.cli import main
from sinkwatch.replay import RevisionFailed, read_manifest, record_files
from sinkwatch.reporting.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "docs" / "replay.md").read_text()
REPO = "org/engines"
NAMES = ["step0", "step100", "step200", "step300"]
STORE = "/shared/runs/pythia-1b"


def missing(reason: str):
    """An engine this machine lacks: a skip here, a failure under CI (where scripts/test.sh installs every engine)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}: scripts/test.sh --system installs every engine, none may be skipped")
    pytest.skip(reason)


@pytest.fixture(scope="module")  # not session: it points this process's huggingface_hub at the stand-in hub while it lives
def engine_hub(tmp_path_factory):
    """Four revisions of a tiny Llama; step300 serves step200's weights (a wrong branch: one task of two names)."""
    d = tmp_path_factory.mktemp("engine_revisions")
    with LocalHub() as h:
        for i, name in enumerate(NAMES[:3]):
            build("llama", seed=i).save_pretrained(d / name)
            h.add_revision(REPO, name, d / name)
        h.add_revision(REPO, "step300", d / "step200")
        with patched_endpoint(h.endpoint):
            yield h


@pytest.fixture()
def hub(engine_hub):
    engine_hub.log.clear()
    yield engine_hub
    engine_hub.clear_faults()


def env(hub) -> dict:
    e = hub.env()
    e["PYTHONPATH"] = os.environ.get("PYTHONPATH") or str(ROOT)
    return e


def recipe(tmp: Path) -> Path:
    path = tmp / "tiny.yaml"
    path.write_text(f"model: {REPO}\nname: tiny\nprobes:\n  induction: {{n: 8, seq_len: 64}}\n")
    return path


def rows(store) -> list[dict]:
    return [r for p in record_files(store) for r in read_jsonl(p)]


def ok_names(store) -> list[str]:
    return sorted(r["revision"] for r in rows(store) if r.get("status") == "ok")


def docs_lines(start: str, count: int) -> list[str]:
    lines = DOCS.splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith(start))
    return lines[i : i + count]


def docs_python(marker: str) -> str:
    at = DOCS.index("## A full trajectory on a cluster")
    while True:
        start = DOCS.index("```python", at) + len("```python")
        end = DOCS.index("```", start)
        if marker in DOCS[start:end]:
            return DOCS[start:end]
        at = end + 3


# ---- Slurm ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    why = slurm_cluster.available()
    if why:
        missing(why)
    cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory):
    """``sinkwatch`` on PATH as this interpreter's module: the docs' lines run as written."""
    d = tmp_path_factory.mktemp("bin")
    (d / "sinkwatch").write_text(f"#!/bin/sh\nexec {sys.executable} -m sinkwatch \"$@\"\n")
    (d / "sinkwatch").chmod(0o755)
    return d


HUNG = textwrap.dedent(
    """
    import os, sys, time
    T0 = time.time()
    import sinkwatch.monitor

    def hang(*a, **k):  # a probe that never returns; it says when it started (inside the unit's SIGTERM handling)
        with open(os.environ["SINKWATCH_HUNG_READY"] + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {time.time() - T0:.1f}")
        os.replace(os.environ["SINKWATCH_HUNG_READY"] + ".tmp", os.environ["SINKWATCH_HUNG_READY"])
        time.sleep(3600)

    sinkwatch.monitor.Monitor.probe = hang
    from sinkwatch.cli import main
    raise SystemExit(main(sys.argv[1:]))
    """
)


@pytest.fixture(scope="module")
def hung_job(slurm, engine_hub, tmp_path_factory):
    """A task whose probe hangs: submitted first (``--time=10``), checked last, when its time limit is cut to one
    minute — once its probe hangs, so that the limit's SIGTERM finds the unit in its probe and not still
    importing torch (on a loaded machine that alone took 90 s here). Run with ``exec``, as the docs' lines are:
    the unit is the job's process, so the job ends only when the unit has (see docs/replay.md)."""
    d = tmp_path_factory.mktemp("hung")
    store = d / "store"
    with patched_endpoint(engine_hub.endpoint):
        assert main(["replay", str(recipe(d)), "--out", str(store), "--revisions", "step0", "--manifest-only"]) == 0
    script = d / "hung.py"
    script.write_text(HUNG)
    cmd = f"exec {sys.executable} {script} replay {recipe(d)} --out {store} --task 0 --no-progress"
    e = {**env(engine_hub), "SINKWATCH_HUNG_READY": str(d / "ready")}
    job = slurm.sbatch(["--time=10", "-o", str(d / "out.txt"), "--wrap", cmd], cwd=d, env=e)
    yield job, store, d, time.time()
    if slurm.states(job).get(job) in ("PENDING", "RUNNING"):  # the time-limit test did not run: nothing left behind
        subprocess.run(["scancel", job], env=slurm.env(), timeout=30)
        slurm.wait(job, 60)


def test_slurm_runs_the_docs_array_retries_the_failed_index_and_finalizes_on_afterany(slurm, hub, hung_job, bin_dir, tmp_path):
    """The docs' four Slurm lines as written: the manifest, one revision per array task, finalize on afterany
    (it runs though a task failed, and says which), the failed index resubmitted, finalize again."""
    manifest_line, array_line, finalize_line, retry_line = docs_lines("sinkwatch replay pythia-1b --out", 4)
    store = tmp_path / "store"
    yaml = recipe(tmp_path)

    def here(line: str) -> str:
        line = line.split("   #")[0].replace(STORE, str(store)).replace("pythia-1b", str(yaml)).replace(" --gpus=1", "")
        return line.replace("--task $SLURM_ARRAY_TASK_ID", "--task $SLURM_ARRAY_TASK_ID --retries 0 --no-progress")

    e = {**slurm.env(env(hub)), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    def bash(script: str) -> str:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=e, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return res.stdout

    out = bash(here(manifest_line))
    m = read_manifest(store)
    assert m.tasks() == [["step0"], ["step100"], ["step200", "step300"]]  # step300 serves step200's weights: one task
    assert "sbatch --array=0-2" in out
    # the driver asked the hub once per commit; the tasks ask nothing but their downloads
    hub.log.clear()
    hub.fail(f"{hub.commit_of(REPO, 'step100')}/model.safetensors", times=1, status=503, method="GET")  # task 1 fails once
    array = here(array_line).replace("--array=0-153", "--array=0-2")
    first = bash(f"{array}\necho $JOB\n" + here(finalize_line).replace("sbatch ", f"sbatch --parsable -o {tmp_path}/final1.txt ", 1))
    job, final = first.split()[-2:]
    states = slurm.wait(job, 150)
    assert states == {"0": "COMPLETED", "1": "FAILED", "2": "COMPLETED"}, states
    assert slurm.wait(final, 120) == {final: "FAILED"}  # afterany: it ran, and exited 1 for the failure
    said = (tmp_path / "final1.txt").read_text()
    assert "3 done, 1 failed, 0 missing" in said and "failed: step100: " in said and "503" in said
    asked = [p for m_, p, s in hub.log if p.startswith(f"/api/models/{REPO}")]
    assert asked and not [p for p in asked if p.endswith("/refs")], asked  # the tasks list nothing...
    assert all(p.split("/")[6] in m.refs.values() for p in asked), asked  # ...and name commits, never branches
    assert ok_names(store) == ["step0", "step200", "step300"]
    assert bash(here(retry_line.split(" --time")[0].split("$(")[1].split(")")[0])).strip() == "1"  # --failed-tasks
    retry = bash(here(retry_line).replace("sbatch --array", "sbatch --parsable --array"))
    assert slurm.wait(retry.strip(), 150) == {"1": "COMPLETED"}
    assert bash(here(finalize_line.split("--wrap '")[1].rstrip("'"))).count("4 done, 0 failed, 0 missing") == 1  # finalize again
    assert ok_names(store) == NAMES and not list((store / "records").glob("*.failed.json"))  # the success replaced the failure
    step200, step300 = (next(r for r in rows(store) if r["revision"] == n) for n in ("step200", "step300"))
    assert step300["measured_as"] == "step200" and step300["selectivity"] == step200["selectivity"]  # measured once
    assert step300["duplicate_of"] == step200["duplicate_of"] == "step200"


# ---- submitit on that Slurm ---------------------------------------------------------------------------------------------
def test_submitit_runs_the_docs_block_and_a_raised_failure_reaches_the_caller(slurm, hub, tmp_path, monkeypatch):
    try:
        import submitit
    except ImportError:
        missing("submitit is not installed (pip install submitit; it is in the dev extra)")
    for k, v in slurm.env(env(hub)).items():
        if os.environ.get(k) != v:
            monkeypatch.setenv(k, v)
    for k in [k for k in os.environ if k.startswith(("SLURM_", "SBATCH_")) and k != "SLURM_CONF"]:
        monkeypatch.delenv(k)
    store = tmp_path / "store"
    code = docs_python("submitit.SlurmExecutor")
    options = dict(probes=[_probe()], cache_dir=str(tmp_path / "cache"), fetch=_fast())
    for old, new in (
        ('load_recipe("pythia-1b")', repr(REPO)),
        ('"/shared/runs/pythia-1b"', repr(str(store))),
        ("time=120, gpus_per_node=1", "time=5"),
        ("out_dir=OUT)", "out_dir=OUT, **TEST_OPTIONS)"),
    ):
        assert old in code, old
        code = code.replace(old, new)
    scope = {"__name__": "__main__", "TEST_OPTIONS": options}
    exec(compile(code, "docs/replay.md", "exec"), scope)
    assert [r["revision"] for r in scope["records"]] == ["step0", "step100", "step200"]
    assert scope["summary"]["done"] == NAMES and scope["summary"]["failed"] == {}
    # a raised failure: the job's exception reaches job.result(), and the failed row is in the store
    hub.fail(f"{hub.commit_of(REPO, 'step0')}/model.safetensors", times=10_000, status=503, method="GET")
    other = tmp_path / "other"
    from sinkwatch.replay import replay_revision, write_manifest

    write_manifest(REPO, out_dir=other, revisions=["step0"], **{k: v for k, v in options.items() if k != "fetch"})
    executor = submitit.SlurmExecutor(folder=str(tmp_path / "submitit"))
    executor.update_parameters(time=5)
    job = executor.submit(replay_revision, REPO, "step0", out_dir=other, **options)
    with pytest.raises(Exception, match="RevisionFailed.*step0 failed.*503"):
        job.result()
    assert [(r["revision"], r["status"]) for r in rows(other)] == [("step0", "failed")]


def _probe():
    from sinkwatch import InductionProbe

    return InductionProbe(n=8, seq_len=64)


def _fast():
    from sinkwatch.replay import FetchConfig

    return FetchConfig(retries=0, backoff_s=0.01, backoff_max_s=0.05)


# ---- Ray --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster(engine_hub):
    try:
        import ray
    except ImportError:
        missing("ray is not installed (pip install ray; it is in the dev extra)")
    e = env(engine_hub)
    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=128 * 1024**2, log_to_driver=False,
        runtime_env={"env_vars": {k: e[k] for k in ("HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_XET", "PYTHONPATH")}},
    )  # fmt: skip
    yield ray
    ray.shutdown()


def test_ray_runs_the_docs_block_and_retries_a_raised_failure(ray_cluster, hub, tmp_path):
    """The unit as a Ray task with max_retries and retry_exceptions=True: step100 fails once (a 503 on its
    weights, no hub retries), its failed row is written, Ray runs the task again, the success replaces it."""
    store = tmp_path / "store"
    code = docs_python("ray.remote")
    options = dict(probes=[_probe()], cache_dir=str(tmp_path / "cache"), fetch=_fast())
    for old, new in (
        ('load_recipe("pythia-1b")', repr(REPO)),
        ('"/shared/runs/pythia-1b"', repr(str(store))),
        ("out_dir=OUT)", "out_dir=OUT, **TEST_OPTIONS)"),
    ):
        assert old in code, old
        code = code.replace(old, new)
    hub.fail(f"{hub.commit_of(REPO, 'step100')}/model.safetensors", times=1, status=503, method="GET")
    scope = {"__name__": "__main__", "TEST_OPTIONS": options}
    exec(compile(code, "docs/replay.md", "exec"), scope)
    assert [(r["revision"], r["status"]) for r in scope["records"]] == [("step0", "ok"), ("step100", "ok"), ("step200", "ok")]
    assert [s for m, p, s in hub.log if m == "GET" and p.endswith(f"{hub.commit_of(REPO, 'step100')}/model.safetensors")] == [503, 200]
    assert scope["summary"]["done"] == NAMES and ok_names(store) == NAMES
    assert not list((store / "records").glob("*.failed.json"))  # the retry's success replaced the failed row


def test_the_unit_without_a_manifest_names_the_command_that_writes_it(tmp_path):
    with pytest.raises(ValueError, match=r"no manifest.json in .*sinkwatch replay org/engines --out .* --manifest-only"):
        from sinkwatch.replay import replay_revision

        replay_revision(REPO, "step0", out_dir=tmp_path, probes=[_probe()])
    assert RevisionFailed.__mro__[1] is RuntimeError and torch is not None


def test_slurm_time_limit_kills_a_hung_task_which_writes_its_failed_row(slurm, hung_job):
    """A task whose probe never returns (submitted first, checked last: it hangs while the other tests run), its
    time limit cut to one minute once it hangs: Slurm sends SIGTERM at the limit, the unit writes its failed row
    (saying so) and exits; the job ends TIMEOUT — after the unit exited — and nothing is left in its own cache."""
    job, store, d, started = hung_job
    ready = d / "ready"
    deadline = time.time() + 240  # the task imports torch and loads the model first: 10 s idle, 90 s on a loaded machine
    while not ready.exists() and time.time() < deadline and slurm.states(job).get(job) in ("PENDING", "RUNNING"):
        time.sleep(0.5)

    def out() -> str:
        return (d / "out.txt").read_text()[-3000:] if (d / "out.txt").exists() else ""

    assert ready.exists(), f"the task never reached its hung probe: {slurm.states(job)} {out()}"
    pid, after = ready.read_text().split()
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=1"], env=slurm.env(), check=True, timeout=30)
    # the limit is checked every 30 s: killed 60-90 s after the start, or within 30 s when that has passed
    assert slurm.wait(job, 150) == {job: "TIMEOUT"}, f"hung {after} s after its start; {out()}"
    assert not Path(f"/proc/{pid}").exists(), f"the job ended TIMEOUT while its unit (pid {pid}) still runs"
    failed = [r for r in rows(store) if r.get("status") == "failed"]
    assert [r["revision"] for r in failed] == ["step0"] and "SIGTERM" in failed[0]["error"], rows(store)
    left = [p for p in Path(tempfile.gettempdir()).glob("sinkwatch-task-*") if p.stat().st_mtime >= started]
    assert not left  # every task's own cache went with it (SIGTERM too)
