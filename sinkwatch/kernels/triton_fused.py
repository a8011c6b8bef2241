"""Triton backend of the fused pass (``attention_output``): the attention output and every row's lse.

Not the GPU default: on CUDA a probe forward keeps the model's own attention (flash/sdpa) for the
output and runs ``triton_stats`` beside it, until a measurement on hardware shows this kernel is
faster (``benchmarks/gpu_check.sh`` times both); ``SINKWATCH_ATTENTION_OUTPUT=fused`` opts in.

One program handles BLOCK_M query rows of one (sequence, q-head), a FlashAttention-2 forward:
online softmax over key blocks 0 .. the block's last row (blocks above the causal diagonal and
left of a sliding window are never visited) with running max m, sum l and the (BLOCK_M, Dv)
accumulator; out = acc / l, lse = m + log l. GQA by index, arbitrary strides, soft-capping as in
``triton_stats``. 16-bit inputs multiply on tensor cores (P cast to the input dtype for P·V, as
flash attention does); float32 inputs use the exact FMA product; the interpreter casts to float32.
Learned sinks are folded in afterwards (``contract.fold_sinks_into_output``).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .contract import AttentionOutput, StatsProblem, fold_sinks_into_output
from .triton_stats import _INTERPRET, _NEG, _dot_f32, _pow2_at_least_16, _softcap


def _configs(interpret: bool = _INTERPRET):
    if interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2)]
    ]


def _prune(configs, named_args, **kwargs):
    # float32: operands of the FMA product live in registers; wide key blocks spill (see triton_stats)
    if named_args["q_ptr"].dtype == torch.float32:
        return [c for c in configs if c.kwargs["BLOCK_N"] <= 32] or list(configs)
    return list(configs)


@triton.autotune(configs=_configs(), key=["SEQ", "HEAD_DIM", "HEAD_DIM_V", "CAST_F32"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _attention_output_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    sq_b, sq_h, sq_s, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sv_b, sv_h, sv_s, sv_d,
    scaling, softcap, window,
    N_Q_HEADS, GROUPS, SEQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAST_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)  # (sequence, q-head) on axis 0: axes 1 and 2 stop at 65535
    pid_m = tl.program_id(1)
    b = (pid_bh // N_Q_HEADS).to(tl.int64)
    h = pid_bh % N_Q_HEADS
    kvh = h // GROUPS

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < SEQ
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    q_rows = q_ptr + b * sq_b + h * sq_h + offs_m * sq_s  # (BLOCK_M,) pointers to each row's q
    q = tl.load(q_rows[:, None] + offs_d[None, :] * sq_d, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, SEQ)  # causal crop: keys after the block's last row
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pid_m * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < SEQ
        k = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :] * sk_d, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = _dot_f32(q, k, CAST_F32) * scaling
        if HAS_SOFTCAP:
            s = _softcap(s, softcap)
        valid = (offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            valid = valid & ((offs_m[:, None] - offs_n[None, :]) < window)
        s = tl.where(valid, s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(valid, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None] * sv_s + offs_dv[None, :] * sv_d, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        if CAST_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(m_ok, l_i, 1.0)  # padding rows of the block saw no key
    out = acc / l_safe[:, None]
    row = pid_bh.to(tl.int64) * SEQ + offs_m  # outputs are contiguous (B, Hq, S, ...)
    tl.store(o_ptr + row[:, None] * HEAD_DIM_V + offs_dv[None, :], out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
    tl.store(lse_ptr + row, m_i + tl.log(l_safe), mask=m_ok)


def specialisation(*, head_dim: int, head_dim_v: int, window: bool, softcap: bool, float32: bool, interpret: bool = _INTERPRET) -> dict:
    """The constexpr arguments of one launch (shared with the ahead-of-time compile check)."""
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=_pow2_at_least_16(head_dim), HEAD_DIM_V=head_dim_v, BLOCK_DV=_pow2_at_least_16(head_dim_v),
        HAS_WINDOW=window, HAS_SOFTCAP=softcap, CAST_F32=interpret or float32,
    )  # fmt: skip


def attention_output_triton(problem: StatsProblem, v: torch.Tensor) -> AttentionOutput:
    q, k = problem.q, problem.k
    B, Hq, Hkv, S, D, _, _ = problem.shape
    if q.dtype == torch.float64:  # the kernel accumulates in float32 whatever the inputs
        q, k, v = q.float(), k.float(), v.float()
    Dv = v.shape[-1]
    out = torch.empty(B, Hq, S, Dv, dtype=v.dtype, device=q.device)
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    grid = lambda meta: (B * Hq, triton.cdiv(S, meta["BLOCK_M"]))  # noqa: E731
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # launch on the tensors' device
        _attention_output_kernel[grid](
            q, k, v, out, lse,
            *q.stride(), *k.stride(), *v.stride(),
            problem.scaling, problem.softcap or 1.0, problem.window or 0,
            Hq, Hq // Hkv, S,
            **specialisation(
                head_dim=D, head_dim_v=Dv, window=problem.window is not None, softcap=problem.softcap is not None,
                float32=q.dtype == torch.float32,
            ),
        )  # fmt: skip
    out, lse = fold_sinks_into_output(out.to(problem.q.dtype), lse, problem.sinks)
    return AttentionOutput(out, lse, "triton")
