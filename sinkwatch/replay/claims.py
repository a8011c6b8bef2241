"""Claims: which worker measures which revision, decided in the store's own directory (SPEC §8).

A worker claims a revision (or the ablation) by creating ``DIR/claims/ITEM.GEN.claim`` with
``O_CREAT | O_EXCL``: of all the workers that try, on any host sharing the filesystem, exactly one
succeeds. ITEM is the revision's done key (``store.done_key``), so a branch that moved is a new item.

The claim file is written whole before it is published (a temp file hard-linked to its name, which
fails when the name exists), so a claim always names its owner; the worker registers it before the
write, so a failed write (a full disk) leaves no orphan.

- **Heartbeat.** While it holds a claim, a worker touches the file every ``heartbeat_s`` seconds, for
  at most ``max_hold_s`` (a hung probe or download stops being heartbeat then, so its claim goes
  stale and is taken over). Age is measured by the store filesystem's own clock: the worker touches
  its clock file (``.clock.WORKER``) and reads the mtime back (an NFS server stamps both with its
  time), so hosts whose clocks disagree still agree on which claim is stale.
- **Liveness.** Each worker holds an ``flock`` on ``claims/alive/TOKEN.alive`` (``liveness``); a claim
  whose owner ran on this boot (this host) and whose lock is free is a dead worker's: taken over at
  once, and swept when a worker starts. Owners on other hosts are judged by the heartbeat's age only.
- **Takeover.** A claim silent for longer than ``stale_after_s`` (its worker was killed, its host
  lost), or a dead worker's, is taken over by creating generation GEN+1, again exclusively: one
  taker wins. A worker that comes back after losing its claim sees the newer generation, writes
  nothing and forgets the claim (it never takes it back unless that one goes stale too).
- **Failures.** A revision that failed keeps its claim as ``ITEM.GEN.failed``, stamped when it
  failed. Workers started before that (the same job) skip it; a later job retries it.
- **Success.** The record is the truth (``store.done_keys``); the claim files are removed.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import liveness
from .workers import Worker

CLAIMS_DIR = "claims"
_NAME = re.compile(r"^(?P<item>[A-Za-z0-9_-]+)\.(?P<gen>\d+)\.(?P<kind>claim|failed)$")


@dataclass(frozen=True, kw_only=True)
class ClaimConfig:
    """How workers share a store. ``stale_after_s`` must cover a worker's longest silence: a
    heartbeat delayed by a stalled filesystem, plus an NFS client's attribute cache (``actimeo``,
    60 s by default) — a claim older than that is taken over."""

    heartbeat_s: float = 30.0  # a held claim is touched this often
    stale_after_s: float = 600.0  # a claim silent this long is taken over
    poll_s: float = 15.0  # a worker whose remaining revisions are all held by others looks again at most this far apart
    # a claim is heartbeat for at most this long: a worker hung in a probe or a download lets it go
    # stale then. Set it to a few times the plan's time per revision (``--plan``)
    max_hold_s: float = 6 * 3600.0

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "stale_after_s", "poll_s", "max_hold_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"ClaimConfig.{name} must be a positive number of seconds, got {v!r}")
        if self.stale_after_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"ClaimConfig.stale_after_s ({self.stale_after_s}) must be at least twice heartbeat_s ({self.heartbeat_s}): "
                "a live worker's claim would be taken over between two heartbeats"
            )


@dataclass(frozen=True)
class ClaimState:
    """The newest generation of an item's claim."""

    gen: int
    path: Path
    failed: bool
    mtime: float
    owner: dict


