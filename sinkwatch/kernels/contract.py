"""The contract every ``attention_stats`` backend shares (docs/design.md §4): argument validation, the
normalised problem, and the output tuple. Backends import this module, never the dispatcher.

    q: (B, Hq, S, D)   post-RoPE queries, any strides, float32/float16/bfloat16/float64
    k: (B, Hkv, S, D)  keys NOT repeated for GQA: q-head h reads kv-head h // (Hq // Hkv)
    rows: (B, Q) int   query positions (None = all S rows, Q = S)
    cols: (B, Q, G) int  key positions to report, -1 = none
    sinks: (Hq,) float   learnable sink logits (gpt-oss ``s_aux``, OLMo-core ``attention_sinks``), or None

Attention is causal; a key j is also masked for query i when i - j >= window (sliding-window
layers); logits are scaled by ``scaling`` and then soft-capped as softcap * tanh(s / softcap).
A learned sink is one more softmax column per row, holding ``sinks[h]`` as it is (neither scaled
nor capped, as gpt-oss and OLMo-core add it) and no value: it joins every denominator.

Returns float32 tensors, never an S x S matrix:
    lse      (B, Hq, Q)            natural-log log-sum-exp of the scaled, masked logits (and the sink)
    entropy  (B, Hq, Q)            attention entropy in nats (over the keys and the sink)
    first    (B, Hq, Q, n_first)   probability on keys 0..n_first-1 (0 where key > query or key >= S)
    gathered (B, Hq, Q, G)         probability on cols (0 where col is -1 or col > query)
The sink's own probability is exp(sinks[h] - lse).

The fused pass (``attention_output``) takes the same arguments plus v (B, Hkv, S, Dv), also not
repeated, and returns the attention output (B, Hq, S, Dv) in v's dtype with every row's lse
(B, Hq, S) float32 (the sink included): the one pass over the keys a forward needs, from which
``attention_stats(..., fused=...)`` reads ``first``, ``gathered`` and ``lse`` without another.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class AttentionStats(NamedTuple):
    lse: torch.Tensor  # (B, Hq, Q)
    entropy: torch.Tensor  # (B, Hq, Q)
    first: torch.Tensor  # (B, Hq, Q, n_first)
    gathered: torch.Tensor  # (B, Hq, Q, G)


class AttentionOutput(NamedTuple):
    """What the fused pass returns; ``backend`` names the one that computed it ("torch", "triton",
    "reference"), so statistics read off its lse can say which backend made them."""

    output: torch.Tensor  # (B, Hq, S, Dv) in v's dtype
    lse: torch.Tensor  # (B, Hq, S) float32, the learned sink included
    backend: str


class StatsProblem(NamedTuple):
    """Validated arguments, shared by every backend."""

    q: torch.Tensor
    k: torch.Tensor
    scaling: float
    rows: torch.Tensor | None  # (B, Q) int64 on q.device, or None for all rows
    cols: torch.Tensor | None  # (B, Q, G) int64 on q.device, or None
    n_first: int
    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None = None  # (Hq,) on q.device, or None

    @property
    def shape(self) -> tuple[int, int, int, int, int, int, int]:
        """(B, Hq, Hkv, S, D, Q, G)."""
        B, Hq, S, D = self.q.shape
        Q = S if self.rows is None else self.rows.shape[1]
        G = 0 if self.cols is None else self.cols.shape[2]
        return B, Hq, self.k.shape[1], S, D, Q, G

    def query_positions(self) -> torch.Tensor:
        """(B, Q) int64 position of every query row."""
        B, _, _, S, _, _, _ = self.shape
        if self.rows is not None:
            return self.rows
        return torch.arange(S, device=self.q.device).expand(B, S)


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _index_tensor(x, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
        raise TypeError(f"{name} must hold integer positions, got dtype {x.dtype}")
    return x.to(device=device, dtype=torch.int64)


def validate(q, k, scaling, rows=None, cols=None, n_first=8, window=None, softcap=None, sinks=None) -> StatsProblem:
    """Check every argument of ``attention_stats`` and return them normalised."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({'B, Hq' if name == 'q' else 'B, Hkv'}, S, D); got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32/float16/bfloat16/float64, got {t.dtype}")
    B, Hq, S, D = q.shape
    Bk, Hkv, Sk, Dk = k.shape
    if (Bk, Sk, Dk) != (B, S, D):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, sequence length and head dim "
            "(pass k before repeat_kv: (B, Hkv, S, D))"
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for GQA")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}; put both on one device")
    if isinstance(scaling, torch.Tensor):
        scaling = float(scaling)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not math.isfinite(scaling):
        raise TypeError(f"scaling must be a finite float (the layer's own softmax scale), got {scaling!r}")
    if not isinstance(n_first, int) or isinstance(n_first, bool) or n_first < 0:
        raise ValueError(f"n_first must be a non-negative int, got {n_first!r}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be None or a positive int (keys with i - j >= window are masked), got {window!r}")
    if softcap is not None:
        softcap = float(softcap)
        if not softcap > 0 or not math.isfinite(softcap):
            raise ValueError(f"softcap must be None or a positive float, got {softcap!r}")

    if rows is not None:
        rows = _index_tensor(rows, "rows", q.device)
        if rows.dim() != 2 or rows.shape[0] != B:
            raise ValueError(f"rows must be (B, Q) = ({B}, Q); got shape {tuple(rows.shape)}")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= S):
            raise ValueError(f"rows must be query positions in [0, {S}); got values in [{int(rows.min())}, {int(rows.max())}]")
    Q = S if rows is None else rows.shape[1]
    if cols is not None:
        cols = _index_tensor(cols, "cols", q.device)
        if cols.dim() != 3 or cols.shape[:2] != (B, Q):
            raise ValueError(f"cols must be (B, Q, G) = ({B}, {Q}, G); got shape {tuple(cols.shape)}")
        if cols.numel() and (int(cols.min()) < -1 or int(cols.max()) >= S):
            raise ValueError(f"cols must be key positions in [0, {S}) or -1 for none; got values in [{int(cols.min())}, {int(cols.max())}]")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks must be a float torch.Tensor of sink logits, one per query head; got {type(sinks).__name__}")
        if sinks.shape != (Hq,):
            raise ValueError(f"sinks must hold one logit per query head: shape ({Hq},); got {tuple(sinks.shape)}")
        sinks = sinks.detach().to(q.device)
    return StatsProblem(q, k, float(scaling), rows, cols, n_first, window, softcap, sinks)


