"""Fetching revisions from the hub: by commit, into the task's own folder, one ahead, retried.

- **By commit.** ``snapshot_download(revision=COMMIT)`` at the commit the branch resolved to in the manifest, so a
  branch moving mid-run cannot mix two sets of weights. One weights format only (safetensors when the revision has
  it, else ``.bin``): what the plan sizes is what is downloaded.
- **Into the attempt's own folder** (``Attempt.folder``: a Hugging Face cache of its own, emptied once its records are
  written unless ``keep_cache``): nothing shared between attempts, so no lock or registry. A user's cache
  (``--cache-dir``; with ``HF_HUB_OFFLINE=1`` the only source) is read first, never written: what it holds is not
  downloaded.
- **One ahead.** ``prefetch`` downloads the next task's revision on a background thread while this one is probed; the
  loop waits only for the first.
- **Retried.** 5xx, 429 and dropped or refused connections, with exponential backoff and jitter (tenacity); after
  ``retries`` the revision fails (``FetchError``) and the job goes on.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..models.hub import RemoteFile, RetryPolicy, cache_repo_dir, call_with_retries, remote_files, short_error
from ..models.loading import hub_offline
from .revisions import Revision


@dataclass(frozen=True, kw_only=True)
class FetchConfig(RetryPolicy):
    """How revisions are fetched: the hub calls' retries (``RetryPolicy``), prefetch, and the task folders."""

    prefetch: bool = True  # download the next task's revision while the current one is probed
    keep_cache: bool = False  # keep each task's folder (default: emptied once its records are written)
    cache_root: str | None = None  # where the task folders go (default: the store's cache/, which a retry on any node finds)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cache_root is not None and not isinstance(self.cache_root, (str, os.PathLike)):
            raise TypeError(f"FetchConfig.cache_root must be a path, got {self.cache_root!r}")


# ---- which files ---------------------------------------------------------------------------------------------
def files_to_fetch(files: list[RemoteFile]) -> list[RemoteFile]:
    """Every non-weights file (config, tokenizer) and one weights format: safetensors when the revision has it (Pythia's
    branches hold both), else ``.bin``, else all."""
    weights = [f for f in files if f.is_weights]
    for suffix in (".safetensors", ".bin"):
        chosen = [f for f in weights if f.path.endswith(suffix)]
        if chosen:
            weights = chosen
            break
    return [f for f in files if not f.is_weights] + weights


# ---- the fetcher -------------------------------------------------------------------------------------------------
class Fetcher:
    """Downloads one model's revisions by commit (one at a time in the background) into their tasks' folders, after
    looking in the user's read-only cache."""

    def __init__(self, model: str, *, cache_dir=None, config: FetchConfig | None = None, progress: bool = False):
        self.model = model
        self.cache_dir = cache_dir  # the user's cache: read, never written
        self.config = config or FetchConfig()
        self.progress = progress
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sinkwatch-prefetch")
        self._pending: dict[str, Future] = {}

    def fetch(self, rev: Revision, folder: Path) -> Path:
        """The local folder holding ``rev``'s files (downloaded now into ``folder``, or already prefetched)."""
        fut = self._pending.pop(rev.name, None)
        return fut.result() if fut is not None else self._fetch(rev, folder)

    def prefetch(self, rev: Revision, folder: Path) -> None:
        """Start downloading ``rev`` into ``folder`` on the background thread (one at a time)."""
        if rev.path is None and rev.name not in self._pending:
            self._pending[rev.name] = self._pool.submit(self._fetch, rev, folder)

    def close(self, *, wait: bool = True) -> None:
        """Stop, after the download in flight (``wait``) — an interrupted replay does not wait for it."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
        self._pending.clear()

    # ---- one download ----
    def _fetch(self, rev: Revision, folder: Path) -> Path:
        if rev.path is not None:
            return Path(rev.path)
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

        where = f"{self.model}@{rev.name}"
        target = rev.commit or rev.name
        try:
            if hub_offline():
                return self._cached(target, None) or Path(
                    snapshot_download(self.model, revision=target, cache_dir=self.cache_dir, local_files_only=True)
                )
            if rev.commit is None:
                raise FileNotFoundError(f"{self.model} has no branch or tag {rev.name!r} (and it is not a full commit id)")
            chosen = files_to_fetch(call_with_retries(lambda: remote_files(self.model, rev.commit), self.config, f"list {where}"))
            found = self._cached(rev.commit, chosen) if self.cache_dir is not None else None
            if found is not None:
                return found
            path = call_with_retries(
                lambda: snapshot_download(self.model, revision=rev.commit, cache_dir=str(folder), allow_patterns=[f.path for f in chosen],
                                          tqdm_class=None if self.progress else _SilentTqdm),
                self.config, f"download {where}",
            )  # fmt: skip
            return Path(path)
        except (RevisionNotFoundError, EntryNotFoundError, RepositoryNotFoundError) as exc:
            raise FileNotFoundError(f"{self.model} has no revision {rev.name!r}: {short_error(exc)}") from exc
        except LocalEntryNotFoundError as exc:
            if hub_offline():
                raise FileNotFoundError(
                    f"{self.model} at revision {rev.name!r} is not in the local Hugging Face cache "
                    f"(HF_HUB_OFFLINE=1{', cache ' + str(self.cache_dir) if self.cache_dir else ''})"
                ) from exc
            raise

    def _cached(self, commit: str, chosen: list[RemoteFile] | None) -> Path | None:
        """The user's cache's snapshot of ``commit`` when it holds every file to fetch (offline: when it exists)."""
        snapshot = cache_repo_dir(self.model, self.cache_dir) / "snapshots" / commit
        if not snapshot.is_dir():
            return None
        if chosen is not None and not all((snapshot / f.path).is_file() for f in chosen):
            return None
        return snapshot


class _SilentTqdm(tqdm):
    """huggingface_hub's progress bars, off (``progress=False``: tests, batch jobs)."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
