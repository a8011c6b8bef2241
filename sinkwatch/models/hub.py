"""Talking to the hub (docs/design.md §8), for replay and the plan: commit ids, a model's refs, a revision's files
before anything is downloaded (sizes, LFS sha256), and calls that survive the network — 5xx answers, 429s and
dropped, refused or timed-out connections are retried with exponential backoff and jitter (tenacity), then fail
with ``FetchError`` naming what was asked (the replay records that revision failed and goes on)."""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from .loading import HubUnreachableError, _is_network_error, hub_offline

# ---- commit ids and refs ---------------------------------------------------------------------------------
# A commit id is 40 lowercase hex digits: what the hub reports (list_repo_refs' target_commit, model_info's sha)
# and what keys the store and the metadata cache. Uppercase is not read as one: the same commit spelled twice
# would be two done keys. A ref of that spelling (a branch named with 40 hex letters) is the ref it is.
_COMMIT = re.compile(r"[0-9a-f]{40}")


def is_commit_id(name: str) -> bool:
    """Whether ``name`` is a full commit id (40 lowercase hex digits), not a branch or tag name."""
    return _COMMIT.fullmatch(name) is not None


def list_refs(model: str, *, cache_dir: str | None = None) -> dict[str, str]:
    """Every branch and tag of a hub model -> its commit (``list_repo_refs``' ``target_commit``); offline
    (``HF_HUB_OFFLINE=1``), the local cache's ``refs/<name>`` files."""
    import huggingface_hub

    if not hub_offline():
        try:  # a 5xx / dropped connection is retried; a hub that stays unreachable gets the advice
            refs = call_with_retries(lambda: huggingface_hub.list_repo_refs(model), RetryPolicy(), f"list the refs of {model}")
        except Exception as exc:  # noqa: BLE001 - classified: network problems get advice
            if _is_network_error(exc):
                raise HubUnreachableError(_offline_advice(model)) from exc
            raise
        return {ref.name: ref.target_commit for ref in [*refs.branches, *(refs.tags or [])]}
    refs_dir = cache_repo_dir(model, cache_dir) / "refs"
    if not refs_dir.is_dir():
        raise HubUnreachableError(_offline_advice(model))
    return {str(p.relative_to(refs_dir)): p.read_text().strip() for p in sorted(refs_dir.rglob("*")) if p.is_file()}


def cache_repo_dir(model: str, cache_dir: str | None) -> Path:
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(cache_dir or HF_HUB_CACHE) / ("models--" + model.replace("/", "--"))


def _offline_advice(model: str) -> str:
    return (
        f"cannot reach the Hugging Face hub to list or download {model}'s revisions. Replay from a local cache "
        "instead: on a machine with network run `hf download MODEL --revision REV` for each revision "
        "(or copy an existing HF cache), then set HF_HUB_OFFLINE=1 and HF_HOME (or pass --cache-dir) to point at it"
    )


def check_hub(model: str) -> None:
    """Fail fast with advice when the hub cannot be reached and replay is not explicitly offline."""
    if hub_offline() or os.path.isdir(model):
        return
    import huggingface_hub

    try:
        huggingface_hub.model_info(model, timeout=10)
    except Exception as exc:  # noqa: BLE001
        if _is_network_error(exc):
            raise HubUnreachableError(_offline_advice(model)) from exc


# ---- a revision's files -------------------------------------------------------------------------------------
# Files that hold weights: the ones a fingerprint covers and a plan sizes (configs and tokenizers are small).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")


# Training state beside the weights (the HF Trainer's checkpoint-N/): same suffixes, not the model's weights
NOT_WEIGHTS = re.compile(r"(training_args\.bin|optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|trainer_state\.json)")


def is_weight_file(path: str) -> bool:
    return path.endswith(WEIGHT_SUFFIXES) and not NOT_WEIGHTS.fullmatch(path.rsplit("/", 1)[-1])


@dataclass(frozen=True)
class RemoteFile:
    """One file of a hub revision: ``sha256`` is the LFS content hash (weights are LFS files on the hub),
    None for a plain git file, whose ``blob_id`` (git sha1 of the content) identifies it instead."""

    path: str
    size: int | None
    sha256: str | None
    blob_id: str | None

    @property
    def is_weights(self) -> bool:
        return is_weight_file(self.path)


