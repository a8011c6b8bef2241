"""Fetching revisions from the hub: by commit, one ahead, retried, and evicted once measured (SPEC §8).

- **By commit.** A revision is downloaded with ``snapshot_download(revision=COMMIT)``, the commit its
  branch resolved to when listed, so a branch that moves mid-run cannot mix two sets of weights. Only
  one weights format is fetched (safetensors when the revision has it, else ``.bin``): what the plan
  sizes is what is downloaded.
- **One ahead.** ``prefetch`` downloads the next revision on one background thread while the current
  one is probed; the loop waits only for the first.
- **Retried.** 5xx answers, 429 and dropped or refused connections are retried with exponential
  backoff and jitter (tenacity); after ``retries`` the revision fails (``FetchError``) and the job goes on.
- **Evicted.** Once its record is written, a revision that this replay downloaded leaves the cache
  (``scan_cache_dir().delete_revisions(...)``), unless ``keep_cache``. A revision that was in the
  cache before is never deleted. Workers sharing one cache on a host keep a small registry beside
  huggingface_hub's own locks (``CACHE/.locks/sinkwatch/``): the commits sinkwatch downloaded, and
  the commits and blobs each live worker still needs; a revision another worker needs is left to the
  last one that uses it, and a blob shared with a revision being downloaded is kept. A worker is
  alive while it holds the ``flock`` on its own ``alive/TOKEN.alive`` (``liveness``: valid across PID
  namespaces, never hostname + pid); the needs of dead workers are swept at every start and every
  eviction, and the revisions only they needed are evicted then (a killed worker leaks nothing).
  An eviction reads only the model's own ``models--ORG--NAME`` folder, never the whole cache.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..loading import hub_offline
from . import liveness
from .hub import RemoteFile, remote_files
from .retries import FetchError, RetryPolicy, _short, call_with_retries, is_transient  # noqa: F401 - re-exported
from .revisions import Revision


@dataclass(frozen=True, kw_only=True)
class FetchConfig(RetryPolicy):
    """How revisions are fetched: the hub calls' retries (``RetryPolicy``), prefetch and eviction."""

    prefetch: bool = True  # download the next revision while the current one is probed
    keep_cache: bool = False  # keep what this replay downloads (default: evict each revision once its record is written)


# ---- which files ---------------------------------------------------------------------------------------------
def files_to_fetch(files: list[RemoteFile]) -> list[RemoteFile]:
    """The files a replay downloads: every non-weights file (config, tokenizer) and one weights
    format — safetensors when the revision has it (Pythia's branches hold both), else ``.bin``, else all."""
    weights = [f for f in files if f.is_weights]
    for suffix in (".safetensors", ".bin"):
        chosen = [f for f in weights if f.path.endswith(suffix)]
        if chosen:
            weights = chosen
            break
    return [f for f in files if not f.is_weights] + weights


def blob_name(f: RemoteFile) -> str | None:
    """The file's name in the cache's blobs/ folder: its ETag — the LFS sha256, else the git blob id."""
    return f.sha256 or f.blob_id


