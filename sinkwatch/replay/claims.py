"""Claims: which worker measures which revision, decided in the store's own directory (SPEC §8).

A worker claims a revision (or the ablation) by creating ``DIR/claims/ITEM.GEN.claim`` with
``O_CREAT | O_EXCL``: of all the workers that try, on any host sharing the filesystem, exactly one
succeeds. ITEM is the revision's done key (``store.done_key``), so a branch that moved is a new item.

- **Heartbeat.** While it holds a claim, a worker touches the file every ``heartbeat_s`` seconds.
  Age is measured by the store filesystem's own clock: the worker touches its clock file
  (``.clock.WORKER``) and reads the mtime back (an NFS server stamps both with its time), so hosts
  whose clocks disagree still agree on which claim is stale.
- **Takeover.** A claim silent for longer than ``stale_after_s`` (its worker was killed, its host
  lost) is taken over by creating generation GEN+1, again exclusively: one taker wins. A worker
  that comes back after losing its claim sees the newer generation and writes nothing.
- **Failures.** A revision that failed keeps its claim as ``ITEM.GEN.failed``, stamped when it
  failed. Workers started before that (the same job) skip it; a later job retries it.
- **Success.** The record is the truth (``store.done_keys``); the claim files are removed.
"""

from __future__ import annotations

import json
import os
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

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

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "stale_after_s", "poll_s"):
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
        self._clock = self.dir / f".clock.{worker.id}"
        self._held: dict[str, Path] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = self.now()  # failures stamped after this were this job's

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
        it live, it failed in this job, or another worker won the race for it."""
        st = self.state(item)
        if st is None:
            gen = 0
        elif st.failed:
            if st.mtime >= self.started:
                return False
            gen = st.gen + 1  # failed in an earlier job: retry
        elif item in self._held:
            return True
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
        owner = {"worker": self.worker.id, "host": self.worker.host, "pid": self.worker.pid, "gen": gen, **(info or {})}
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False  # another worker created this generation first
        with os.fdopen(fd, "w") as f:
            json.dump(owner, f)
        with self._lock:
            self._held[item] = path
        self._start_heartbeat()
        return True

    def lost(self, item: str) -> bool:
        """True when another worker took ``item`` over (a newer generation, or our file gone)."""
        path = self._held.get(item)
        if path is None:
            return True
        st = self.state(item)
        return st is None or st.path != path or _read_owner(path).get("worker") != self.worker.id

    def release(self, item: str, *, failed: bool = False) -> None:
        """Done with ``item``. Success: its claim files go (the record now says it is done). Failure:
        the claim becomes ``ITEM.GEN.failed``, stamped now by the store's clock."""
        with self._lock:
            path = self._held.pop(item, None)
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

    # ---- heartbeat --------------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="sinkwatch-claims-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            with self._lock:
                paths = list(self._held.values())
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
