"""Faults planted in replay units that run in other processes (a Slurm job, a submitit job, a Ray worker), for
the engine and resume tests: a probe that hangs, or that waits to be killed with SIGKILL.

``env(folder)`` gives a process a ``sitecustomize`` that, when ``SINKWATCH_TEST_FAULTS`` names a folder, wraps
``Monitor.probe`` once ``sinkwatch.probe.monitor`` is imported. A probe of revision R finds ``R.hang`` or ``R.kill``
there (``plant``), takes it (a rename: each fault fires once, so the next attempt runs clean), writes
``R.ready`` (its pid) and then sleeps in Python — a hang that SIGTERM, submitit's USR2 and Ray's
KeyboardInterrupt interrupt, as a hung download or a stuck loop would be; ``kill`` waits there for the test's
SIGKILL (the OOM killer); ``native`` is stuck in C (``pause()`` with every signal blocked in the main thread,
as a CUDA hang is): Python's handlers never run, so SIGTERM, USR2 and Ray's cancel are ignored until
SIGKILL (Slurm's KillWait, Ray's force-cancel); ``R.slow`` only makes the probe that many seconds slower. ``ready(folder, R)`` waits
for that file and returns the pid.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SITECUSTOMIZE = """
import ctypes
import importlib.abc
import importlib.util
import os
import signal
import sys
import time

FAULTS = os.environ.get("SINKWATCH_TEST_FAULTS")


def _wrap(module):
    probe = module.Monitor.probe

    def faulty(self, *args, **kwargs):
        rev = kwargs.get("revision")
        for kind in ("hang", "kill", "native", "slow"):
            planted = os.path.join(FAULTS, f"{rev}.{kind}")
            try:
                os.rename(planted, planted + f".taken.{os.getpid()}")  # once: the next attempt runs clean
            except OSError:
                continue
            if kind == "slow":
                with open(planted + f".taken.{os.getpid()}") as f:
                    time.sleep(float(f.read()))
                break
            ready = os.path.join(FAULTS, f"{rev}.ready")
            with open(ready + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(ready + ".tmp", ready)
            if kind == "native":  # no Python runs in this thread again: only SIGKILL ends it
                signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
                ctypes.CDLL(None).pause()
            while True:  # in Python: a signal's handler (SIGTERM, USR2) or Ray's KeyboardInterrupt gets in
                time.sleep(0.1)
        return probe(self, *args, **kwargs)

    module.Monitor.probe = faulty


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "sinkwatch.probe.monitor":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _wrap(module)

        spec.loader.exec_module = exec_module
        return spec


if FAULTS:
    sys.meta_path.insert(0, _Finder())
"""


def env(folder: Path, base: dict | None = None) -> dict:
    """Variables that plant the fault hook in every Python process started with them."""
    folder = Path(folder)
    (folder / "site").mkdir(parents=True, exist_ok=True)
    (folder / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    base = dict(os.environ if base is None else base)
    path = [str(folder / "site"), *[p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {**base, "SINKWATCH_TEST_FAULTS": str(folder), "PYTHONPATH": os.pathsep.join(path)}


def plant(folder: Path, revision: str, kind: str, seconds: float = 0.0) -> None:
    """The next probe of ``revision`` (in any process with ``env(folder)``) hangs (``hang``), waits for SIGKILL
    (``kill``), is stuck in C until SIGKILL (``native``), or takes ``seconds`` more (``slow``)."""
    assert kind in ("hang", "kill", "native", "slow"), kind
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{revision}.{kind}").write_text(str(seconds))


def ready(folder: Path, revision: str, timeout: float, alive=lambda: True) -> int:
    """The pid of the process whose probe of ``revision`` is stuck in its fault (waits up to ``timeout`` s, while ``alive()``)."""
    path = Path(folder) / f"{revision}.ready"
    deadline = time.time() + timeout
    while not path.exists() and time.time() < deadline and alive():
        time.sleep(0.2)
    assert path.exists(), f"no probe of {revision} reached its fault within {timeout:.0f} s"
    return int(path.read_text())