# ---- the host's registry beside the cache ----------------------------------------------------------------------
class CacheGuard:
    """What sinkwatch workers on one host record in a shared Hugging Face cache, under one file lock.

    ``downloaded/COMMIT``: a sinkwatch replay downloaded that revision (of the model the file names)
    and evicts it once measured. ``needs/COMMIT.WORKER.TOKEN.json``: a live worker still needs that revision
    (and its blobs); ``alive/TOKEN.alive``: that worker's liveness lock."""

    def __init__(self, cache_dir: str | os.PathLike | None, worker_id: str, *, sweep: bool = True):
        from filelock import FileLock
        from huggingface_hub.constants import HF_HUB_CACHE

        self.cache = Path(cache_dir or HF_HUB_CACHE)
        self.root = self.cache / ".locks" / "sinkwatch"  # huggingface_hub's scan skips .locks
        (self.root / "needs").mkdir(parents=True, exist_ok=True)
        (self.root / "downloaded").mkdir(parents=True, exist_ok=True)
        self.alive_dir = self.root / "alive"
        self.me = liveness.hold(self.alive_dir)  # released by close(); dropped by the kernel if this process dies
        self.worker_id = worker_id
        self.lock = FileLock(str(self.root / "lock"))
        if sweep:
            with self.lock:
                self._live_needs()  # a start sweeps what dead workers left

    def repo_dir(self, model: str) -> Path:
        return self.cache / ("models--" + model.replace("/", "--"))

    def acquire(self, model: str, commit: str, blobs: set[str], *, will_evict: bool) -> bool:
        """Say this worker needs ``commit``; True when it was in the cache before sinkwatch fetched it
        (then it is never evicted)."""
        with self.lock:
            need = {**self.me, "worker": self.worker_id, "model": model, "blobs": sorted(blobs)}
            self._need_path(commit).write_text(json.dumps(need))
            snapshot = self.repo_dir(model) / "snapshots" / commit
            marker = self.root / "downloaded" / commit
            if not snapshot.exists() and will_evict:
                marker.write_text(json.dumps({"model": model}))
            return snapshot.exists() and not marker.exists()

    def release(self, model: str, commit: str, *, evict: bool, protect: set[str] = frozenset()) -> int:
        """This worker no longer needs ``commit``. With ``evict``, a revision sinkwatch downloaded and
        no other live worker needs leaves the cache; returns the bytes freed."""
        with self.lock:
            try:
                own = set(json.loads(self._need_path(commit).read_text()).get("blobs", []))
            except (OSError, json.JSONDecodeError):
                own = set()
            self._need_path(commit).unlink(missing_ok=True)
            marker = self.root / "downloaded" / commit
            if not evict or not marker.exists():
                return 0
            needs = self._live_needs()
            if any(c == commit for c, _ in needs):
                return 0  # another worker on this host uses it now: the last one evicts it
            keep = {b for _, blobs in needs for b in blobs} | set(protect)
            freed = self._delete(model, commit, keep, extra=own)  # own: blobs still downloading (no snapshot link yet)
            marker.unlink(missing_ok=True)
            return freed

    def close(self) -> None:
        liveness.release(self.alive_dir)

    def _need_path(self, commit: str) -> Path:
        return self.root / "needs" / f"{commit}.{self.worker_id}.{self.me['token']}.json"

    def _live_needs(self) -> list[tuple[str, set[str]]]:
        """(commit, blobs) of every live worker's needs (under the lock). A dead worker's (its alive lock
        free, on this boot) are dropped, and what it downloaded that no live worker needs is evicted.
        A need from another host (a cache on a shared filesystem) is kept: its lock cannot be trusted."""
        out, dead = [], []
        for p in (self.root / "needs").glob("*.json"):
            try:
                need = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            commit = p.name.split(".", 1)[0]
            if liveness.is_alive(self.alive_dir, need) is False:
                p.unlink(missing_ok=True)
                dead.append((commit, need))
                continue
            out.append((commit, set(need.get("blobs", []))))
        if dead:
            live_commits = {c for c, _ in out}
            keep = {b for _, blobs in out for b in blobs}
            for commit, need in dead:
                marker = self.root / "downloaded" / commit
                if commit in live_commits or not marker.exists() or not need.get("model"):
                    continue
                self._delete(need["model"], commit, keep, extra=set(need.get("blobs", [])))
                marker.unlink(missing_ok=True)
            liveness.sweep(self.alive_dir)
        return out

    def _delete(self, model: str, commit: str, keep: set[str], extra: set[str] = frozenset()) -> int:
        """Delete one revision from the model's own folder: its snapshot, the refs naming it, and the blobs
        it links (or, ``extra``, was downloading) that no other snapshot of the model links and no live
        need lists. Never the repo folder itself (a revision downloading there has no snapshot yet)."""
        repo = self.repo_dir(model)
        snapshots = repo / "snapshots"
        snapshot = snapshots / commit
        mine = set(extra) | _linked_blobs(snapshot)
        others: set[str] = set()
        if snapshots.is_dir():
            for other in snapshots.iterdir():
                if other.name != commit:
                    others |= _linked_blobs(other)
        freed = 0
        for name in sorted(mine - others - set(keep)):
            partial = list((repo / "blobs").glob(f"{name}*.incomplete")) if (repo / "blobs").is_dir() else []
            for blob in (repo / "blobs" / name, *partial):  # a download in flight: ETAG[.RANDOM].incomplete
                try:
                    freed += blob.stat().st_size
                    blob.unlink()
                except FileNotFoundError:
                    pass
        shutil.rmtree(snapshot, ignore_errors=True)
        refs = repo / "refs"
        if refs.is_dir():
            for ref in [r for r in refs.rglob("*") if r.is_file()]:
                try:
                    if ref.read_text().strip() == commit:
                        ref.unlink()
                except OSError:
                    pass
        (repo / "trees" / f"{commit}.json").unlink(missing_ok=True)  # snapshot_download's listing of that commit
        return freed


