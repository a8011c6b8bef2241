"""One attempt at a task: its own download folder and a marker that says it started.

An attempt — an engine's task, or one task of a worker's loop — begins by emptying the task's own
cache folder (``ROOT/TASK/``, ROOT being the store's ``cache/`` unless ``--cache-root`` says otherwise,
so a retry on another node finds what a killed attempt left) and writing ``DIR/running/TASK.json``
(host, pid, start time, the Slurm job when there is one). It ends — success, failure, SIGTERM or an
interruption — by emptying the folder again (unless ``--keep-cache``) and removing the marker.

A marker is no lease: nothing waits on it and nothing is taken from its owner. It says that an
attempt began and did not end, which is what ``--rewrite-manifest`` refuses on, what a worker's pass
over missing tasks skips, and what ``finalize`` turns into a failed row when the task has no record:
an attempt killed without a word (SIGKILL: the OOM killer, a hang in C past Slurm's KillWait, Ray's
memory monitor or force-cancel, a lost node).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

RUNNING_DIR = "running"
CACHE_DIR = "cache"
_SAFE = re.compile(r"[^A-Za-z0-9_.=+-]")
_SLURM = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")


def slug(task: str) -> str:
    """A file name for a task name (branch names may hold ``/``), unique by a short hash of the name."""
    return f"{_SAFE.sub('_', task)[:80]}-{hashlib.sha1(task.encode()).hexdigest()[:8]}"


def cache_root(out_dir, root: str | os.PathLike | None = None) -> Path:
    return Path(root) if root is not None else Path(out_dir) / CACHE_DIR


def folder(out_dir, task: str, root: str | os.PathLike | None = None) -> Path:
    """The task's own download folder (a Hugging Face cache of its own)."""
    return cache_root(out_dir, root) / slug(task)


def _marker(out_dir, task: str) -> Path:
    return Path(out_dir) / RUNNING_DIR / f"{slug(task)}.json"


def begin(out_dir, task: str, *, root=None, keep: bool = False) -> Path:
    """Start an attempt at ``task``: its folder emptied (unless ``keep``: what an earlier attempt kept is reused)
    and its marker written. Returns the folder."""
    path = folder(out_dir, task, root)
    if not keep:
        shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    marker = _marker(out_dir, task)
    marker.parent.mkdir(parents=True, exist_ok=True)
    info = {"task": task, "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time(),
            **{k.lower(): os.environ[k] for k in _SLURM if os.environ.get(k)}}  # fmt: skip
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, marker)
    return path


def end(out_dir, task: str, *, root=None, keep: bool = False) -> None:
    """End an attempt: its folder emptied (unless ``keep``) and its marker removed."""
    if not keep:
        shutil.rmtree(folder(out_dir, task, root), ignore_errors=True)
    _marker(out_dir, task).unlink(missing_ok=True)


def running(out_dir) -> dict[str, dict]:
    """task -> its marker, for every attempt that began and did not end."""
    out = {}
    for p in sorted((Path(out_dir) / RUNNING_DIR).glob("*.json")):
        try:
            info = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):  # being replaced right now
            continue
        out[info.get("task", p.stem)] = info
    return out


def is_running(out_dir, task: str) -> bool:
    return _marker(out_dir, task).exists()


def killed_error(info: dict) -> str:
    """What a failed row says of an attempt that ended without writing its outcome."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started_at", 0)))
    job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    return (
        f"Killed: the attempt started {when} on {info.get('host', '?')} (pid {info.get('pid', '?')}{job}) ended without writing "
        "its outcome — SIGKILL (the OOM killer, a hang past Slurm's KillWait, Ray's memory monitor or force-cancel) or a lost node"
    )


def sweep(out_dir, tasks, *, root=None) -> list[str]:
    """Empty what attempts left in the task folders of ``tasks`` (``finalize``); returns the tasks swept."""
    swept = []
    for t in tasks:
        path = folder(out_dir, t, root)
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
            swept.append(t)
    base = cache_root(out_dir, root)
    if base.is_dir() and not any(base.iterdir()):
        base.rmdir()
    return swept
