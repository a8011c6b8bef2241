"""One attempt at a task: a download folder and a marker of its own, held while its process lives.

An attempt (an engine's task, or one task of a worker's loop) is named by its task and its own id (host.pid.random):
its folder is ``ROOT/SLUG@ID/`` (ROOT: the store's ``cache/``, or ``--cache-root``), its marker
``DIR/running/SLUG@ID.json`` (task, host, pid, start time, the Slurm job). Any number of attempts at one task (a requeue
while the first lives, a resubmission, Ray's retry, a worker's pass) run side by side: none deletes another's files,
and the record's exclusive create (``store``) decides which finished result is kept.

The marker is held under an exclusive ``flock`` while its process lives. No lease: nothing waits on it (``LOCK_NB``)
and nothing is taken from its owner. The kernel releases it however the process dies (SIGKILL: the OOM killer, KillWait
after a hang in C, Ray's force-cancel), an NFS server once the dead client's lease expires; so a marker whose lock can
be taken is a dead attempt's. The next attempt at its task removes it and its folder; ``finalize`` turns it into a
failed row when the task has no record, and sweeps every folder no live attempt holds. Without ``flock``, a marker of
this host lives while its pid does, one of another host is taken as alive. With ``--keep-cache`` the folder is the
task's own (``ROOT/SLUG/``), shared by its attempts, never emptied (huggingface_hub's file locks keep concurrent
downloads whole). Why here: no engine knows the store's folders or sees a retry beside a requeue; the kernel's lock is
the one liveness every engine (and none) shares.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

RUNNING_DIR = "running"
CACHE_DIR = "cache"
_SAFE = re.compile(r"[^A-Za-z0-9_.=+-]")  # never "@": it separates a task's slug from an attempt's id
_SLURM = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT")


def slug(task: str) -> str:
    """A file name for a task name (branch names may hold ``/``), unique by a short hash of the name."""
    return f"{_SAFE.sub('_', task)[:80]}-{hashlib.sha1(task.encode()).hexdigest()[:8]}"


def cache_root(out_dir, root: str | os.PathLike | None = None) -> Path:
    return Path(root) if root is not None else Path(out_dir) / CACHE_DIR


@dataclass
class Marker:
    """An attempt's marker as another process reads it."""

    path: Path
    info: dict

    @property
    def task(self) -> str:
        return self.info.get("task", self.path.stem)

    def alive(self) -> bool:
        """Whether the attempt's process still holds its marker (see the module doc)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # it ended meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return not self.info.get("locked", True) and self._pid_alive()  # taken: nobody held it
        except BlockingIOError:
            return True
        except OSError:  # no flock here: the pid, when it is this host's
            return self._pid_alive()
        finally:
            os.close(fd)

    def _pid_alive(self) -> bool:
        if self.info.get("host") != socket.gethostname():
            return True  # another host's process cannot be looked at: taken as alive
        try:
            os.kill(int(self.info.get("pid", -1)), 0)
            return True
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError):
            return True

    def remove(self, root=None, *, folder: bool = True) -> None:
        """A dead attempt's folder, then its marker (a folder never outlives its marker: see ``begin``)."""
        if folder:
            shutil.rmtree(cache_root(self.path.parent.parent, root) / self.path.stem, ignore_errors=True)
        self.path.unlink(missing_ok=True)


class Attempt:
    """This process's attempt at ``task``: ``folder`` to download into; ``end()`` once it is over."""

    def __init__(self, out_dir, task: str, *, root=None, keep: bool = False):
        self.task, self.keep, self.root = task, keep, root
        self.id = _SAFE.sub("_", f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:6]}")
        name = f"{slug(task)}@{self.id}"
        self.marker = Path(out_dir) / RUNNING_DIR / f"{name}.json"
        self.folder = cache_root(out_dir, root) / (slug(task) if keep else name)
        self.started_at = time.time()
        self._fd: int | None = None

    def begin(self) -> Attempt:
        for m in markers(self.marker.parent.parent):  # dead attempts at this task: their folders go
            if m.task == self.task and not m.alive():
                m.remove(self.root, folder=not self.keep)
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        info = {"task": self.task, "attempt": self.id, "host": socket.gethostname(), "pid": os.getpid(),
                "started_at": self.started_at, **{k.lower(): os.environ[k] for k in _SLURM if os.environ.get(k)}}  # fmt: skip
        tmp = self.marker.with_name(f".{self.marker.name}.tmp")
        self._fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked before it has its name: never seen unheld
        except OSError:
            info["locked"] = False
        os.write(self._fd, json.dumps(info).encode())
        os.replace(tmp, self.marker)  # the inode, and its lock, keep their owner
        self.folder.mkdir(parents=True, exist_ok=True)  # after the marker: a folder is always held while it exists
        return self

    def end(self, keep: bool | None = None) -> None:
        """Its folder emptied (unless ``keep``), then its marker removed; again is a no-op."""
        if not (self.keep if keep is None else keep):
            shutil.rmtree(self.folder, ignore_errors=True)
        self.marker.unlink(missing_ok=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def begin(out_dir, task: str, *, root=None, keep: bool = False) -> Attempt:
    """Start an attempt at ``task``: dead attempts' folders removed, its own folder and held marker made."""
    return Attempt(out_dir, task, root=root, keep=keep).begin()


def markers(out_dir) -> list[Marker]:
    """Every attempt's marker in the store, live or dead."""
    out = []
    for p in sorted((Path(out_dir) / RUNNING_DIR).glob("*.json")):
        with contextlib.suppress(OSError, json.JSONDecodeError):  # ended meanwhile
            out.append(Marker(p, json.loads(p.read_text())))
    return out


def running(out_dir) -> dict[str, dict]:
    """task -> a live attempt's marker, for every task some attempt is measuring now."""
    return {m.task: m.info for m in markers(out_dir) if m.alive()}


def is_running(out_dir, task: str) -> bool:
    return any(m.task == task and m.alive() for m in markers(out_dir))


def killed_error(info: dict) -> str:
    """What a failed row says of an attempt that ended without writing its outcome."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started_at", 0)))
    job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    return (
        f"Killed: the attempt started {when} on {info.get('host', '?')} (pid {info.get('pid', '?')}{job}) ended without writing "
        "its outcome — SIGKILL (the OOM killer, a hang past Slurm's KillWait, Ray's memory monitor or force-cancel) or a lost node"
    )


def sweep(out_dir, tasks, *, root=None) -> list[str]:
    """Remove the folders of ``tasks`` that no live attempt holds (``finalize``); returns their names."""
    base = cache_root(out_dir, root)
    held = {m.path.stem for m in markers(out_dir) if m.alive()}
    slugs = {slug(t) for t in tasks}
    swept = []
    for path in sorted(base.iterdir()) if base.is_dir() else ():
        if path.name.split("@")[0] in slugs and path.name not in held:
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path.name)
    if base.is_dir() and not any(base.iterdir()):
        base.rmdir()
    return swept
