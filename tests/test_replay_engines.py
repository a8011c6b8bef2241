"""Replay on the engines clusters already run: a real one-node Slurm 22.05 (slurmctld, slurmd, munged, started once
per session in a private directory, stopped by PID), submitit's SlurmExecutor on it, and a local Ray cluster —
each running the docs' lines as written against the stand-in hub serving the real repository name,
EleutherAI/pythia-1b, with a short listing (four step branches of a tiny GPT-NeoX, and main = the last one).

In every engine's run one task is killed with SIGKILL mid-probe (as the OOM killer does) and one hangs in its
probe until its time limit (Slurm's --time, submitit's time, run_with_limit's limit_s); then the failed tasks
are resubmitted as the docs say, and the store ends with exactly one record per revision, no failed row, nothing
in any task folder and no attempt marker.

Substitutions, each named where it is made: the store path; the GPUs (this cluster has no GRES, Ray no GPU);
submitit's time=120 by time=10 (submitit's own rule then calls the USR2 a time-out, as it does at a real limit);
Ray's limit 2 * 3600 by seconds. The recipe is the packaged pythia-1b's with a small probe, through
SINKWATCH_RECIPES (which the docs' lines honour as a user's own recipes): the lines themselves are unchanged.
Under CI=true an engine that is missing fails these tests instead of skipping them (scripts/test.sh --system
installs them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import pytest
import replay_faults
import slurm_cluster
import yaml
from local_hub import tiny_revisions

from sinkwatch.replay import read_manifest, record_files
from sinkwatch.reporting.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "docs" / "replay.md").read_text()
REPO = "EleutherAI/pythia-1b"
NAMES = ["step1", "step16", "step1000", "step143000"]  # tasks 0-3; step1 is killed, step16 hangs
STORE = "/shared/runs/pythia-1b"


def missing(reason: str):
    """An engine this machine lacks: a skip here, a failure under CI (where scripts/test.sh installs every engine)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}: scripts/test.sh --system installs every engine, none may be skipped")
    pytest.skip(reason)


@pytest.fixture(scope="module")  # not session: it points this process's huggingface_hub at the stand-in hub while it lives
def engine_hub(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_revisions")
    with tiny_revisions(d, REPO, NAMES, "gpt_neox", vocab_size=10_000) as h:  # the recipe's probe draws ids in [100, 10000)
        h.add_revision(REPO, "main", d / NAMES[-1])  # as Pythia's main: the final step's weights
        yield h


@pytest.fixture()
def hub(engine_hub):
    engine_hub.log.clear()
    yield engine_hub
    engine_hub.clear_faults()


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> Path:
    """The packaged pythia-1b recipe with a probe of 8 x 64 sequences (its protocol, revisions and ablation kept)."""
    d = tmp_path_factory.mktemp("recipes")
    recipe = yaml.safe_load(resources.files("sinkwatch.recipes").joinpath("pythia-1b.yaml").read_text())
    recipe["probes"] = {"induction": {"n": 8, "seq_len": 64, "seed": 42}}
    recipe["batch_tokens"] = 512
    (d / "pythia-1b.yaml").write_text(yaml.safe_dump(recipe))
    return d


def env(hub, recipes: Path, faults: Path) -> dict:
    e = replay_faults.env(faults, hub.env())
    e["PYTHONPATH"] += os.pathsep + (os.environ.get("PYTHONPATH") or str(ROOT))
    e["SINKWATCH_RECIPES"] = str(recipes)
    return e


def rows(store) -> list[dict]:
    return [r for p in record_files(store) for r in read_jsonl(p)]


def docs_block(after: str, lang: str) -> str:
    """The first ```lang block after the line starting with ``after`` (docs/replay.md, cluster section)."""
    at = DOCS.index(after, DOCS.index("## A full trajectory on a cluster"))
    start = DOCS.index(f"```{lang}\n", at) + len(f"```{lang}\n")
    return DOCS[start : DOCS.index("```", start)]


def substitute(text: str, *pairs: tuple[str, str]) -> str:
    for old, new in pairs:
        assert old in text, old
        text = text.replace(old, new)
    return text


class Watch:
    """Kills the planted SIGKILL fault's process once its probe starts, calls ``on_hang(pid)`` once the hung one's
    does, and keeps every failed row that appears in the store (they are replaced once the resubmission succeeds)."""

    def __init__(self, store: Path, faults: Path, on_hang=None):
        self.store, self.faults, self.on_hang = store, faults, on_hang
        self.failed: dict[str, dict] = {}
        self.events: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        replay_faults.plant(self.faults, "step1", "kill")
        replay_faults.plant(self.faults, "step16", "hang")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        todo = {"step1": self._kill, "step16": self._hang}
        while not self._stop.is_set():
            for rev, act in list(todo.items()):
                ready = self.faults / f"{rev}.ready"
                if ready.exists():
                    act(int(ready.read_text()))
                    del todo[rev]
            for p in (self.store / "records").glob("*.failed.json") if (self.store / "records").is_dir() else ():
                try:
                    row = json.loads(p.read_text())
                except (OSError, json.JSONDecodeError):
                    continue
                self.failed.setdefault(row["revision"], row)
            time.sleep(0.2)

    def _kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)  # as the OOM killer would: no handler runs, nothing is written
        self.events.append(f"killed {pid}")

    def _hang(self, pid: int) -> None:
        self.events.append(f"hung {pid}")
        if self.on_hang is not None:
            self.on_hang(pid)


