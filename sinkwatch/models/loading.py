"""Loading a model (hub id or local directory, optional revision) the way the real hub does it."""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class HubUnreachableError(RuntimeError):
    """The Hugging Face hub could not be reached and nothing usable is cached locally."""


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def default_device() -> str:
    """cuda (this process's GPU under torchrun / accelerate launch: cuda:LOCAL_RANK) if available, else cpu.

    Replay sharded over one process per GPU would otherwise load every shard onto cuda:0."""
    if not torch.cuda.is_available():
        return "cpu"
    local_rank = os.environ.get("LOCAL_RANK")
    return f"cuda:{int(local_rank) % torch.cuda.device_count()}" if local_rank not in (None, "") else "cuda"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _is_network_error(exc: BaseException) -> bool:
    names = {type(e).__name__ for e in _chain(exc)}
    hints = (
        "ConnectionError",
        "ConnectError",
        "LocalEntryNotFoundError",
        "OfflineModeIsEnabled",
        "Timeout",
        "MaxRetryError",
        "NameResolutionError",
    )
    text = " ".join(str(e) for e in _chain(exc))
    return bool(names & set(hints)) or any(
        h in text
        for h in (
            "couldn't connect",
            "Cannot reach",
            "offline mode",
            "Failed to resolve",
            "Name or service not known",
            "Max retries exceeded",
            "Network is unreachable",
        )
    )


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def loaded_attention(model) -> str:
    """The attention implementation ``model`` was loaded with — sdpa where its class can run it, eager
    where it cannot (gpt-oss, Gemma 2): the model's default attention, to go back to after a pass
    that switched it (the paper protocol's eager float16 screen)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"


def load_model(
    name_or_path: str,
    *,
    revision: str | None = None,
    dtype: str = "float32",
    device: str | None = None,
    cache_dir: str | None = None,
    device_map: dict | None = None,
):
    """``AutoModelForCausalLM.from_pretrained(name_or_path, revision=...)`` in eval mode, with sdpa attention
    where the model's class can run it and eager attention where it cannot (gpt-oss: learned sinks;
    Gemma 2: soft-capping; transformers' own default choice).

    ``device_map`` (``{"": "cuda:0"}``, or one module -> device entry per block for a model split
    over GPUs) loads the weights straight where they go; without it the model is built on the CPU
    and moved to ``device``. Raises ``HubUnreachableError`` with what to do when the hub cannot be
    reached, and ``FileNotFoundError`` when a revision does not exist.
    """
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path,
            revision=revision,
            dtype=parse_dtype(dtype),
            attn_implementation=None,  # transformers' own choice: sdpa where the class can run it, else eager
            cache_dir=cache_dir,
            **({"device_map": device_map} if device_map is not None else {}),
        )
    except Exception as exc:  # noqa: BLE001 - classified below, re-raised with advice
        if os.path.isdir(name_or_path):
            raise
        if hub_offline():
            raise FileNotFoundError(
                f"{name_or_path}" + (f" at revision {revision}" if revision else "") + " is not in the local Hugging Face cache "
                f"(HF_HUB_OFFLINE=1{', cache ' + cache_dir if cache_dir else ''}): {type(exc).__name__}"
            ) from exc
        if _is_network_error(exc):
            raise HubUnreachableError(
                f"cannot reach the Hugging Face hub to load {name_or_path}"
                + (f" at revision {revision}" if revision else "")
                + ". Replay from a local cache instead: download the revisions on a machine with network "
                "(hf download NAME --revision REV), point HF_HOME (or --cache-dir) at that cache and set "
                "HF_HUB_OFFLINE=1, or pass a local directory written by save_pretrained."
            ) from exc
        if "revision" in str(exc).lower() or type(exc).__name__ in ("RevisionNotFoundError", "EntryNotFoundError"):
            raise FileNotFoundError(f"{name_or_path} has no revision {revision!r}: {exc}") from exc
        raise
    if device_map is not None:
        return model.eval()
    return model.to(device or default_device()).eval()
