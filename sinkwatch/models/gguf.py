"""Real trained models shipped as GGUF files: dequantised once into a plain ``save_pretrained`` folder.

transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``, which needs the ``gguf``
package) dequantises the weights into a full-precision model, but marks it quantised, and
``save_pretrained`` then refuses it. ``dense_from_gguf`` rebuilds the model from its config without
the quantisation marker, loads the dequantised state dict, ties the embeddings again, and saves it
with the tokenizer, so every later load is a fast, ordinary ``from_pretrained(folder)``: the path
``sinkwatch probe`` and replay take for any model.

The dequantised weights are the GGUF's, not the original checkpoint's: a Q4 model is a real trained
model with 4-bit rounding in its weights, and the records say which file they came from
(``config.json``'s ``sinkwatch_gguf_source``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

GGUF_SUFFIX = ".gguf"
SOURCE_KEY = "sinkwatch_gguf_source"  # in the saved config.json: which GGUF file the weights came from


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(GGUF_SUFFIX) and os.path.isfile(path)


def default_cache_dir() -> Path:
    """``$SINKWATCH_CACHE/gguf`` or ``~/.cache/sinkwatch/gguf``."""
    root = os.environ.get("SINKWATCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sinkwatch")
    return Path(root) / "gguf"


def _file_key(path: Path) -> str:
    """A cache key that changes when the file does: its name, size and modification time."""
    st = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{path.stem}-{digest}"


def dense_from_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """A ``save_pretrained`` folder (float32 weights, config, tokenizer) of the model in ``gguf_path``.

    ``out_dir`` defaults to a folder under ``default_cache_dir()`` keyed by the file's path, size and
    mtime; an existing complete folder is reused (a half-written one never is: the folder is written
    under a temporary name and renamed).
    """
    src = Path(gguf_path)
    if not is_gguf(src):
        raise ValueError(f"{gguf_path} is not a .gguf file")
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / _file_key(src)
    if (out / "config.json").is_file():
        return out
    try:
        import gguf  # noqa: F401 - transformers' GGUF loader needs it
    except ImportError:
        raise ImportError("loading a .gguf model needs the gguf package: pip install 'sinkwatch[gguf]' (or pip install gguf)") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantised = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are already dequantised
    setattr(config, SOURCE_KEY, src.name)
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = dense.load_state_dict(quantised.state_dict(), strict=False)
    tied = set(getattr(dense, "_tied_weights_keys", None) or [])
    untied = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if untied or unexpected:
        raise ValueError(
            f"{src.name}: the dequantised weights do not fit {type(dense).__name__} (missing {untied}, unexpected {unexpected})"
        )
    dense.tie_weights()
    del quantised
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    dense.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished first: use its folder
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
