"""Triton backend of ``attention_stats`` (the GPU path of docs/design.md §4).

One program handles BLOCK_M query rows of one (sequence, q-head):

    pass 1  online softmax over key blocks 0 .. max(row)  (blocks above the causal diagonal and
            left of a sliding window are never visited): running max m, sum l = sum e^(s-m) and
            t = sum e^(s-m) * s; then lse = m + log l and entropy = lse - t / l
    pass 2  probabilities on keys 0..n_first-1:  exp(s - lse)
    pass 3  probabilities on the gathered columns, one column per step: exp(q . k_col * scale - lse)

Learned sink logits are folded in after the launch, exactly, through each row's lse
(``contract.fold_sinks``): the kernel itself only ever sees keys.

GQA by index (q-head h reads kv-head h // groups; k is never repeated), arbitrary strides,
float32/float16/bfloat16 inputs with float32 accumulation. A subset of rows costs O(S) per row.
16-bit inputs hold q and use the tensor-core product; float32 inputs take the exact FMA product in
32-wide chunks of the head dim (``specialisation``), since the whole tile does not fit in registers.

Testing on CPU, two ways (docs/kernels.md): set ``TRITON_INTERPRET=1`` before this module is
imported to run its semantics (loads cast to float32 — the interpreter's bf16 dot is wrong — and
one small config); ``triton_aot`` compiles it for sm_90/sm_80 and reads registers, spills and
shared memory.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from .contract import AttentionStats, StatsProblem, empty_outputs, fold_sinks

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# finite "minus infinity": keeps exp(m_old - m_new) well defined before any valid key. A constexpr:
# the GPU compiler rejects a kernel reading a plain global (the interpreter does not)
_NEG = tl.constexpr(-1.0e30)


def _configs(interpret: bool = _INTERPRET):
    if interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in [
            (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3),
            (64, 128, 8, 2), (32, 64, 4, 3), (16, 64, 4, 2), (16, 32, 2, 2),
        ]
    ]  # fmt: skip


def configs_for(configs, *, float32: bool, n_rows: int | None = None):
    """The autotune configs worth compiling and timing for one launch.

    float32: the product runs on FMA units with its operands in registers; compiled for sm_90, key
    blocks of 64 or more beside 32+ rows spill (0.6-0.8 KiB per thread at head dim >= 128, see
    ``python -m sinkwatch.kernels.triton_aot --dtypes fp32``), so float32 keeps the narrower tiles.
    ``n_rows`` (query rows per sequence and head): a row block taller than the rows there are only
    computes padding — the paper's protocol probes one row, where BLOCK_M = 128 would waste 127/128
    of the work — so blocks stop at the next power of two (16 at least, the product's minimum).
    """
    keep = list(configs)
    if float32:
        keep = [c for c in keep if c.kwargs["BLOCK_N"] <= 32 or c.kwargs["BLOCK_M"] <= 16]
    if n_rows is not None:
        tallest = _pow2_at_least_16(int(n_rows))
        keep = [c for c in keep if c.kwargs["BLOCK_M"] <= tallest]
    return keep or list(configs)


def _prune(configs, named_args, **kwargs):
    return configs_for(configs, float32=named_args["q_ptr"].dtype == torch.float32, n_rows=named_args["Q_LEN"])


@triton.jit
def _softcap(s, softcap):
    # softcap * tanh(s / softcap), tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|): never overflows
    e = tl.exp(-2.0 * tl.abs(s) / softcap)
    t = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(s < 0, -t, t)


@triton.jit
def _dot_f32(a, b_t, CAST_F32: tl.constexpr):
    """a @ b_t.T accumulated in float32; float32 (or interpreter-cast) operands use the exact FMA product."""
    if CAST_F32:
        return tl.dot(a.to(tl.float32), tl.trans(b_t.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(b_t))


@triton.jit
def _tile_scores(q, q_rows, q_ok, sq_d, k_base, offs_n, pos, sk_s, sk_d, n_keys, scaling, softcap, window,
                 BLOCK_M: tl.constexpr, N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAST_F32: tl.constexpr):  # fmt: skip
    """Scaled (soft-capped) logits of the row block against keys ``offs_n`` (N of them) and their mask.

    BLOCK_DK == BLOCK_D: q is the (BLOCK_M, BLOCK_D) row block, held by the caller across key
    blocks. BLOCK_DK < BLOCK_D: q is unused and the rows are re-read from ``q_rows`` (BLOCK_M row
    pointers) in BLOCK_DK-wide chunks: the float32 FMA product of a whole row block against a whole
    key block does not fit in registers. Keys at or beyond ``n_keys`` read as zero and are masked.
    Returns s (BLOCK_M, N) float32 and valid (BLOCK_M, N) bool.
    """
    n_ok = offs_n < n_keys
    if BLOCK_DK == BLOCK_D:
        offs_d = tl.arange(0, BLOCK_D)
        k = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :] * sk_d, mask=n_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        s = _dot_f32(q, k, CAST_F32)
    else:
        s = tl.zeros([BLOCK_M, N], tl.float32)
        for d0 in tl.static_range(0, BLOCK_D, BLOCK_DK):
            offs_d = d0 + tl.arange(0, BLOCK_DK)
            d_ok = offs_d < HEAD_DIM
            qc = tl.load(q_rows[:, None] + offs_d[None, :] * sq_d, mask=q_ok[:, None] & d_ok[None, :], other=0.0)
            kc = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :] * sk_d, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s += _dot_f32(qc, kc, CAST_F32)
    s = s * scaling
    if HAS_SOFTCAP:
        s = _softcap(s, softcap)
    valid = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
    if HAS_WINDOW:
        valid = valid & ((pos[:, None] - offs_n[None, :]) < window)
    return s, valid


@triton.autotune(
    configs=_configs(), key=["Q_LEN", "SEQ", "HEAD_DIM", "HAS_ROWS", "CAST_F32"], prune_configs_by={"early_config_prune": _prune}
)
@triton.jit
def _attention_stats_kernel(
    q_ptr, k_ptr, rows_ptr, cols_ptr,
    lse_ptr, ent_ptr, first_ptr, gath_ptr,
    sq_b, sq_h, sq_s, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sr_b, sr_q,
    sc_b, sc_q, sc_g,
    scaling, softcap, window,
    N_Q_HEADS, GROUPS, SEQ, Q_LEN, N_FIRST, N_GATHER,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DG: tl.constexpr, BLOCK_F: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAST_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)  # (sequence, q-head) on grid axis 0: axes 1 and 2 stop at 65535
    pid_m = tl.program_id(1)
    b = (pid_bh // N_Q_HEADS).to(tl.int64)  # b * stride passes 2^31 for large batches of strided views
    h = pid_bh % N_Q_HEADS
    kvh = h // GROUPS

    qi = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index in [0, Q)
    q_ok = qi < Q_LEN
    if HAS_ROWS:
        pos = tl.load(rows_ptr + b * sr_b + qi * sr_q, mask=q_ok, other=0)
    else:
        pos = qi
    q_rows = q_ptr + b * sq_b + h * sq_h + pos * sq_s  # (BLOCK_M,) pointers to each row's q
    k_base = k_ptr + b * sk_b + kvh * sk_h
    if BLOCK_DK == BLOCK_D:  # hold the row block in registers across all key blocks
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(q_rows[:, None] + offs_d[None, :] * sq_d, mask=q_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    else:  # _tile_scores re-reads it in chunks
        q = q_rows

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    t_i = tl.zeros([BLOCK_M], tl.float32)

    # causal crop: no row of this block sees keys beyond its largest position
    hi = tl.max(tl.where(q_ok, pos, 0)) + 1
    lo = 0
    if HAS_WINDOW:
        lo_pos = tl.min(tl.where(q_ok, pos, SEQ)) - window + 1
        lo = tl.maximum(lo_pos, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s, valid = _tile_scores(  # by keyword: 21 positional arguments are easy to swap
            q=q, q_rows=q_rows, q_ok=q_ok, sq_d=sq_d, k_base=k_base, offs_n=offs_n, pos=pos, sk_s=sk_s, sk_d=sk_d,
            n_keys=SEQ, scaling=scaling, softcap=softcap, window=window, BLOCK_M=BLOCK_M, N=BLOCK_N, HEAD_DIM=HEAD_DIM,
            BLOCK_D=BLOCK_D, BLOCK_DK=BLOCK_DK, HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP, CAST_F32=CAST_F32,
        )
        s = tl.where(valid, s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(valid, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        t_i = t_i * alpha + tl.sum(p * tl.where(valid, s, 0.0), axis=1)
        m_i = m_new

    l_safe = tl.where(q_ok, l_i, 1.0)  # padding rows of the block saw no key
    lse = m_i + tl.log(l_safe)
    entropy = lse - t_i / l_safe
    out_row = pid_bh.to(tl.int64) * Q_LEN + qi  # outputs are contiguous (B, Hq, Q, ...)
    tl.store(lse_ptr + out_row, lse, mask=q_ok)
    tl.store(ent_ptr + out_row, entropy, mask=q_ok)

    # probabilities on keys 0 .. N_FIRST-1
    if BLOCK_F > 0:
        offs_f = tl.arange(0, BLOCK_F)
        sf, ok = _tile_scores(  # by keyword: 21 positional arguments are easy to swap
            q=q, q_rows=q_rows, q_ok=q_ok, sq_d=sq_d, k_base=k_base, offs_n=offs_f, pos=pos, sk_s=sk_s, sk_d=sk_d,
            n_keys=tl.minimum(SEQ, N_FIRST), scaling=scaling, softcap=softcap, window=window, BLOCK_M=BLOCK_M,
            N=BLOCK_F, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_DK=BLOCK_DK, HAS_WINDOW=HAS_WINDOW,
            HAS_SOFTCAP=HAS_SOFTCAP, CAST_F32=CAST_F32,
        )
        pf = tl.exp(tl.where(ok, sf - lse[:, None], _NEG))  # masked keys: exp(-1e30) = 0, no overflow
        tl.store(first_ptr + out_row[:, None] * N_FIRST + offs_f[None, :], pf, mask=q_ok[:, None] & (offs_f[None, :] < N_FIRST))

    # probabilities on gathered columns, one column per step (each row reads its own key). q is
    # re-read in D chunks: holding a float32 copy of the whole (BLOCK_M, BLOCK_D) tile beside the
    # gathered keys spills registers at head dim >= 128.
    for g in range(0, N_GATHER):
        col = tl.load(cols_ptr + b * sc_b + qi * sc_q + g * sc_g, mask=q_ok, other=-1)
        use = q_ok & (col >= 0) & (col <= pos)
        if HAS_WINDOW:
            use = use & ((pos - col) < window)
        sg = tl.zeros([BLOCK_M], tl.float32)
        for d0 in tl.static_range(0, BLOCK_D, BLOCK_DG):
            offs_g = d0 + tl.arange(0, BLOCK_DG)
            g_ok = use[:, None] & (offs_g < HEAD_DIM)[None, :]
            qg = tl.load(q_rows[:, None] + offs_g[None, :] * sq_d, mask=g_ok, other=0.0).to(tl.float32)
            kg = tl.load(k_base + col[:, None] * sk_s + offs_g[None, :] * sk_d, mask=g_ok, other=0.0).to(tl.float32)
            sg += tl.sum(qg * kg, axis=1)
        sg = sg * scaling
        if HAS_SOFTCAP:
            sg = _softcap(sg, softcap)
        pg = tl.exp(tl.where(use, sg - lse, _NEG))
        tl.store(gath_ptr + out_row * N_GATHER + g, pg, mask=q_ok)


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))


def specialisation(
    *, head_dim: int, n_first: int, rows: bool, window: bool, softcap: bool, float32: bool, interpret: bool = _INTERPRET
) -> dict:
    """The constexpr arguments of one launch (shared with the ahead-of-time compile check).

    float32 inputs take the exact FMA product in 32-wide chunks of the head dim (the whole-tile
    FMA product spills, see ``triton_aot``); 16-bit inputs hold q and use the tensor-core product.
    The interpreter casts every load to float32 (its bfloat16 product is wrong) but keeps the
    chunking choice, so interpreter tests cover both paths.
    """
    block_d = _pow2_at_least_16(head_dim)  # tl.dot needs every dimension >= 16
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_DK=min(block_d, 32) if float32 else block_d, BLOCK_DG=min(block_d, 32),
        BLOCK_F=0 if n_first == 0 else _pow2_at_least_16(n_first),
        HAS_ROWS=rows, HAS_WINDOW=window, HAS_SOFTCAP=softcap, CAST_F32=interpret or float32,
    )  # fmt: skip


def attention_stats_triton(problem: StatsProblem) -> AttentionStats:
    q, k = problem.q, problem.k
    B, Hq, Hkv, S, D, Q, G = problem.shape
    # CPU tensors without TRITON_INTERPRET=1: Triton's launcher raises (no driver, or a CPU pointer)
    # and ``attention_stats`` falls back to the torch path after one warning
    if q.dtype == torch.float64:
        q, k = q.float(), k.float()
    out = empty_outputs(problem)
    dummy = torch.zeros(1, 1, 1, dtype=torch.int64, device=q.device)
    rows = problem.rows if problem.rows is not None else dummy[0]
    cols = problem.cols if problem.cols is not None else dummy
    grid = lambda meta: (B * Hq, triton.cdiv(Q, meta["BLOCK_M"]))  # noqa: E731
    # Triton launches on the *current* CUDA device: without the guard, tensors on cuda:1 would be
    # read through device-0 pointers (``sinkwatch probe --device cuda:1``, one process per GPU)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _attention_stats_kernel[grid](
            q, k, rows, cols,
            out.lse, out.entropy, out.first, out.gathered,
            *q.stride(), *k.stride(),
            rows.stride(0), rows.stride(1),
            cols.stride(0), cols.stride(1), cols.stride(2),
            problem.scaling, problem.softcap or 1.0, problem.window or 0,
            Hq, Hq // Hkv, S, Q, problem.n_first, G,
            **specialisation(
                head_dim=D, n_first=problem.n_first, rows=problem.rows is not None,
                window=problem.window is not None, softcap=problem.softcap is not None, float32=q.dtype == torch.float32,
            ),
        )  # fmt: skip
    return fold_sinks(out, problem)  # learned sinks: exact, through each row's lse (no kernel change)
