"""Whether another replay process is alive, proven by something only a live process holds (SPEC §8).

Each process holds an exclusive ``flock`` on its own file (``<token>.alive``) from its first claim or
cache registration until it exits; the kernel drops the lock when the process dies, however it dies
(SIGKILL included). Another process probes that lock with ``LOCK_NB``: held means alive, free means
dead. This works across PID namespaces (two containers sharing a volume, or ``unshare --pid``), where
a hostname and a pid say nothing: the lock is on the file, not on a pid.

A lock can be trusted only where the locking kernel is the one probing it: a process that wrote its
file under another boot id (another host, or this host before a reboot) is ``None`` (cannot tell), and
callers fall back to the heartbeat's age. So a filesystem that ignores locks across hosts (NFS mounted
``nolock``, FUSE) never makes a live worker on another host look dead.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import uuid
from pathlib import Path


def boot_id() -> str:
    """This kernel's boot id (a new one at every boot; one per host)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-" + socket.gethostname()


_TOKEN = {"pid": os.getpid(), "token": uuid.uuid4().hex[:12]}
_HELD: dict[Path, list[int]] = {}  # alive file -> [the fd holding its lock, holders in this process]
_LOCK = threading.Lock()


def process_token() -> str:
    """A name unique to this process, whatever its PID namespace (a fork gets its own)."""
    if _TOKEN["pid"] != os.getpid():
        _TOKEN.update(pid=os.getpid(), token=uuid.uuid4().hex[:12])
        _HELD.clear()  # the parent's locks are the parent's
    return _TOKEN["token"]


def hold(directory: str | os.PathLike) -> dict:
    """Hold this process's alive lock in ``directory`` (idempotent); returns what an owner record
    carries so others can probe it: ``{"token", "boot_id", "pid", "host"}``."""
    token = process_token()
    d = Path(directory)
    path = d / f"{token}.alive"
    info = {"token": token, "boot_id": boot_id(), "pid": os.getpid(), "host": socket.gethostname()}
    with _LOCK:
        if path in _HELD:
            _HELD[path][1] += 1
            return info
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file nobody else knows: never blocks
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        _HELD[path] = [fd, 1]
    return info


def release(directory: str | os.PathLike) -> None:
    """Drop this process's alive lock in ``directory`` (a clean exit)."""
    path = Path(directory) / f"{process_token()}.alive"
    with _LOCK:
        held = _HELD.get(path)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _HELD[path]
    path.unlink(missing_ok=True)
    os.close(held[0])


def is_alive(directory: str | os.PathLike, owner: dict) -> bool | None:
    """True: the owner process holds its lock; False: it is dead (its lock is free, or it never
    took one on this boot); None: cannot tell (another boot id: another host, or an owner record
    without a token)."""
    token, bid = owner.get("token"), owner.get("boot_id")
    if not token or bid != boot_id():
        return None
    path = Path(directory) / f"{token}.alive"
    with _LOCK:
        if path in _HELD:
            return True
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False  # released (a clean exit) or swept: not alive
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock, if it got one
    return False


def sweep(directory: str | os.PathLike) -> list[str]:
    """Remove the alive files of dead processes of this boot; returns their tokens."""
    dead = []
    for p in Path(directory).glob("*.alive"):
        try:
            owner = json.loads(p.read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            continue
        if is_alive(directory, owner) is False:
            p.unlink(missing_ok=True)
            dead.append(owner.get("token"))
    return dead
