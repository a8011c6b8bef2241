"""Statistics read off every row's lse, once the fused pass has computed it (any device).

With lse_i known (the learned sink included), a probability needs one logit, not a pass over the
row: p_ij = exp(s_ij - lse_i). So the first keys of every row cost (rows x n_first) dot products
and the gathered columns (rows x G): O(Q (n_first + G) D) instead of a second QK^T. The entropy
is a sum over the whole row and is not read here (``api.attention_stats`` computes it for the
chosen rows when asked).

Logits are float32 dot products (float64 for float64 inputs): on CPU one matmul for the first keys
(exact float32 FMA products); on CUDA elementwise products summed, never a matmul, so a run with
TF32 matmuls enabled still reads exact float32 logits.
"""

from __future__ import annotations

import torch

from .contract import AttentionStats, StatsProblem, empty_outputs


def stats_from_lse(problem: StatsProblem, lse: torch.Tensor) -> AttentionStats:
    """lse (B, Hq, S) float32 of every row (the fused pass's); entropy left NaN."""
    q, k = problem.q, problem.k
    B, Hq, Hkv, S, D, Q, G = problem.shape
    groups = Hq // Hkv
    out = empty_outputs(problem)
    pos = problem.query_positions()  # (B, Q)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        if problem.rows is None:
            qr, row_lse = q, lse
        else:
            qr = q.gather(2, pos[:, None, :, None].expand(B, Hq, Q, D))  # (B, Hq, Q, D)
            row_lse = lse.gather(2, pos[:, None, :].expand(B, Hq, Q))
        out.lse.copy_(row_lse)
        qr = qr.to(compute).reshape(B, Hkv, groups, Q, 1, D)  # a view where q's heads are evenly strided

        n = min(problem.n_first, S)
        if n:
            keys = torch.arange(n, device=q.device).expand(B, Q, n)
            out.first[..., :n] = _probability(problem, _first_logits(qr, k[:, :, :n].to(compute)), row_lse, pos, keys)
        out.first[..., n:] = 0.0  # keys beyond the sequence
        step = max(1, S // max(Q, 1))  # columns per slab: its (Q x step) products hold no more than q does
        for g0 in range(0, G, step):
            cols = problem.cols[:, :, g0 : g0 + step]  # (B, Q, g)
            out.gathered[..., g0 : g0 + step] = _probability(problem, _column_logits(qr, k, cols, compute), row_lse, pos, cols)
    return out


def _first_logits(qr: torch.Tensor, kf: torch.Tensor) -> torch.Tensor:
    """Raw dot products (B, Hq, Q, n) of the rows qr (B, Hkv, groups, Q, 1, D) with the first keys kf (B, Hkv, n, D)."""
    B, Hkv, groups, Q, _, D = qr.shape
    n = kf.shape[2]
    if qr.device.type == "cpu":  # one (groups*Q, D) x (D, n) product per kv head
        return torch.matmul(qr.reshape(B, Hkv, groups * Q, D), kf.transpose(-1, -2)).reshape(B, Hkv * groups, Q, n)
    # one key at a time: a (B, Hq, Q) slab, never (Q, n, D) products at once
    return torch.stack([(qr * kf[:, :, j].reshape(B, Hkv, 1, 1, 1, D)).sum(-1).reshape(B, Hkv * groups, Q) for j in range(n)], dim=-1)


def _column_logits(qr: torch.Tensor, k: torch.Tensor, cols: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """Raw dot products (B, Hq, Q, g) of each row with its own keys ``cols`` (B, Q, g) (-1 reads key 0, masked later)."""
    B, Hkv, groups, Q, _, D = qr.shape
    g = cols.shape[-1]
    index = cols.clamp(min=0).reshape(B, 1, Q * g, 1).expand(B, Hkv, Q * g, D)
    kc = k.gather(2, index).to(compute).reshape(B, Hkv, 1, Q, g, D)
    return (qr * kc).sum(-1).reshape(B, Hkv * groups, Q, g)


def _probability(problem: StatsProblem, s: torch.Tensor, lse: torch.Tensor, pos: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """exp(logit - lse) (B, Hq, Q, K) float32 for key positions ``key`` (B, Q, K) of rows at ``pos``
    (B, Q); 0 where the key is none (-1), after the row, or outside its window. s: raw dot products."""
    s = s * problem.scaling
    if problem.softcap is not None:
        s = problem.softcap * torch.tanh(s / problem.softcap)
    pos = pos[..., None]  # (B, Q, 1)
    invalid = (key < 0) | (key > pos)
    if problem.window is not None:
        invalid |= (pos - key) >= problem.window
    return (s - lse[..., None]).exp().float().masked_fill_(invalid[:, None], 0.0)