class Claims:
    """This worker's view of the store's claims, with the heartbeat thread for the ones it holds."""

    def __init__(self, store_dir: str | os.PathLike, worker: Worker, config: ClaimConfig | None = None):
        self.config = config or ClaimConfig()
        self.worker = worker
        self.dir = Path(store_dir) / CLAIMS_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.alive_dir = self.dir / "alive"
        self.me = liveness.hold(self.alive_dir)  # released by close(); dropped by the kernel if this process dies
        self._clock = self.dir / f".clock.{worker.id}.{self.me['token']}"
        self._held: dict[str, Path] = {}
        self._since: dict[str, float] = {}  # item -> when this worker claimed it (monotonic): the max hold
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = self.now()  # failures stamped after this were this job's
        self.swept = self.sweep()

    # ---- dead workers -----------------------------------------------------------------------------
    def sweep(self) -> list[str]:
        """Remove the claims (and half-written temp files and clock files) of workers that died on
        this host; returns the revisions freed. Owners on other hosts are left to the heartbeat's age."""
        freed = []
        for p in self.dir.iterdir():
            if p.name.startswith((".tmp.", ".clock.")):
                token = p.name.rsplit(".", 1)[-1]
                if token != self.me["token"] and liveness.is_alive(self.alive_dir, _read_owner(self.alive_dir / f"{token}.alive")) is False:
                    p.unlink(missing_ok=True)
                continue
            m = _NAME.match(p.name)
            if not m or m.group("kind") != "claim":
                continue
            owner = _read_owner(p)
            if owner.get("token") != self.me["token"] and liveness.is_alive(self.alive_dir, owner) is False:
                p.unlink(missing_ok=True)
                freed.append(owner.get("revision", m.group("item")))
                warnings.warn(
                    f"sinkwatch replay: taking over {freed[-1]} from {owner.get('worker', 'an unknown worker')}, whose process is "
                    "gone (its alive lock is free)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        liveness.sweep(self.alive_dir)
        return freed

    def _mine(self, owner: dict) -> bool:
        return owner.get("token") == self.me["token"] and owner.get("worker") == self.worker.id

    def owner_dead(self, st: ClaimState) -> bool:
        """The claim's owner ran on this host and no longer holds its alive lock."""
        return st.owner.get("token") != self.me["token"] and liveness.is_alive(self.alive_dir, st.owner) is False

    # ---- the store's clock ----------------------------------------------------------------------
    def now(self) -> float:
        """The store filesystem's current time: touch this worker's clock file, read its mtime back."""
        try:
            os.utime(self._clock, None)
        except FileNotFoundError:
            self._clock.touch()
        return self._clock.stat().st_mtime

    # ---- reading ---------------------------------------------------------------------------------
    def state(self, item: str) -> ClaimState | None:
        """The newest generation of ``item``'s claim files, or None when nobody holds or failed it."""
        best: ClaimState | None = None
        for p in self.dir.glob(f"{item}.*"):
            m = _NAME.match(p.name)
            if not m or m.group("item") != item:
                continue
            gen, failed = int(m.group("gen")), m.group("kind") == "failed"
            if best is not None and (gen, failed) <= (best.gen, best.failed):
                continue
            try:
                mtime = p.stat().st_mtime
            except FileNotFoundError:  # released meanwhile
                continue
            best = ClaimState(gen, p, failed, mtime, _read_owner(p))
        return best

    def failed_this_job(self, item: str) -> bool:
        """``item`` failed after this worker started (in this job): not retried until the next one."""
        st = self.state(item)
        return st is not None and st.failed and st.mtime >= self.started

    # ---- claiming --------------------------------------------------------------------------------
    def try_claim(self, item: str, info: dict | None = None) -> bool:
        """Claim ``item`` for this worker: True when it is now ours. False when another worker holds
        it live, it failed in this job, or another worker won the race for it. A claim this worker
        held and lost (taken over while it was silent) is forgotten here, never taken back."""
        st = self.state(item)
        held = self._held.get(item)
        if held is not None:
            if st is not None and st.path == held and self._mine(_read_owner(held)):
                return True
            self._forget(item)  # lost: another worker holds it now
        if st is None:
            gen = 0
        elif st.failed:
            if st.mtime >= self.started:
                return False
            gen = st.gen + 1  # failed in an earlier job: retry
        elif self.owner_dead(st):
            gen = st.gen + 1
            warnings.warn(
                f"sinkwatch replay: taking over {st.owner.get('revision', item)} from {st.owner.get('worker', 'an unknown worker')}, "
                "whose process is gone (its alive lock is free)",
                RuntimeWarning,
                stacklevel=2,
            )
        elif self.now() - st.mtime > self.config.stale_after_s:
            gen = st.gen + 1
            who = st.owner.get("worker", "an unknown worker")
            warnings.warn(
                f"sinkwatch replay: taking over {st.owner.get('revision', item)} from {who}, silent for "
                f"{self.now() - st.mtime:.0f} s (> {self.config.stale_after_s:.0f} s)",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            return False
        path = self.dir / f"{item}.{gen}.claim"
        owner = {"worker": self.worker.id, **self.me, "gen": gen, **(info or {})}
        with self._lock:  # registered before anything is written: a failed write is cleaned up below
            self._held[item] = path
            self._since[item] = time.monotonic()
        tmp = self.dir / f".tmp.{item}.{gen}.{self.me['token']}"
        try:
            tmp.write_text(json.dumps(owner))
            try:
                os.link(tmp, path)  # exclusive, and the claim is whole the moment it exists
            except FileExistsError:
                self._forget(item)
                return False  # another worker created this generation first
            except OSError:  # a filesystem without hard links: exclusive create, then the content
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump(owner, f)
                except BaseException:
                    path.unlink(missing_ok=True)
                    raise
        except FileExistsError:
            self._forget(item)
            return False
        except BaseException:
            self._forget(item)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        self._start_heartbeat()
        return True

    def _forget(self, item: str) -> None:
        with self._lock:
            self._held.pop(item, None)
            self._since.pop(item, None)

    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def lost(self, item: str) -> bool:
        """True when another worker took ``item`` over (a newer generation, or our file gone)."""
        path = self._held.get(item)
        if path is None:
            return True
        st = self.state(item)
        lost = st is None or st.path != path or not self._mine(_read_owner(path))
        if lost:
            self._forget(item)  # never taken back, never released by us: the taker owns it now
        return lost

    def release(self, item: str, *, failed: bool = False) -> None:
        """Done with ``item``. Success: its claim files go (the record now says it is done). Failure:
        the claim becomes ``ITEM.GEN.failed``, stamped now by the store's clock."""
        with self._lock:
            path = self._held.pop(item, None)
            self._since.pop(item, None)
        if path is None:
            return
        if failed:
            marker = path.with_suffix(".failed")
            try:
                os.replace(path, marker)
                os.utime(marker, None)
            except FileNotFoundError:  # taken over and cleaned meanwhile
                pass
            return
        for p in self.dir.glob(f"{item}.*"):
            m = _NAME.match(p.name)
            if m and m.group("item") == item and int(m.group("gen")) <= int(_NAME.match(path.name).group("gen")):
                p.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop heartbeating. Claims still held (an interrupted worker) go stale and are taken over."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._clock.unlink(missing_ok=True)
        liveness.release(self.alive_dir)

    # ---- heartbeat --------------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="sinkwatch-claims-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            now = time.monotonic()
            with self._lock:
                paths = [p for item, p in self._held.items() if now - self._since.get(item, now) <= self.config.max_hold_s]
            for p in paths:
                try:
                    os.utime(p, None)
                except FileNotFoundError:  # released or taken over meanwhile: ``lost`` says which
                    pass


def _read_owner(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):  # being written, or removed meanwhile
        return {}
