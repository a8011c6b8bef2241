"""Backend dispatch of the attention-statistics primitive and of the fused pass; their contract
(arguments, shapes, outputs) is ``sinkwatch.kernels.contract``.

    attention_stats(q, k, scaling, *, rows=None, cols=None, n_first=8, window=None, softcap=None, sinks=None,
                    backend="auto", fused=None, entropy=True)
    attention_output(q, k, v, scaling, *, window=None, softcap=None, sinks=None, backend="auto")

The Triton kernels are checked on their first launch on each device (``verify``): a few rows
against the PyTorch path, within ``CHECK_ATOL``/``CHECK_RTOL``; a kernel that faults or disagrees
is given up for the process after one warning.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable

import torch

from .contract import AttentionOutput, AttentionStats, StatsProblem, validate, validate_value

BACKENDS = ("auto", "triton", "torch", "reference")
# Who computes a probe forward's attention output (``output_backend``), set by this variable:
#   auto   sinkwatch's fused pass on CPU for float32/float64 (one QK^T gives the output and the
#          statistics); the model's own attention (flash/sdpa) on GPU, beside the Triton statistics
#          kernel, and for 16-bit inputs, whose rounding of P·V is part of the model's forward
#   model  the model's own attention everywhere (the statistics then take a pass of their own)
#   fused  sinkwatch's fused pass everywhere: the fused Triton kernel on CUDA (not yet measured on hardware)
OUTPUT_ENV = "SINKWATCH_ATTENTION_OUTPUT"
OUTPUT_MODES = ("auto", "model", "fused")
# The first-launch check: a Triton kernel's numbers on a few rows against the PyTorch path's.
# Ten times the drift the GPU tests allow between the two (5e-5 absolute, 1e-4 relative at
# S = 4096, two float32 accumulations in different orders); a wrong kernel is off by far more.
CHECK_ATOL = 5e-4
CHECK_RTOL = 1e-3
CHECK_ROWS = 4  # query rows of the first sequence compared (first, last and two between)


def output_tolerance(dtype: torch.dtype) -> float:
    """How far two correct attention outputs may differ, as a share of max |v| (an output row is a
    convex combination of v's rows): CHECK_RTOL, or four roundings of a 16-bit dtype (flash and
    eager attention round the probabilities to it before P·V)."""
    return max(CHECK_RTOL, 4 * torch.finfo(dtype).eps)


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
    fused: AttentionOutput | None = None,
    entropy: bool = True,
) -> AttentionStats:
    """Per-row attention statistics without materialising the S x S attention matrix.

    ``sinks`` (Hq,): learnable sink logits that join every row's softmax (gpt-oss, OLMo-core);
    every backend includes them exactly, and the sink's own probability is exp(sinks[h] - lse).

    ``backend``: "auto" (Triton on CUDA tensors, the chunked PyTorch path elsewhere), "triton"
    (also on CPU tensors when ``TRITON_INTERPRET=1`` was set before import), "torch", or
    "reference" (float64, materialising; for tests only).

    ``fused``: what ``attention_output`` returned for these same q, k, scaling, window, softcap and
    sinks. When the backend that computed it is the one this call resolves to, ``lse``, ``first``
    and ``gathered`` are read off its lse — O(Q (n_first + G) D), no second pass over the keys —
    and only the entropy needs the chosen rows' keys. The reference never reads it.

    ``entropy``: False when the caller does not use it: the entropy is then NaN, and a call with
    ``fused`` makes no pass over the keys at all.

    Faults of the Triton kernel ("auto" or "triton"): if it cannot compile or launch, or its first
    launch on a device faults (the stream is synchronized once per device, so an asynchronous fault
    is attributed to the kernel there, not to whatever synchronizes next) or disagrees with the
    PyTorch path on a few rows beyond ``CHECK_ATOL``/``CHECK_RTOL``, the call falls back to the
    torch path and so does every later call in the process, after one warning. Running out of
    memory is not a fault of the kernel: that call raises the out-of-memory error (the probe fails;
    the live monitor records it and training goes on) and later calls use the kernel again.
    """
    problem = validate(q, k, scaling, rows, cols, n_first, window, softcap, sinks)  # first: q may not be a tensor
    backend = resolve_backend(backend, problem.q.device)
    if fused is not None and not isinstance(fused, AttentionOutput):
        raise TypeError(f"fused must be what attention_output returned (an AttentionOutput), got {type(fused).__name__}")
    if fused is not None and backend != "reference" and fused.backend == backend:
        from .lse_stats import stats_from_lse

        out = stats_from_lse(problem, _fused_lse(fused, problem))
        if entropy:  # a pass over the chosen rows' keys: O(Q S D)
            out = out._replace(entropy=_stats(problem._replace(n_first=0, cols=None), backend).entropy)
        return out
    out = _stats(problem, backend)
    return out if entropy else out._replace(entropy=torch.full_like(out.entropy, math.nan))


def _stats(problem: StatsProblem, backend: str) -> AttentionStats:
    if backend == "reference":
        from .reference import attention_stats_reference

        return attention_stats_reference(problem)
    if backend == "triton":
        out = _triton_or_none(problem)
        if out is not None:
            return out
    from .torch_chunked import attention_stats_torch

    return attention_stats_torch(problem)


def _fused_lse(fused: AttentionOutput, problem: StatsProblem) -> torch.Tensor:
    B, Hq, _, S, _, _, _ = problem.shape
    if tuple(fused.lse.shape) != (B, Hq, S) or fused.lse.device != problem.q.device:
        raise ValueError(
            f"fused.lse {tuple(fused.lse.shape)} on {fused.lse.device} is not every row of this q ({B}, {Hq}, {S}) on {problem.q.device}"
        )
    return fused.lse


def attention_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
) -> AttentionOutput:
    """The causal attention output (B, Hq, S, Dv) in v's dtype and every row's lse (B, Hq, S)
    float32, from one pass over the keys (learned sinks, windows and soft-caps as
    ``attention_stats`` takes them). q (B, Hq, S, D); k (B, Hkv, S, D) and v (B, Hkv, S, Dv), both
    not repeated for GQA. ``attention_stats(..., fused=result)`` then reads the statistics off it.

    ``backend``: "auto" (the fused Triton kernel on CUDA tensors, the PyTorch path elsewhere),
    "triton", "torch", "reference" (float64, materialising; for tests only). The Triton kernel's
    first launch on each device is checked against the PyTorch path on a few rows; a kernel that
    cannot launch or disagrees is given up for the process after one warning (the PyTorch path
    then computes the result, ``backend`` "torch").
    """
    problem = validate(q, k, scaling, None, None, 0, window, softcap, sinks)
    v = validate_value(problem, v)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if problem.q.device.type == "cuda" and _triton_usable() else "torch"
    if backend == "reference":
        from .reference import attention_output_reference

        return attention_output_reference(problem, v)
    if backend == "triton" and _fused_failure is None:
        out = _fused_triton_or_none(problem, v)
        if out is not None:
            return out
    from .fused_torch import attention_output_torch

    return attention_output_torch(problem, v)


def output_backend(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str | None:
    """Who computes a probe forward's attention output for ``dtype`` inputs on ``device``
    (``OUTPUT_ENV``): "torch" or "triton" (sinkwatch's fused pass, whose lse the statistics then
    read) or None (the model's own attention, the statistics beside it)."""
    mode = os.environ.get(OUTPUT_ENV, "auto") or "auto"
    if mode not in OUTPUT_MODES:
        raise ValueError(f"{OUTPUT_ENV} must be one of {OUTPUT_MODES}, got {mode!r}")
    device = torch.device(device)
    if mode == "model":
        return None
    if device.type == "cpu" and (mode == "fused" or dtype in (torch.float32, torch.float64)):
        return "torch"
    if mode == "fused" and device.type == "cuda" and _triton_usable() and _fused_failure is None:
        return "triton"
    return None


# ---- Triton: faults, the first-launch check, giving a kernel up -------------------------------------
# Why each Triton kernel was given up in this process, or None. Set once by the first failure: every
# later call (and ``resolve_backend``, which names the backend in each record) takes the torch path,
# so a probe never mixes the two and a kernel that cannot compile is not recompiled at every layer.
_triton_failure: str | None = None  # the statistics kernel
_fused_failure: str | None = None  # the fused-output kernel
# What was synchronized and checked after its first launch and came back clean, per kernel: keys of
# ``_launch_kind`` (the statistics kernel: each device, dtype and specialisation once) and devices.
_checked_devices: set = set()
_checked_fused: set[str] = set()


class KernelMismatch(RuntimeError):
    """A Triton kernel's first launch on a device disagreed with the PyTorch path."""


def _triton_or_none(problem: StatsProblem) -> AttentionStats | None:
    """The Triton kernel's statistics; None once it failed here (the caller takes the torch path)."""
    try:
        from .triton_stats import attention_stats_triton

        out = attention_stats_triton(problem)
        _first_launch_done(problem, out)
        return out
    except Exception as exc:  # noqa: BLE001 - compile/launch failures: an older GPU, a dtype or driver it lacks
        if is_out_of_memory(exc):
            raise  # transient: the memory the training run holds right now; the process keeps the kernel
        _mark_triton_unusable(exc)
        return None


def _fused_triton_or_none(problem: StatsProblem, v: torch.Tensor) -> AttentionOutput | None:
    try:
        from .triton_fused import attention_output_triton

        out = attention_output_triton(problem, v)
        key = str(problem.q.device)
        if key not in _checked_fused:
            _synchronize(problem.q.device)
            _verify_output(problem, v, out)
            _checked_fused.add(key)
        return out
    except Exception as exc:  # noqa: BLE001 - as for the statistics kernel
        if is_out_of_memory(exc):
            raise
        _mark_fused_unusable(exc)
        return None


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


def _first_launch_done(problem: StatsProblem, out: AttentionStats) -> None:
    """After the kernel's first launch of a kind (``_launch_kind``): wait for it, so a fault it caused
    raises here, inside ``attention_stats``'s fallback, instead of at the next synchronizing call of
    the run; then compare a few of its rows with the PyTorch path (``verify``)."""
    key = _launch_kind(problem)
    if key not in _checked_devices:
        _synchronize(problem.q.device)
        verify(problem, out)
        _checked_devices.add(key)


def _launch_kind(problem: StatsProblem) -> tuple:
    """A device and a specialisation of the kernel (dtype, row subset, gathered columns, first keys,
    window, soft-cap): each is checked on its own first launch, so a fault in a code path the first
    call did not take (the gathered columns of an induction probe) is still caught."""
    G = problem.shape[-1]
    flags = (problem.rows is not None, G > 0, problem.n_first > 0, problem.window is not None, problem.softcap is not None)
    return (str(problem.q.device), problem.q.dtype, *flags)


def _synchronize(device: torch.device) -> None:
    # CUDA launches are asynchronous; the CPU interpreter's are not (nothing to wait for)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_rows(Q: int) -> list[int]:
    return sorted({0, Q // 3, (2 * Q) // 3, Q - 1})[:CHECK_ROWS]


def verify(problem: StatsProblem, out: AttentionStats) -> None:
    """Raise ``KernelMismatch`` when the kernel's statistics of a few rows (the first sequence) differ
    from the PyTorch path's, computed on the CPU (exact float32 products, whatever TF32 setting the
    run chose), beyond ``CHECK_ATOL`` + ``CHECK_RTOL`` x |torch|."""
    from .torch_chunked import attention_stats_torch

    B, Hq, _, S, _, Q, G = problem.shape
    if B == 0 or Q == 0:
        return
    idx = torch.tensor(_check_rows(Q))
    rows = problem.query_positions()[:1, idx.to(problem.q.device)].cpu()  # (1, R)
    cols = problem.cols[:1, idx.to(problem.q.device)].cpu() if problem.cols is not None else None
    cpu = problem._replace(
        q=problem.q[:1].cpu(), k=problem.k[:1].cpu(), rows=rows, cols=cols,
        sinks=problem.sinks.cpu() if problem.sinks is not None else None,
    )  # fmt: skip
    want = attention_stats_torch(cpu)
    for name, got_all, expected in zip(AttentionStats._fields, out, want):
        got = got_all[:1, :, idx.to(got_all.device)].float().cpu()
        _compare(f"statistics kernel's {name}", got, expected)


def _verify_output(problem: StatsProblem, v: torch.Tensor, out: AttentionOutput) -> None:
    """The fused kernel's output and lse on a few rows of the first sequence against float64 on the
    CPU. The output's tolerance scales with v's dtype (16-bit inputs: P is rounded to it for P·V)."""
    from .reference import attention_output_reference

    B, Hq, _, S, _, _, _ = problem.shape
    if B == 0 or S == 0:
        return
    idx = torch.tensor(_check_rows(S))
    last = int(idx.max()) + 1  # rows up to the last checked one see keys up to it only
    cpu = problem._replace(
        q=problem.q[:1, :, :last].cpu(), k=problem.k[:1, :, :last].cpu(),
        sinks=problem.sinks.cpu() if problem.sinks is not None else None,
    )  # fmt: skip
    want = attention_output_reference(cpu, v[:1, :, :last].cpu())
    _compare("fused kernel's lse", out.lse[:1, :, idx.to(out.lse.device)].cpu(), want.lse[:, :, idx].float())
    tol = output_tolerance(v.dtype)
    scale = float(v[:1].abs().max()) or 1.0  # the output is a convex combination of v's rows
    got = out.output[:1, :, idx.to(out.output.device)].double().cpu()
    err = float((got - want.output[:, :, idx]).abs().max())
    if not err <= tol * scale:
        raise KernelMismatch(f"the fused kernel's output is off by {err:.3g} on its first launch (tolerance {tol * scale:.3g})")


def _compare(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want.double()).abs()
    bound = CHECK_ATOL + CHECK_RTOL * want.double().abs()
    if not bool((err <= bound).all()):  # NaN fails too
        worst = float(torch.nan_to_num(err - bound, nan=math.inf).max())
        raise KernelMismatch(f"the {what} disagrees with the PyTorch path on its first launch (beyond tolerance by {worst:.3g})")


def _mark_triton_unusable(exc: BaseException) -> None:
    global _triton_failure
    if _triton_failure is None:
        _triton_failure = _describe(exc)
        warnings.warn(
            f"sinkwatch: the Triton attention-statistics kernel failed ({_triton_failure[:300]}); this process now uses the "
            "chunked PyTorch path (same statistics, slower; records say stats_backend: torch). backend='torch' silences this.",
            RuntimeWarning,
            stacklevel=4,
        )


def _mark_fused_unusable(exc: BaseException) -> None:
    global _fused_failure
    if _fused_failure is None:
        _fused_failure = _describe(exc)
        warnings.warn(
            f"sinkwatch: the fused Triton attention-output kernel failed ({_fused_failure[:300]}); this process now leaves "
            f"the attention output to the model's own attention ({OUTPUT_ENV}=auto silences this).",
            RuntimeWarning,
            stacklevel=4,
        )


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def triton_failure() -> str | None:
    """Why the Triton kernel was given up in this process (None while it works or was never tried)."""
    return _triton_failure


def prepare_backend(
    backend: str, device: torch.device | str, dtype: torch.dtype = torch.float32, all_reduce: Callable[[torch.Tensor], None] | None = None
) -> None:
    """Before a probe's forwards: the Triton kernels in play are checked now, so a probe does not
    switch backends halfway, and under data parallelism every rank ends with the same ones given up.

    The kinds of launch a probe makes (every row with the first keys; chosen rows with gathered
    columns; the fused output when in play) are launched once in ``dtype`` on a small problem and
    checked as on a first launch, unless already checked (once per process and kind). With
    ``all_reduce`` (a sum over the data-parallel ranks) what each rank gave up is then summed, and a
    rank whose own checks passed gives a kernel up too when another rank's failed, so records name
    one backend on every rank; every rank must then call this (a collective), whatever its own
    state: ``backend`` and ``device``'s type decide whether a Triton kernel is in play, alike on
    every rank. A kind first launched inside the probe (a sliding-window or soft-capped layer, a
    dtype other than ``dtype``) is checked there; if that check fails, the rest of the probe takes
    the PyTorch path (within the check's tolerance of the kernel's numbers) and the record says torch."""
    device = torch.device(device)
    stats_in_play = backend == "triton" or (backend == "auto" and device.type == "cuda" and _triton_usable())
    if not stats_in_play:
        return
    if _triton_failure is None:
        q, k, _ = _probe_inputs(device, dtype)
        scale = q.shape[-1] ** -0.5
        attention_stats(q, k, scale, backend="triton")
        rows, cols = torch.tensor([[95, 40]], device=device), torch.tensor([[[0, 93], [39, -1]]], device=device)
        attention_stats(q, k, scale, rows=rows, cols=cols, n_first=0, backend="triton")
    if output_backend(device, dtype) == "triton" and str(device) not in _checked_fused:
        q, k, v = _probe_inputs(device, dtype)
        attention_output(q, k, v, q.shape[-1] ** -0.5, backend="triton")
    if all_reduce is None:
        return
    flags = torch.tensor([_triton_failure is not None, _fused_failure is not None], dtype=torch.float64)
    all_reduce(flags)
    if flags[0] > 0 and _triton_failure is None:
        _mark_triton_unusable(RuntimeError("another data-parallel rank gave the kernel up; every rank uses one backend"))
    if flags[1] > 0 and _fused_failure is None:
        _mark_fused_unusable(RuntimeError("another data-parallel rank gave the kernel up; every rank uses one output path"))


def _probe_inputs(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A small problem for the pre-probe check: GQA 4/2, 96 rows, head dim 64, fixed values."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 96, 64, generator=g).to(device=device, dtype=dtype) for h in (4, 2, 2))
    return q, k, v


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