def assert_converged(store: Path, hub) -> None:
    """Exactly one record per revision and manifest commit, no failed row, no task folder, no attempt marker."""
    m = read_manifest(store)
    got = sorted((r["revision"], r["commit"], r["status"]) for r in rows(store))
    assert got == sorted((n, hub.commit_of(REPO, n), "ok") for n in NAMES), got
    assert [m.entries[n]["commit"] for n in NAMES] == [hub.commit_of(REPO, n) for n in NAMES]
    assert not list((store / "records").glob("*.failed.json"))
    assert not (store / "cache").exists() or not list((store / "cache").iterdir()), list((store / "cache").rglob("*"))[:5]
    assert not list((store / "running").glob("*.json"))
    ablation = json.loads((store / "ablation.json").read_text())
    assert ablation["status"] == "ok" and ablation["revision"] == "step143000" and ablation["screen"] == "record"


def assert_first_round(watch: Watch, hung_error: str) -> None:
    """The killed task got its failed row from finalize (it wrote none), the hung one from its own handler."""
    assert "Killed: the attempt started" in watch.failed["step1"]["error"], watch.failed
    assert hung_error in watch.failed["step16"]["error"], watch.failed
    assert set(watch.failed) == {"step1", "step16"}, watch.failed


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
    (d / "sinkwatch").write_text(f'#!/bin/sh\nexec {sys.executable} -m sinkwatch "$@"\n')
    (d / "sinkwatch").chmod(0o755)
    return d


def _slurm_job_of(pid: int) -> str:
    """The Slurm job (``ARRAYJOB_TASK``) a process runs in, from its environment."""
    e = dict(x.split("=", 1) for x in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in x)
    return f"{e['SLURM_ARRAY_JOB_ID']}_{e['SLURM_ARRAY_TASK_ID']}" if e.get("SLURM_ARRAY_JOB_ID") else e["SLURM_JOB_ID"]


def cut_limit(slurm, *, left_s: int | None = None):
    """Once a task hangs in its probe, its time limit is cut (it was submitted with the docs' 120 minutes): to one
    minute, or to ``left_s`` seconds from now. Slurm's limit, not the test, then ends it."""

    def cut(pid: int) -> None:
        job, limit = _slurm_job_of(pid), "1"
        if left_s is not None:
            ran = subprocess.run(["squeue", "-h", "-j", job, "-o", "%M"], env=slurm.env(), capture_output=True, text=True, timeout=30)
            parts = [int(x) for x in re.split("[-:]", ran.stdout.strip())]  # [[days-]hours:]minutes:seconds
            elapsed = sum(v * u for v, u in zip(reversed(parts), (1, 60, 3600, 86400)))
            limit = "{}:{:02d}".format(*divmod(elapsed + left_s, 60))  # minutes:seconds
        subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={limit}"], env=slurm.env(), check=True, timeout=30)

    return cut


