"""Backend dispatch of the attention-statistics primitive (SPEC §4); its contract (arguments,
shapes, outputs) is ``sinkwatch.kernels.contract``.

    attention_stats(q, k, scaling, *, rows=None, cols=None, n_first=8, window=None, softcap=None, backend="auto")
"""

from __future__ import annotations

import torch

from .contract import AttentionStats, validate

BACKENDS = ("auto", "triton", "torch", "reference")


def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    scaling: float,
    *,
    rows: torch.Tensor | None = None,
    cols: torch.Tensor | None = None,
    n_first: int = 8,
    window: int | None = None,
    softcap: float | None = None,
    backend: str = "auto",
) -> AttentionStats:
    """Per-row attention statistics without materialising the S x S attention matrix.

    ``backend``: "auto" (Triton on CUDA tensors, the chunked PyTorch path elsewhere), "triton"
    (also on CPU tensors when ``TRITON_INTERPRET=1`` was set before import), "torch", or
    "reference" (float64, materialising; for tests only).
    """
    problem = validate(q, k, scaling, rows, cols, n_first, window, softcap)  # first: q may not be a tensor
    backend = resolve_backend(backend, problem.q.device)
    if backend == "torch":
        from .torch_chunked import attention_stats_torch

        return attention_stats_torch(problem)
    if backend == "reference":
        from .reference import attention_stats_reference

        return attention_stats_reference(problem)
    from .triton_stats import attention_stats_triton

    return attention_stats_triton(problem)


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The backend ``attention_stats`` runs for tensors on ``device``: "auto" is Triton on CUDA
    (when Triton imports) and the chunked PyTorch path elsewhere; any other name is itself."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" and _triton_usable() else "torch"
    return backend


def _triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