def _linked_blobs(snapshot: Path) -> set[str]:
    """The blob names a snapshot's links point at."""
    if not snapshot.is_dir():
        return set()
    return {os.path.basename(os.readlink(p)) for p in snapshot.rglob("*") if p.is_symlink()}


# ---- the fetcher -------------------------------------------------------------------------------------------------
class Fetcher:
    """Downloads revisions of one model by commit (one at a time in the background), retried, and
    evicts them once the loop is done with them."""

    def __init__(
        self, model: str, *, cache_dir=None, config: FetchConfig | None = None, worker_id: str = "worker", progress: bool = False,
        protect: set[str] = frozenset(),
    ):  # fmt: skip
        self.model = model
        self.protect = set(protect)  # blobs an eviction never deletes (those other manifest entries list)
        self.cache_dir = cache_dir
        self.config = config or FetchConfig()
        self.progress = progress
        self.guard = CacheGuard(cache_dir, worker_id)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sinkwatch-prefetch")
        self._pending: dict[str, Future] = {}
        self._held: dict[str, str] = {}  # revision name -> commit this fetcher registered a need for

    def fetch(self, rev: Revision) -> Path:
        """The local folder holding ``rev``'s files (downloaded now, or already prefetched)."""
        fut = self._pending.pop(rev.name, None)
        return fut.result() if fut is not None else self._fetch(rev)

    def prefetch(self, rev: Revision) -> None:
        """Start downloading ``rev`` on the background thread (one at a time)."""
        if rev.path is None and rev.name not in self._pending:
            self._pending[rev.name] = self._pool.submit(self._fetch, rev)

    def release(self, rev: Revision) -> int:
        """The loop is done with ``rev``: evict it unless kept (see the module doc). Bytes freed."""
        commit = self._held.pop(rev.name, None)
        if commit is None:
            return 0
        return self.guard.release(self.model, commit, evict=not self.config.keep_cache, protect=self.protect)

    def close(self, *, wait: bool = True) -> None:
        """Release (evict) whatever this fetcher still holds, after the download in flight (``wait``) —
        an interrupted replay does not wait for it."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
        self._pending.clear()
        for name in list(self._held):
            self.release(Revision(name))
        self.guard.close()

    # ---- one download ----
    def _fetch(self, rev: Revision) -> Path:
        if rev.path is not None:
            return Path(rev.path)
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

        target = rev.commit or rev.name
        where = f"{self.model}@{rev.name}"
        try:
            if hub_offline():
                return Path(snapshot_download(self.model, revision=target, cache_dir=self.cache_dir, local_files_only=True))
            files = call_with_retries(lambda: remote_files(self.model, target), self.config, f"list {where}")
            chosen = files_to_fetch(files)
            commit = rev.commit
            if commit is None:
                raise FileNotFoundError(f"{self.model} has no branch or tag {rev.name!r} (and it is not a full commit id)")
            self.guard.acquire(self.model, commit, {b for f in chosen if (b := blob_name(f))}, will_evict=not self.config.keep_cache)
            self._held[rev.name] = commit
            path = call_with_retries(
                lambda: snapshot_download(
                    self.model,
                    revision=commit,
                    cache_dir=self.cache_dir,
                    allow_patterns=[f.path for f in chosen],
                    tqdm_class=None if self.progress else _SilentTqdm,
                ),
                self.config,
                f"download {where}",
            )
            return Path(path)
        except (RevisionNotFoundError, EntryNotFoundError, RepositoryNotFoundError) as exc:
            raise FileNotFoundError(f"{self.model} has no revision {rev.name!r}: {_short(exc)}") from exc
        except LocalEntryNotFoundError as exc:
            if hub_offline():
                raise FileNotFoundError(
                    f"{self.model} at revision {rev.name!r} is not in the local Hugging Face cache "
                    f"(HF_HUB_OFFLINE=1{', cache ' + str(self.cache_dir) if self.cache_dir else ''})"
                ) from exc
            raise


class _SilentTqdm(tqdm):
    """huggingface_hub's progress bars, off (``progress=False``: tests, batch jobs)."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