def validate_value(problem: StatsProblem, v) -> torch.Tensor:
    """Check the fused pass's values against a validated problem: (B, Hkv, S, Dv), q's dtype and device."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"v must be a torch.Tensor, got {type(v).__name__}")
    B, _, Hkv, S, _, _, _ = problem.shape
    if v.dim() != 4 or v.shape[:3] != (B, Hkv, S):
        raise ValueError(f"v must be (B, Hkv, S, Dv) = ({B}, {Hkv}, {S}, Dv) like k (not repeated for GQA); got {tuple(v.shape)}")
    if v.dtype != problem.q.dtype or v.device != problem.q.device:
        raise ValueError(f"v ({v.dtype}, {v.device}) must have q's dtype and device ({problem.q.dtype}, {problem.q.device})")
    if problem.rows is not None:
        raise ValueError("the fused pass computes every row (the attention output needs them all): pass rows=None")
    return v


def fold_sinks_into_output(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A learned sink joins every softmax row but carries no value: the keys keep r = exp(lse - lse')
    of each row's mass, so the output scales by r and the lse widens to lse' = logaddexp(lse, s).
    out (B, Hq, S, Dv), lse (B, Hq, S) float32 over the keys alone; returns both with the sink."""
    if sinks is None:
        return out, lse
    s = sinks.to(device=lse.device, dtype=torch.float32)[None, :, None]  # (1, Hq, 1)
    widened = torch.logaddexp(lse, s)
    r = (lse - widened).exp()  # (B, Hq, S)
    return (out.to(torch.promote_types(out.dtype, torch.float32)) * r[..., None]).to(out.dtype), widened


def empty_outputs(problem: StatsProblem) -> AttentionStats:
    """Output buffers pre-filled with NaN: a backend that skips a cell leaves NaN behind."""
    B, Hq, _, _, _, Q, G = problem.shape
    kw = dict(device=problem.q.device, dtype=torch.float32)
    return AttentionStats(
        lse=torch.full((B, Hq, Q), float("nan"), **kw),
        entropy=torch.full((B, Hq, Q), float("nan"), **kw),
        first=torch.full((B, Hq, Q, problem.n_first), float("nan"), **kw),
        gathered=torch.full((B, Hq, Q, G), float("nan"), **kw),
    )


def fold_sinks(stats: AttentionStats, problem: StatsProblem) -> AttentionStats:
    """Add the learned sink column to statistics computed over the keys alone (no-op without sinks).

    Exact, per row, through the log-sum-exp: with s the sink logit, lse' = logaddexp(lse, s); the
    keys keep r = exp(lse - lse') of the mass and the sink takes q = exp(s - lse') = 1 - r, so every
    key probability becomes p * r and the entropy of the widened row is
        H' = -sum_j r p_j log(r p_j) - q log q = r (H - log r) - q log q,
    with log r = lse - lse' and log q = s - lse' taken from the logits (no log of a tiny r or q).
    The fast backends call this on their float32 outputs; the float64 reference does not (it
    materialises the sink column), so the tests compare two independent computations.
    """
    if problem.sinks is None:
        return stats
    s = problem.sinks.to(device=stats.lse.device, dtype=torch.float32)[None, :, None]  # (1, Hq, 1)
    lse = torch.logaddexp(stats.lse, s)  # (B, Hq, Q)
    log_r, log_q = stats.lse - lse, s - lse
    r, q = log_r.exp(), log_q.exp()
    sink_term = torch.where(q > 0, q * log_q, torch.zeros_like(q))  # a sink of -inf takes nothing
    entropy = r * (stats.entropy - log_r) - sink_term
    return AttentionStats(lse, entropy, stats.first * r[..., None], stats.gathered * r[..., None])
