"""What the hub says about a revision's files before anything is downloaded (sizes, LFS sha256)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .revisions import is_commit_id

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
