"""Float64 reference for ``attention_stats``: materialises the full attention matrix.

Written to be obviously right, not fast: repeat k over GQA groups, build the (B, Hq, S, S)
probability matrix in float64 with an explicit mask (and the learned sink as an explicit extra
column), then read every statistic off it.
Used by the tests as the ground truth for the PyTorch and Triton backends; unlike the other
backends it returns float64, so a comparison sees the fast path's own rounding only.
"""

from __future__ import annotations

import torch

from .contract import AttentionOutput, AttentionStats, StatsProblem


def _logits(problem: StatsProblem) -> torch.Tensor:
    """(B, Hq, S, S [+ 1]) float64 logits: scaled, soft-capped, masked, the sink column last."""
    q, k = problem.q.double(), problem.k.double()
    B, Hq, Hkv, S, D, Q, G = problem.shape
    k = k.repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, S, D)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * problem.scaling  # (B, Hq, S, S)
    if problem.softcap is not None:
        logits = problem.softcap * torch.tanh(logits / problem.softcap)
    i = torch.arange(S, device=q.device)[:, None]
    j = torch.arange(S, device=q.device)[None, :]
    allowed = j <= i
    if problem.window is not None:
        allowed = allowed & (i - j < problem.window)
    logits = logits.masked_fill(~allowed, float("-inf"))
    if problem.sinks is not None:  # the learned sink: one more column in every row, logit as given
        sink = problem.sinks.double().view(1, Hq, 1, 1).expand(B, Hq, S, 1)
        logits = torch.cat([logits, sink], dim=-1)  # (B, Hq, S, S + 1)
    return logits


def attention_output_reference(problem: StatsProblem, v: torch.Tensor) -> AttentionOutput:
    """The attention output (B, Hq, S, Dv) and lse in float64, from the materialised softmax; the
    sink's column carries no value."""
    B, Hq, Hkv, S, D, Q, G = problem.shape
    logits = _logits(problem)
    probs = torch.softmax(logits, dim=-1)[..., :S]  # (B, Hq, S, S): the sink's share dropped after the softmax
    out = probs @ v.double().repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, S, Dv)
    return AttentionOutput(out, torch.logsumexp(logits, dim=-1), "reference")


def attention_stats_reference(problem: StatsProblem) -> AttentionStats:
    B, Hq, Hkv, S, D, Q, G = problem.shape
    q = problem.q
    logits = _logits(problem)
    lse = torch.logsumexp(logits, dim=-1)  # (B, Hq, S)
    probs = torch.softmax(logits, dim=-1)  # (B, Hq, S, S [+ 1])
    entropy = -torch.where(probs > 0, probs * probs.log(), torch.zeros_like(probs)).sum(-1)

    positions = problem.query_positions()  # (B, Q)
    row_index = positions[:, None, :].expand(B, Hq, Q)
    lse = lse.gather(2, row_index)
    entropy = entropy.gather(2, row_index)
    probs = probs[..., :S]  # the keys' probabilities (the sink column, if any, dropped after the entropy)
    probs = probs.gather(2, row_index[..., None].expand(B, Hq, Q, S))  # (B, Hq, Q, S)

    first = torch.zeros(B, Hq, Q, problem.n_first, dtype=torch.float64, device=q.device)
    n = min(problem.n_first, S)
    first[..., :n] = probs[..., :n]

    if problem.cols is None:
        gathered = torch.zeros(B, Hq, Q, 0, dtype=torch.float64, device=q.device)
    else:
        cols = problem.cols[:, None].expand(B, Hq, Q, G)
        gathered = probs.gather(3, cols.clamp(min=0))
        invalid = (cols < 0) | (cols > positions[:, None, :, None])
        gathered = gathered.masked_fill(invalid, 0.0)
    return AttentionStats(lse, entropy, first, gathered)
