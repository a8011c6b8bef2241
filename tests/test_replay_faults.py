"""Replay under the faults clusters produce, as they happen (docs/replay.md, "A full trajectory on a cluster"):
two attempts at one task at once, a unit stuck in C that ignores SIGTERM until Slurm's KillWait, an
``scontrol requeue`` while the first attempt lives, and a Ray task that ignores its cancel until it is
force-cancelled. Each ends with exactly one record per revision and nothing on disk: no task folder, no marker.

One Slurm cluster (KillWait 3 s) and one Ray cluster for the module, against the stand-in hub. Under CI=true a
missing engine fails these tests instead of skipping them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import replay_faults
import slurm_cluster
from local_hub import tiny_revisions

from sinkwatch import InductionProbe
from sinkwatch.replay import FetchConfig, attempts, failed_tasks, finalize, record_files, replay_revision, run_with_limit, write_manifest
from sinkwatch.reporting.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
REPO = "org/faults"
NAMES = ["step1", "step2"]
PROBES = [InductionProbe(n=8, seq_len=64)]
ARGS = ["--probe", "induction", "--n", "8", "--seq-len", "64", "--no-progress", "--wandb", "disabled", "--retries", "0"]
FAST = FetchConfig(retries=0, backoff_s=0.01, backoff_max_s=0.05)


def missing(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}: scripts/test.sh --system installs every engine, none may be skipped")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with tiny_revisions(tmp_path_factory.mktemp("fault_revisions"), REPO, NAMES) as h:
        yield h


def env(hub, faults: Path) -> dict:
    e = replay_faults.env(faults, hub.env())
    e["PYTHONPATH"] += os.pathsep + (os.environ.get("PYTHONPATH") or str(ROOT))
    return e


def unit(store: Path) -> list[str]:
    return [sys.executable, "-m", "sinkwatch", "replay", REPO, "--out", str(store), *ARGS, "--task"]


def converged(store: Path, hub) -> None:
    """Exactly one ok record per revision at its commit, no failed row, no task folder, no attempt marker."""
    got = sorted((r["revision"], r["commit"], r["status"]) for p in record_files(store) for r in read_jsonl(p))
    assert got == [(n, hub.commit_of(REPO, n), "ok") for n in NAMES], got
    for left in ("cache", "running"):
        assert not (store / left).exists() or not any((store / left).iterdir()), list((store / left).rglob("*"))


def settle(store: Path) -> dict:
    """finalize, then the docs' resubmission of what it lists (in this process), then finalize again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = finalize(REPO, out_dir=store, probes=PROBES, ablate=False)
        for task in failed_tasks(REPO, out_dir=store, probes=PROBES):
            replay_revision(REPO, task, out_dir=store, probes=PROBES, fetch=FAST)
        assert finalize(REPO, out_dir=store, probes=PROBES, ablate=False)["failed"] == {}
    return first


