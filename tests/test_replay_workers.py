"""Workers without an engine: a deterministic stride of the manifest's tasks, then one pass over what is
missing — no lease, no heartbeat, no lock — against the stand-in hub through huggingface_hub, with real processes
and real signals.

- a worker measures its stride, then every task nobody began: a partner that never comes leaves nothing undone,
  and one that comes late finds nothing to do;
- a revision slower than anything is recorded whatever its time: there is no hold to outlast (the lease protocol —
  claims, heartbeats, --max-hold, --claim-timeout, the liveness locks and the host-wide cache registry — is gone);
- SIGTERM writes the failed row of the task being measured, empties its folder and exits 143; a rerun converges;
- no lock in replay waits without a limit (the cache registry's and the manifest's had none).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import filelock
import pytest
import replay_faults
from local_hub import tiny_revisions

from sinkwatch import InductionProbe
from sinkwatch.cli import main
from sinkwatch.replay import FetchConfig, finalize, record_files, replay, replay_revision, write_manifest
from sinkwatch.reporting.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
REPO = "org/tiny"
NAMES = ["step0", "step100", "step200", "step300"]
PROBES = [InductionProbe(n=8, seq_len=64)]
PROBE_ARGS = ["--probe", "induction", "--n", "8", "--seq-len", "64", "--no-progress", "--wandb", "disabled", "--retries", "0"]
FAST = FetchConfig(retries=0, backoff_s=0.01, backoff_max_s=0.05)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with tiny_revisions(tmp_path_factory.mktemp("worker_revisions"), REPO, NAMES) as h:
        yield h


def rows(store) -> list[dict]:
    return [r for p in record_files(store) for r in read_jsonl(p)]


def settled(store: Path) -> bool:
    """No task folder holds anything and no attempt is open."""
    cache, running = store / "cache", store / "running"
    return not (cache.exists() and any(cache.iterdir())) and not (running.exists() and any(running.iterdir()))


def worker(hub, store: Path, faults: Path, *env: tuple[str, str]) -> subprocess.Popen:
    e = replay_faults.env(faults, hub.env())
    e["PYTHONPATH"] += os.pathsep + (os.environ.get("PYTHONPATH") or str(ROOT))
    e.update(env)
    cmd = [sys.executable, "-m", "sinkwatch", "replay", REPO, "--out", str(store), *PROBE_ARGS]
    return subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_worker_takes_its_stride_then_what_nobody_began(hub, tmp_path):
    """Rank 0 of 2 alone: its stride (tasks 0 and 2), then the pass over rank 1's (3, then 1) — nobody began them.
    Rank 1, started late, finds nothing to measure. One record per revision, each written by rank 0."""
    store, faults = tmp_path / "store", tmp_path / "faults"
    first = worker(hub, store, faults, ("RANK", "0"), ("WORLD_SIZE", "2"))
    out = first.communicate(timeout=300)[0]
    assert first.returncode == 0 and "replayed 4 revision(s)" in out, out[-3000:]
    late = worker(hub, store, faults, ("RANK", "1"), ("WORLD_SIZE", "2"))
    out = late.communicate(timeout=300)[0]
    assert late.returncode == 0 and "replayed 0 revision(s)" in out, out[-3000:]
    got = sorted(rows(store), key=lambda r: r["written_at"])
    assert [r["revision"] for r in got] == ["step0", "step200", "step300", "step100"]  # the stride, then the pass from the end
    assert {r["worker"].split(".")[0] for r in got} == {"torchrun-0of2"} and settled(store)


def test_no_hold_a_slow_revision_is_recorded_whatever_its_time(hub, tmp_path, capsys):
    """--max-hold could not tell a slow revision from a hung one: a revision slower than the hold was taken over, its
    finished result thrown away, and the job never ended. There is no hold now: two workers, one revision 4 s slower
    than the rest, every revision recorded once, nothing left of a lease protocol."""
    store, faults = tmp_path / "store", tmp_path / "faults"
    replay_faults.plant(faults, "step100", "slow", seconds=4)
    procs = [worker(hub, store, faults, ("RANK", str(r)), ("WORLD_SIZE", "2")) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(r["revision"] for r in rows(store)) == NAMES and all(r["status"] == "ok" for r in rows(store))
    assert not any("taken over" in o or "not written" in o for o in outs), outs
    assert not (store / "claims").exists() and settled(store)
    for gone in ("claims", "liveness"):
        assert importlib.util.find_spec(f"sinkwatch.replay.{gone}") is None
    for option in ("--max-hold", "--claim-timeout"):
        with pytest.raises(SystemExit):
            main(["replay", REPO, "--out", str(tmp_path / "x"), option, "60"])
        assert "unrecognized arguments" in capsys.readouterr().err


def test_sigterm_writes_the_failed_row_empties_the_folder_and_a_rerun_converges(hub, tmp_path):
    store, faults = tmp_path / "store", tmp_path / "faults"
    replay_faults.plant(faults, "step100", "hang")
    p = worker(hub, store, faults)
    try:
        pid = replay_faults.ready(faults, "step100", 240, alive=lambda: p.poll() is None)
        assert list((store / "cache").glob("*/models--org--tiny/snapshots/*"))  # on disk while it is probed
        os.kill(pid, signal.SIGTERM)
        out = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, out[-3000:]
    by = {r["revision"]: r for r in rows(store)}
    assert by["step0"]["status"] == "ok" and by["step100"]["status"] == "failed" and "SIGTERM" in by["step100"]["error"]
    assert settled(store)  # its folder and the next task's (downloading ahead) emptied, their markers gone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = replay(REPO, out_dir=store, probes=PROBES, progress=False, fetch=FAST)
    assert sorted(r["revision"] for r in again) == ["step100", "step200", "step300"]  # the failed one retried by the rerun
    assert sorted((r["revision"], r["status"]) for r in rows(store)) == [(n, "ok") for n in NAMES] and settled(store)


def test_no_lock_in_replay_waits_without_a_limit(hub, tmp_path, monkeypatch):
    """Two file locks (the host-wide cache registry's, and the manifest's, held across hub calls) had no timeout."""
    import fcntl

    waits = []
    acquire = filelock.BaseFileLock.acquire

    def watched(self, timeout=None, *args, **kwargs):
        where = [f for f in _stack() if "/sinkwatch/" in f and "/tests/" not in f]
        t = self.timeout if timeout is None else timeout
        if where and (t is None or t < 0):
            waits.append(("filelock", where[0]))
        return acquire(self, timeout, *args, **kwargs)

    def flock(fd, op, _real=fcntl.flock):
        where = [f for f in _stack() if "/sinkwatch/" in f]
        if where and not op & fcntl.LOCK_NB and op != fcntl.LOCK_UN:
            waits.append(("flock", where[0]))
        return _real(fd, op)

    monkeypatch.setattr(filelock.BaseFileLock, "acquire", watched)
    monkeypatch.setattr(fcntl, "flock", flock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replay(REPO, out_dir=tmp_path / "a", revisions=["step0"], probes=PROBES, progress=False, fetch=FAST)
        write_manifest(REPO, out_dir=tmp_path / "b", revisions=["step0"], probes=PROBES)
        replay_revision(REPO, "step0", out_dir=tmp_path / "b", probes=PROBES, fetch=FAST)
        finalize(REPO, out_dir=tmp_path / "b", probes=PROBES, ablate=True, ablation_revision="step0")
    assert waits == []


def _stack() -> list[str]:
    f, out = sys._getframe(2), []
    while f is not None:
        out.append(f.f_code.co_filename)
        f = f.f_back
    return out