# (endpoint, model, commit) -> its files: a commit never changes, so the fingerprint taken when the
# revisions are listed, the plan and the download all read its metadata with one request
_BY_COMMIT: dict[tuple[str, str, str], tuple[RemoteFile, ...]] = {}


def remote_files(model: str, revision: str) -> list[RemoteFile]:
    """Every file of ``model`` at ``revision`` (best a commit id) with its size and hashes, from the
    hub's file metadata (``model_info(files_metadata=True)``): one request, no download; one per commit
    per process (a branch name is asked each time: it may move)."""
    from huggingface_hub import HfApi, constants

    key = (constants.ENDPOINT, model, revision)
    if key in _BY_COMMIT:
        return list(_BY_COMMIT[key])
    info = HfApi().model_info(model, revision=revision, files_metadata=True)
    files = [
        RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in sorted(info.siblings or [], key=lambda s: s.rfilename)
    ]
    if is_commit_id(revision):
        _BY_COMMIT[key] = tuple(files)
    return files


def remember_files(model: str, commit: str, files: list[RemoteFile]) -> None:
    """Known files of ``model`` at ``commit`` (from the manifest): ``remote_files`` asks the hub nothing for it."""
    from huggingface_hub import constants

    _BY_COMMIT[(constants.ENDPOINT, model, commit)] = tuple(files)


def remembered_files(model: str, commit: str) -> list[RemoteFile] | None:
    """The files ``remote_files`` read for ``commit`` in this process, if it did."""
    from huggingface_hub import constants

    got = _BY_COMMIT.get((constants.ENDPOINT, model, commit))
    return list(got) if got is not None else None


# ---- retries -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently a hub call is retried. Waits grow as backoff_s x 2^k (with jitter) up to backoff_max_s."""

    retries: int = 5  # attempts after the first, per hub call
    backoff_s: float = 2.0
    backoff_max_s: float = 120.0

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.retries, int) or isinstance(self.retries, bool) or self.retries < 0:
            raise ValueError(f"{name}.retries must be an int >= 0, got {self.retries!r}")
        for field_name in ("backoff_s", "backoff_max_s"):
            v = getattr(self, field_name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}.{field_name} must be a number of seconds >= 0, got {v!r}")


class FetchError(RuntimeError):
    """A revision could not be downloaded after the retries."""


# ---- what is transient -------------------------------------------------------------------------------------
def is_transient(exc: BaseException) -> bool:
    """A failure worth retrying: a 5xx or 429 answer, a dropped, refused or timed-out connection —
    anywhere in the exception's chain (huggingface_hub wraps some in LocalEntryNotFoundError)."""
    import httpx

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
        if isinstance(status, int) and (status >= 500 or status == 429):
            return True
        if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def call_with_retries(fn, config: RetryPolicy, what: str):
    """``fn()`` retried on transient failures (``is_transient``) with exponential backoff and jitter;
    the last failure is raised as ``FetchError`` naming ``what`` and the attempts."""
    import tenacity

    def say(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception()
        warnings.warn(
            f"sinkwatch replay: {what}: {type(exc).__name__}: {short_error(exc)}; retry {state.attempt_number} of {config.retries} "
            f"in {state.next_action.sleep:.1f} s",
            RuntimeWarning,
            stacklevel=1,  # tenacity calls this: the line to read is here
        )

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(config.retries + 1),
        # backoff_s x 2^k up to backoff_max_s, plus up to backoff_s of jitter (the same in every tenacity >= 8.2)
        wait=tenacity.wait_exponential(multiplier=config.backoff_s, max=config.backoff_max_s) + tenacity.wait_random(0, config.backoff_s),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=say,
        reraise=True,
    )
    try:
        return retrying(fn)
    except Exception as exc:
        if is_transient(exc):
            raise FetchError(f"{what}: {type(exc).__name__}: {short_error(exc)} (after {config.retries + 1} attempts)") from exc
        raise


def short_error(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:300] if str(exc) else ""
