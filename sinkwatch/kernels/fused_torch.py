"""The fused pass on the PyTorch path: the attention output and every row's lse from one pass over the keys.

A probe forward needs the attention output (the model's next block reads it) and the statistics;
both come from the same logits. Two routes, both exact softmax:

- **flash**: causal attention without soft-capping or a sliding window (Llama, GPT-NeoX, Qwen2,
  OLMo...) on CPU runs PyTorch's own fused CPU kernel, ``aten._scaled_dot_product_flash_attention_for_cpu``
  — the kernel ``F.scaled_dot_product_attention`` dispatches to there, so a float32 model's output
  is the one its sdpa attention computes — which also returns each row's log-sum-exp. 16-bit
  inputs go through it in float32: on 16-bit inputs it rounds the logits to 16 bits (lse off by
  4e-5 on a float16 case, 20 times the statistics' tolerance).
- **chunked**: everything else (soft-caps, sliding windows, a head dim of v unlike q's, CUDA
  tensors): blocks of (sequences x query rows), each row's whole softmax at once in float32
  (float64 for float64 inputs), keys outside the causal crop and the window never touched, GQA by
  viewing a kv head's query heads as extra rows. Blocks follow ``torch_chunked.block_budget``.

A learned sink joins afterwards, exactly (``contract.fold_sinks_into_output``).
"""

from __future__ import annotations

import torch

from .contract import AttentionOutput, StatsProblem, fold_sinks_into_output
from .torch_chunked import block_budget, block_sizes

_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _flash_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def flash_applies(problem: StatsProblem, v: torch.Tensor) -> bool:
    """Whether PyTorch's fused CPU kernel computes this problem: causal only (a window wider than
    the sequence masks nothing), no soft-cap, v's head dim equal to q's."""
    _, _, _, S, D, _, _ = problem.shape
    return (
        problem.q.device.type == "cpu"
        and problem.softcap is None
        and (problem.window is None or problem.window >= S)
        and v.shape[-1] == D
        and problem.q.dtype in _FLASH_DTYPES
        and _flash_op() is not None
    )


def attention_output_torch(problem: StatsProblem, v: torch.Tensor, block_elements: int | None = None) -> AttentionOutput:
    with torch.no_grad(), torch.autocast(device_type=problem.q.device.type, enabled=False):
        if flash_applies(problem, v):
            compute = torch.float64 if v.dtype == torch.float64 else torch.float32
            q, k, v_ = (_unit_last_stride(x.to(compute)) for x in (problem.q, problem.k, v))
            out, lse = _flash_op()(q, k, v_, 0.0, True, scale=problem.scaling)  # GQA natively
            out, lse = out.to(v.dtype), lse.float()
        else:
            out, lse = _chunked(problem, v, block_elements or block_budget(problem.q))
        out, lse = fold_sinks_into_output(out, lse, problem.sinks)
    return AttentionOutput(out, lse, "torch")


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    # the kernel reads each head dim as contiguous memory (F.scaled_dot_product_attention checks this
    # before dispatching to it; called directly it returns garbage for a strided head dim)
    return x if x.stride(-1) == 1 else x.contiguous()


def _chunked(problem: StatsProblem, v: torch.Tensor, block_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = problem.q, problem.k
    B, Hq, Hkv, S, D, _, _ = problem.shape
    groups, Dv = Hq // Hkv, v.shape[-1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty(B, Hq, S, Dv, dtype=v.dtype, device=q.device)
    lse_out = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    window = problem.window
    seq_block, row_block = block_sizes(B, Hq, S, S if window is None else min(S, window + S), block_elements)
    index = torch.arange(S, device=q.device)
    for b0 in range(0, B, seq_block):
        b1 = min(B, b0 + seq_block)
        nb = b1 - b0
        for r0 in range(0, S, row_block):
            r1 = min(S, r0 + row_block)
            nq = r1 - r0
            lo = 0 if window is None else max(0, r0 - window + 1)  # keys r0 .. r1-1 see; causal crop at r1
            qc = q[b0:b1, :, r0:r1].to(compute).reshape(nb, Hkv, groups * nq, D)
            logits = torch.matmul(qc, k[b0:b1, :, lo:r1].to(compute).transpose(-1, -2))  # (nb, Hkv, groups*nq, r1-lo)
            logits = logits.view(nb, Hq, nq, r1 - lo).mul_(problem.scaling)
            if problem.softcap is not None:
                logits = logits.div_(problem.softcap).tanh_().mul_(problem.softcap)
            pos, keys = index[r0:r1, None], index[None, lo:r1]
            allowed = keys <= pos
            if window is not None:
                allowed &= (pos - keys) < window
            logits.masked_fill_(~allowed, float("-inf"))
            m = logits.amax(dim=-1, keepdim=True)  # finite: every row sees its own key
            p = logits.sub_(m).exp_()  # in place: (nb, Hq, nq, keys)
            total = p.sum(dim=-1, keepdim=True)
            pv = torch.matmul(p.view(nb, Hkv, groups * nq, r1 - lo), v[b0:b1, :, lo:r1].to(compute))
            out[b0:b1, :, r0:r1] = (pv.view(nb, Hq, nq, Dv) / total).to(v.dtype)
            lse_out[b0:b1, :, r0:r1] = (m + total.log()).squeeze(-1).float()
    return out, lse_out