def test_slurm_runs_the_docs_lines_and_converges_after_a_sigkill_and_a_time_limit(slurm, hub, recipes, bin_dir, tmp_path):
    """The docs' Slurm lines as written: the plan (its array range printed: 0-3), the array, finalize on afterany (a GPU
    job with a time limit); task 0 SIGKILLed mid-probe, task 1 hung until --time (cut to a minute) kills it; finalize
    records both and exits 1; then --failed-tasks (0-1), the resubmission and finalize again: converged."""
    first, second = docs_block("**Slurm**", "bash").split("# once finalize has run")
    store, faults = tmp_path / "store", tmp_path / "faults"
    e = {**slurm.env(env(hub, recipes, faults)), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    def bash(lines: str, echo: str) -> list[str]:
        script = substitute(lines, (STORE, str(store)), (" --gpus=1", "")) + f"\necho {echo}\n"  # no GRES here
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=e, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return res.stdout.split()

    with Watch(store, faults, on_hang=cut_limit(slurm)) as watch:
        out = bash(first, "$ARRAY $JOB")
        array, job, final = out[-2], out[-1], out[-3]  # sbatch (without --parsable) said: Submitted batch job FINAL
        assert array == "0-3" and read_manifest(store).task_names() == NAMES
        assert slurm.wait(job, 240) == {"0": "FAILED", "1": "TIMEOUT", "2": "COMPLETED", "3": "COMPLETED"}, (watch.events, _logs(tmp_path))
        assert slurm.wait(final, 180) == {final: "FAILED"}, _logs(tmp_path)  # afterany: it ran, and exited 1 for the failures
    said = (tmp_path / f"slurm-{final}.out").read_text()
    assert "2 done, 2 failed, 0 missing" in said and "failed: step1: Killed" in said and "failed: step16: Terminated" in said
    assert_first_round(watch, "Terminated: terminated by SIGTERM")
    out = bash(second, "$FAILED $JOB")
    failed, job, final = out[-2], out[-1], out[-3]
    assert failed == "0-1"
    assert slurm.wait(job, 180) == {"0": "COMPLETED", "1": "COMPLETED"}, _logs(tmp_path)
    assert slurm.wait(final, 180) == {final: "COMPLETED"}, _logs(tmp_path)
    assert "4 done, 0 failed, 0 missing" in (tmp_path / f"slurm-{final}.out").read_text()
    assert [p for m, p, s in hub.log if p.endswith("/refs")] == [f"/api/models/{REPO}/refs"]  # the driver listed once; the tasks never
    assert not [p for m, p, s in hub.log if any(f"/{b}/" in p for b in ("main", *NAMES))]  # everything by commit, never a branch
    assert_converged(store, hub)
    res = subprocess.run(["sinkwatch", "replay", "pythia-1b", "--out", str(store), "--failed-tasks"], env=e, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout == "\n"  # nothing left to resubmit


def _logs(d: Path) -> str:
    return "".join(p.read_text()[-1500:] for p in sorted(d.glob("slurm-*.out")))


# ---- submitit on that Slurm ---------------------------------------------------------------------------------------------
def test_submitit_runs_the_docs_block_and_converges_after_a_sigkill_and_a_time_limit(slurm, hub, recipes, tmp_path, monkeypatch):
    """The docs' submitit block as written: task 0 SIGKILLed mid-probe (no result file: only finalize, on afterany,
    sees it), task 1 hung until its limit — cut with scontrol to 150 s from then; at USR2 submitit raises UncompletedJobError
    in it, which the unit records as a failed row — then the loop's resubmission: converged."""
    try:
        import submitit  # noqa: F401
    except ImportError:
        missing("submitit is not installed (pip install submitit; it is in the dev extra)")
    store, faults = tmp_path / "store", tmp_path / "faults"
    for k, v in slurm.env(env(hub, recipes, faults)).items():
        if os.environ.get(k) != v:
            monkeypatch.setenv(k, v)
    for k in [k for k in os.environ if k.startswith(("SLURM_", "SBATCH_")) and k != "SLURM_CONF"]:
        monkeypatch.delenv(k)
    code = substitute(
        docs_block("**submitit**", "python"),
        ('"/shared/runs/pythia-1b"', repr(str(store))),
        (", gpus_per_node=1", ""),  # no GRES here
        ("time=120", "time=10"),  # submitit calls a USR2 a time-out only past min(80 % of the limit, the limit - 10 min)
        ("timeout=48 * 3600", "timeout=600"),  # the driver's wait for finalize
    )
    # submitit asks Slurm for USR2 90 s before the limit, and Slurm checks limits and signals about every 30 s: a
    # limit 150 s away lets USR2 arrive 60-90 s before it, time for the handler's row. A one-minute cut could send
    # USR2 and the limit's SIGTERM (which submitit ignores) in one check, then SIGKILL after KillWait: the Killed path.
    with Watch(store, faults, on_hang=cut_limit(slurm, left_s=150)) as watch:
        scope = {"__name__": "__main__"}
        exec(compile(code, "docs/replay.md", "exec"), scope)
    assert scope["attempt"] == 1 and scope["tasks"] == [] and scope["summary"]["done"] == NAMES, (scope["summary"], watch.events)
    assert_first_round(watch, "UncompletedJobError: Job not requeued because: timed-out and not checkpointable")
    assert_converged(store, hub)


# ---- Ray --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster(engine_hub, recipes, tmp_path_factory):
    try:
        import ray
    except ImportError:
        missing("ray is not installed (pip install ray; it is in the dev extra)")
    faults = tmp_path_factory.mktemp("ray_faults")
    e = env(engine_hub, recipes, faults)
    keys = ("HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_XET", "PYTHONPATH", "SINKWATCH_TEST_FAULTS")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 1024**2, log_to_driver=False,
             runtime_env={"env_vars": {k: e[k] for k in keys}})  # fmt: skip
    yield ray, faults
    ray.shutdown()


def test_ray_runs_the_docs_block_and_converges_after_a_sigkill_and_a_time_limit(ray_cluster, hub, recipes, tmp_path, monkeypatch):
    """The docs' Ray block as written: task 0's worker SIGKILLed mid-probe (Ray retries it: a crashed worker),
    task 1 hung past run_with_limit's limit (cancelled: KeyboardInterrupt, its failed row written; cancelled tasks
    are never retried by Ray), resubmitted by the loop: converged."""
    _, faults = ray_cluster
    store = tmp_path / "store"
    monkeypatch.setenv("SINKWATCH_RECIPES", str(recipes))
    code = substitute(
        docs_block("**Ray**", "python"),
        ('"/shared/runs/pythia-1b"', repr(str(store))),
        ("num_gpus=1", "num_gpus=0"),  # no GPU here
        ("limit_s=2 * 3600", "limit_s=90"),  # the hung task reaches it; the others end well before, under 2x load too
    )
    with Watch(store, faults) as watch:
        scope = {"__name__": "__main__"}
        exec(compile(code, "docs/replay.md", "exec"), scope)
    assert scope["attempt"] == 1 and scope["tasks"] == [] and scope["summary"]["done"] == NAMES, (scope["summary"], watch.events)
    # the SIGKILLed step1 never has a failed row: Ray ran the killed worker's task again and its next attempt recorded it
    assert set(watch.failed) == {"step16"}, watch.failed
    # the hung step16: cancelled (KeyboardInterrupt, the unit writes its row) or, when Ray's cancel has not ended it within
    # the grace minute (seen once in a full-suite run), force-cancelled (its worker killed, finalize writes the row); both
    # are docs/replay.md's documented paths and both converge
    assert watch.failed["step16"]["error"].startswith(("KeyboardInterrupt", "Killed")), watch.failed
    assert_converged(store, hub)


def test_the_unit_without_a_manifest_names_the_command_that_writes_it(tmp_path):
    from sinkwatch.replay import replay_revision

    with pytest.raises(ValueError, match=r"no manifest.json in .*sinkwatch replay org/engines --out .* --manifest-only"):
        replay_revision("org/engines", "step0", out_dir=tmp_path)
