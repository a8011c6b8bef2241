"""What the hub says about a revision's files before anything is downloaded (sizes, LFS sha256)."""

from __future__ import annotations

from dataclasses import dataclass

# Files that hold weights: the ones a fingerprint covers and a plan sizes (configs and tokenizers are small).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")


def is_weight_file(path: str) -> bool:
    return path.endswith(WEIGHT_SUFFIXES)


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


def remote_files(model: str, revision: str) -> list[RemoteFile]:
    """Every file of ``model`` at ``revision`` (best a commit id) with its size and hashes, from the
    hub's file metadata (``model_info(files_metadata=True)``): one request, no download."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(model, revision=revision, files_metadata=True)
    return [
        RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in sorted(info.siblings or [], key=lambda s: s.rfilename)
    ]
