"""Backend dispatch of the attention-statistics primitive (SPEC §4); its contract (arguments,
shapes, outputs) is ``sinkwatch.kernels.contract``.

    attention_stats(q, k, scaling, *, rows=None, cols=None, n_first=8, window=None, softcap=None, sinks=None, backend="auto")
"""

from __future__ import annotations

import warnings

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
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
) -> AttentionStats:
    """Per-row attention statistics without materialising the S x S attention matrix.

    ``sinks`` (Hq,): learnable sink logits that join every row's softmax (gpt-oss, OLMo-core);
    every backend includes them exactly, and the sink's own probability is exp(sinks[h] - lse).

    ``backend``: "auto" (Triton on CUDA tensors, the chunked PyTorch path elsewhere), "triton"
    (also on CPU tensors when ``TRITON_INTERPRET=1`` was set before import), "torch", or
    "reference" (float64, materialising; for tests only).

    Faults of the Triton kernel ("auto" or "triton"): if it cannot compile or launch, or its first
    launch on a device faults (the stream is synchronized once per device, so an asynchronous fault
    is attributed to the kernel there, not to whatever synchronizes next), the call falls back to the
    torch path and so does every later call in the process, after one warning. Running out of memory
    is not a fault of the kernel: that call raises the out-of-memory error (the probe fails; the
    live monitor records it and training goes on) and later calls use the kernel again.
    """
    problem = validate(q, k, scaling, rows, cols, n_first, window, softcap, sinks)  # first: q may not be a tensor
    backend = resolve_backend(backend, problem.q.device)
    if backend == "reference":
        from .reference import attention_stats_reference

        return attention_stats_reference(problem)
    if backend == "triton":
        out = _triton_or_none(problem)
        if out is not None:
            return out
    from .torch_chunked import attention_stats_torch

    return attention_stats_torch(problem)


def _triton_or_none(problem) -> AttentionStats | None:
    """The Triton kernel's statistics; None once it failed here (the caller takes the torch path)."""
    try:
        from .triton_stats import attention_stats_triton

        out = attention_stats_triton(problem)
        _first_launch_done(problem.q.device)
        return out
    except Exception as exc:  # noqa: BLE001 - compile/launch failures: an older GPU, a dtype or driver it lacks
        if is_out_of_memory(exc):
            raise  # transient: the memory the training run holds right now; the process keeps the kernel
        _mark_triton_unusable(exc)
        return None


# Why the Triton kernel failed in this process, or None. Set once by the first failure: every later
# call (and ``resolve_backend``, which names the backend in each record) goes to the torch path, so
# a probe never mixes the two and a kernel that cannot compile is not recompiled at every layer.
_triton_failure: str | None = None
# Devices whose first launch was synchronized and came back clean.
_checked_devices: set[str] = set()


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed for want of memory (``torch.OutOfMemoryError``, a CUDA "out of
    memory", the CPU allocator's "can't allocate memory"), here or in an exception it chains."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _first_launch_done(device: torch.device) -> None:
    """After the kernel's first launch on ``device``: wait for it, so a fault it caused raises here,
    inside ``attention_stats``'s fallback, instead of at the next synchronizing call of the run."""
    key = str(device)
    if key not in _checked_devices:
        _synchronize(device)
        _checked_devices.add(key)


def _synchronize(device: torch.device) -> None:
    # CUDA launches are asynchronous; the CPU interpreter's are not (nothing to wait for)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mark_triton_unusable(exc: BaseException) -> None:
    global _triton_failure
    if _triton_failure is None:
        _triton_failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        warnings.warn(
            f"sinkwatch: the Triton attention-statistics kernel failed ({_triton_failure[:300]}); this process now uses the "
            "chunked PyTorch path (same statistics, slower; records say stats_backend: torch). backend='torch' silences this.",
            RuntimeWarning,
            stacklevel=3,
        )


def triton_failure() -> str | None:
    """Why the Triton kernel was given up in this process (None while it works or was never tried)."""
    return _triton_failure


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The backend ``attention_stats`` runs for tensors on ``device``: "auto" is Triton on CUDA
    (when Triton imports) and the chunked PyTorch path elsewhere; any other name is itself, except
    that "auto" and "triton" both mean "torch" once the kernel failed to compile or launch here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" and _triton_usable() else "torch"
    if backend == "triton" and _triton_failure is not None:
        return "torch"
    return backend


def _triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