def test_two_attempts_at_one_task_at_once_both_end_well_with_one_record(hub, tmp_path):
    """The second attempt starts while the first downloads (a requeue, a resubmission before the array ended): it
    used to delete the first's folder, and whichever ended first deleted the other's. Both now succeed; the record's
    exclusive create keeps one result. Meanwhile the plan is not rewritten (a live attempt's marker)."""
    store, faults = tmp_path / "store", tmp_path / "faults"
    write_manifest(REPO, out_dir=store, probes=PROBES)
    hub.throttle(60_000)  # bytes/s: a revision's weights take a few seconds
    started = threading.Event()
    hub.on_request = lambda method, path: started.set() if method == "GET" and path.endswith("model.safetensors") else None
    try:
        first = subprocess.Popen([*unit(store), "0"], env=env(hub, faults), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert started.wait(120), "the first attempt never started downloading"
        second = subprocess.Popen([*unit(store), "0"], env=env(hub, faults), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with pytest.raises(ValueError, match="not rewritten while tasks run: step1"):  # a live attempt holds the plan
            write_manifest(REPO, out_dir=store, probes=PROBES, rewrite=True)
        outs = [p.communicate(timeout=300)[0] for p in (first, second)]
    finally:
        hub.throttle(None)
        hub.on_request = None
    assert [first.returncode, second.returncode] == [0, 0], [o[-2000:] for o in outs]
    assert len(list((store / "records").glob("*.json"))) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replay_revision(REPO, "step2", out_dir=store, probes=PROBES, fetch=FAST)
    converged(store, hub)


# ---- Slurm ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurm_cluster.available()
    if why:
        missing(why)
    with slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"), kill_wait=3, max_array_size=1) as cluster:
        yield cluster


def test_slurm_a_unit_deaf_to_sigterm_and_a_requeue_beside_the_live_attempt(slurm, hub, tmp_path):
    """Task 0 is stuck in C: scancel's SIGTERM never reaches Python, KillWait's SIGKILL ends it (no row: finalize writes
    it). Task 1's first attempt is stuck too, outside Slurm's tracking (started without exec and reparented, which
    proctrack/linuxproc loses): `scontrol requeue` ends its job, not it, and the next attempt runs beside it and records
    the revision. Finalize then leaves the live attempt's folder alone; once it is killed, finalize sweeps it. The
    cluster's MaxArraySize is 1 (index 0 only): task 1 goes in the docs' offset form, an array of its own."""
    store, faults = tmp_path / "store", tmp_path / "faults"
    write_manifest(REPO, out_dir=store, probes=PROBES)
    for name in NAMES:
        replay_faults.plant(faults, name, "native")
    task = " ".join(unit(store))
    script = tmp_path / "task.sh"
    script.write_text(  # $1: the offset; the docs' --task $((SLURM_ARRAY_TASK_ID + 1000)) with a cap of 1
        "#!/bin/bash\n"
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ] && [ "$1" = 1 ]; then setsid -f ' + task + " $1; sleep 600; fi\n"
        f"exec {task} $((SLURM_ARRAY_TASK_ID + $1))\n"
    )
    with pytest.raises(RuntimeError, match="Invalid job array specification"):
        slurm.sbatch(["--array=0-1", str(script), "0"], cwd=tmp_path)
    jobs = [
        slurm.sbatch(["--array=0-0", "--time=10", "--requeue", str(script), str(k)], cwd=tmp_path, env=env(hub, faults)) for k in (0, 1)
    ]
    deaf, escaped = replay_faults.ready(faults, "step1", 120), replay_faults.ready(faults, "step2", 120)
    try:
        for cmd in (["scancel", f"{jobs[0]}_0"], ["scontrol", "requeue", f"{jobs[1]}_0"]):
            subprocess.run(cmd, env=slurm.env(), check=True, capture_output=True, timeout=30)
        time.sleep(1)
        assert _alive(deaf), "SIGTERM ended a unit stuck in C: the fault did not hold"
        _release(slurm, f"{jobs[1]}_0")
        assert [slurm.wait(j, 180) for j in jobs] == [{"0": "CANCELLED"}, {"0": "COMPLETED"}], _logs(tmp_path)
        assert not _alive(deaf) and _alive(escaped)  # KillWait's SIGKILL; the escaped first attempt lives on, stuck
        beside = settle(store)  # finalize beside a live attempt: its marker and folder are left alone
        assert beside["running"] == ["step2"] and beside["failed"]["step1"].startswith("Killed: the attempt started"), beside
        assert [p.name.split("@")[0] for p in (store / "cache").iterdir()] == [p.stem.split("@")[0] for p in (store / "running").iterdir()]
    finally:
        os.kill(escaped, signal.SIGKILL)  # the node's reaper, at last
    _wait_gone(escaped, store)
    assert settle(store)["running"] == []
    converged(store, hub)


def _release(slurm, task: str) -> None:
    """Slurm holds a requeued job 120 s (BeginTime) once its old processes are gone; released then, as a free slot would."""
    deadline = time.time() + 60
    while time.time() < deadline:
        out = subprocess.run(["scontrol", "-o", "show", "job", task], env=slurm.env(), capture_output=True, text=True, timeout=30).stdout
        if "JobState=PENDING" in out:
            subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now"], env=slurm.env(), check=True, timeout=30)
            return
        time.sleep(0.3)
    raise AssertionError(f"{task} was never requeued: {out}")


def _wait_gone(pid: int, store: Path) -> None:
    """Until the killed process is gone: its leader turns zombie at once, but its lock goes with its last thread."""
    deadline = time.time() + 60
    while any(m.alive() for m in attempts.markers(store)) and time.time() < deadline:
        time.sleep(0.2)
    threads = sorted(p.name for p in Path(f"/proc/{pid}/task").glob("*")) if Path(f"/proc/{pid}").exists() else []
    assert not any(m.alive() for m in attempts.markers(store)), f"pid {pid} still holds its marker; threads {threads}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _logs(d: Path) -> str:
    return "".join(p.read_text()[-1500:] for p in sorted(d.glob("slurm-*.out")))


# ---- Ray --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_faults(hub, tmp_path_factory):
    try:
        import ray
    except ImportError:
        missing("ray is not installed (pip install ray; it is in the dev extra)")
    faults = tmp_path_factory.mktemp("ray_faults")
    e = env(hub, faults)
    keys = ("HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_XET", "PYTHONPATH", "SINKWATCH_TEST_FAULTS")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 1024**2, log_to_driver=False,
             runtime_env={"env_vars": {k: e[k] for k in keys if k in e}})  # fmt: skip
    yield ray, faults
    ray.shutdown()


def test_ray_a_task_deaf_to_its_cancel_is_force_cancelled_and_fails_no_other(ray_faults, hub, tmp_path):
    """step1 is stuck in C: Ray's cancel (KeyboardInterrupt) never gets in, the force-cancel a grace later kills its
    worker (no row: finalize writes it). After it, step1 again and step2 run in fresh workers (max_calls=1: a worker
    a cancel left half-way through an import is never reused) and succeed the first time."""
    ray, faults = ray_faults
    store = tmp_path / "store"
    write_manifest(REPO, out_dir=store, probes=PROBES)
    replay_faults.plant(faults, "step1", "native")
    remote = ray.remote(num_cpus=1, max_retries=3, max_calls=1)(replay_revision)
    t0 = time.monotonic()
    out = run_with_limit(remote, [(REPO, "step1")], out_dir=store, probes=PROBES, fetch=FAST, limit_s=25, grace_s=2)
    assert isinstance(out[0], ray.exceptions.TaskCancelledError) and (faults / "step1.ready").exists(), out
    assert time.monotonic() - t0 < 25 + 2 * 2 + 10  # cancel, force-cancel a grace later, ended
    first = finalize(REPO, out_dir=store, probes=PROBES, ablate=False)
    assert first["failed"]["step1"].startswith("Killed: the attempt started"), first
    again = run_with_limit(remote, [(REPO, n) for n in NAMES], out_dir=store, probes=PROBES, fetch=FAST, limit_s=120, grace_s=2)
    assert [r["status"] for r in again] == ["ok", "ok"], again
    assert finalize(REPO, out_dir=store, probes=PROBES, ablate=False)["failed"] == {}
    converged(store, hub)
