"""What a probe forward collects, as small composable parts (one per statistic family).

A ``ProbeCollector`` implements capture's ``Collector`` protocol by fanning each call out to its
parts. Parts reduce every micro-batch at once (per sequence, per head) and keep only the reduced
arrays on the CPU, so a 2000-sequence probe never holds more than one micro-batch of activations.

Attention-derived results keep every block's index: a block without softmax attention (hybrid
stacks) gets NaN there, and ``ProbeCollector.softmax_layers`` says which blocks ran softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import metrics
from ..capture.sublayers import SUBLAYER_KINDS
from ..kernels import AttentionOutput, attention_stats


def eager_half_rows(query, key, scaling, rows, cols, *, window=None, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention probabilities of chosen rows rounded the way eager half-precision attention rounds
    them (transformers' ``eager_attention_forward``): QK^T in the model's dtype, times ``scaling`` in
    that dtype, softmax in float32, cast back to the model's dtype. Only the chosen rows are
    materialised: (B, H, Q, S) — for the paper's one query row per sequence that is one row per head.

    query (B, H, S, D), key (B, Hkv, S, D), rows (B, Q), cols (B, Q, G). Returns the gathered
    probabilities (B, H, Q, G) and each row's entropy (B, H, Q), both float32.
    """
    B, H, S, D = query.shape
    if key.shape[1] != H:  # grouped-query attention: eager repeats each KV head for its query group
        key = key.repeat_interleave(H // key.shape[1], dim=1)
    q = query.gather(2, rows[:, None, :, None].expand(B, H, rows.shape[1], D))  # (B, H, Q, D)
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling  # (B, H, Q, S) in the model's dtype, as eager
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    j = torch.arange(S, device=query.device)
    i = rows[:, None, :, None]  # (B, 1, Q, 1)
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    # eager adds the dtype's most negative value; both give exactly 0 after the float32 softmax
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # (B, H, Q, S)
    gathered = probs.gather(-1, cols[:, None].expand(B, H, *cols.shape[1:])).float()
    p = probs.float()
    entropy = -(p * torch.log(torch.where(p > 0, p, torch.ones_like(p)))).sum(-1)
    return gathered, entropy


class Part:
    """A statistic family; every hook is optional. ``batch`` is the current micro-batch's slice.
    ``fused``: the pass that computed this call's attention output, when sinkwatch computed it
    (its lse spares the statistics a pass over the keys: ``attention_stats(..., fused=...)``)."""

    def on_attention(self, batch: slice, layer, query, key, scaling, window, softcap, sinks, fused: AttentionOutput | None = None) -> None:
        pass

    def on_attention_output(self, batch: slice, layer: int, output: torch.Tensor) -> torch.Tensor:
        return output

    def on_head_output(self, batch: slice, layer: int, output: torch.Tensor) -> None:
        pass

    def on_gate(self, batch: slice, layer: int, gate: torch.Tensor) -> None:
        pass

    def on_block_output(self, batch: slice, layer: int, hidden: torch.Tensor) -> None:
        pass

    def on_block_input(self, batch: slice, layer: int, hidden: torch.Tensor) -> None:
        pass

    def on_sublayer_output(self, batch: slice, layer: int, kind: str, output: torch.Tensor) -> None:
        pass


def _stack_layers(per_layer: list[list[np.ndarray]]) -> np.ndarray:
    """[layer][micro-batch] arrays of (b, ...) -> (N, L, ...); NaN for layers that saw nothing (blocks
    without softmax attention). Every layer empty: an array of shape (0, L)."""
    filled = [np.concatenate(chunks, axis=0) for chunks in per_layer if chunks]
    if not filled:
        return np.zeros((0, len(per_layer)))
    blank = np.full_like(filled[0], np.nan, dtype=np.result_type(filled[0].dtype, np.float32))
    return np.stack([np.concatenate(chunks, axis=0) if chunks else blank for chunks in per_layer], axis=1)


@dataclass
class SinkPart(Part):
    """Per-sample sink importance alpha_k over all query rows: (N, L, H, K); and, for layers with
    learned sink logits, the learned sink's importance averaged the same way: (N, L, H)."""

    n_layers: int
    n_first: int = metrics.SINK_PROFILE_K
    backend: str = "auto"
    chunks: list = field(init=False)
    learned: list = field(init=False)

    def __post_init__(self):
        self.chunks = [[] for _ in range(self.n_layers)]
        self.learned = [[] for _ in range(self.n_layers)]

    def on_attention(self, batch, layer, query, key, scaling, window, softcap, sinks, fused=None):
        st = attention_stats(
            query, key, scaling, n_first=self.n_first, window=window, softcap=softcap, sinks=sinks, backend=self.backend,
            fused=fused, entropy=False,
        )  # fmt: skip
        self.chunks[layer].append(metrics.sink_alpha(st.first).cpu().numpy())
        if sinks is not None:
            self.learned[layer].append(metrics.learned_sink_alpha(st.lse, sinks).cpu().numpy())

    def result(self) -> np.ndarray:
        return _stack_layers(self.chunks)

    def learned_result(self) -> np.ndarray | None:
        """(N, L, H) learned-sink importance, NaN in layers without a learned sink; None without any."""
        return _stack_layers(self.learned) if any(self.learned) else None


@dataclass
class RowColumnsPart(Part):
    """Attention probabilities of chosen query rows on chosen columns, plus the rows' entropy.

    rows (N, Q), cols (N, Q, G) index the whole probe; results are gathered (N, L, H, Q, G) and
    entropy (N, L, H, Q).
    """

    n_layers: int
    rows: np.ndarray
    cols: np.ndarray
    backend: str = "auto"
    eager_half: bool = False  # float16/bfloat16 models: round as eager half-precision attention does
    with_entropy: bool = True  # False: the rows' entropy is not used (NaN): with a fused pass, no pass over their keys
    gathered: list = field(init=False)
    entropy: list = field(init=False)

    def __post_init__(self):
        self.gathered = [[] for _ in range(self.n_layers)]
        self.entropy = [[] for _ in range(self.n_layers)]

    def on_attention(self, batch, layer, query, key, scaling, window, softcap, sinks, fused=None):
        rows = torch.as_tensor(self.rows[batch], device=query.device)
        cols = torch.as_tensor(self.cols[batch], device=query.device)
        # (eager half-precision rounding reproduces the paper's models, none of which has learned sinks)
        if self.eager_half and query.dtype in (torch.float16, torch.bfloat16) and sinks is None:
            probs, ent = eager_half_rows(query, key, scaling, rows, cols, window=window, softcap=softcap)
            self.gathered[layer].append(probs.cpu().numpy())
            self.entropy[layer].append(ent.cpu().numpy())
            return
        st = attention_stats(
            query, key, scaling, rows=rows, cols=cols, n_first=0, window=window, softcap=softcap, sinks=sinks, backend=self.backend,
            fused=fused, entropy=self.with_entropy,
        )  # fmt: skip
        self.gathered[layer].append(st.gathered.cpu().numpy())
        self.entropy[layer].append(st.entropy.cpu().numpy())

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return _stack_layers(self.gathered), _stack_layers(self.entropy)


@dataclass
class HeadOutputPart(Part):
    """Streaming Gram matrix M^T M (and column sums) of each head's output at one row per sequence.

    ``row`` (N,) picks the row. Enough for the participation ratio without keeping M (N x D).
    """

    n_layers: int
    row: np.ndarray
    limit: int | None = None  # only the first ``limit`` probe sequences (the paper's PR: 500)
    gram: list = field(init=False)
    total: list = field(init=False)
    count: int = 0
    count_layer: int | None = field(default=None, init=False)

    def __post_init__(self):
        self.gram = [None] * self.n_layers
        self.total = [None] * self.n_layers

    def on_head_output(self, batch, layer, output):
        B, S, H, D = output.shape
        keep = B if self.limit is None else max(0, min(B, self.limit - batch.start))
        if keep == 0:  # past the limit (a rank whose share starts there): zeros, its part of the ranks' sum
            if self.gram[layer] is None:
                self.gram[layer], self.total[layer] = np.zeros((H, D, D)), np.zeros((H, D))
            return
        idx = torch.as_tensor(self.row[batch][:keep], device=output.device)
        m = output[torch.arange(keep, device=output.device), idx].double()  # (keep, H, D)
        g = torch.einsum("bhd,bhe->hde", m, m).cpu().numpy()
        t = m.sum(0).cpu().numpy()
        self.gram[layer] = g if self.gram[layer] is None else self.gram[layer] + g
        self.total[layer] = t if self.total[layer] is None else self.total[layer] + t
        if self.count_layer is None:
            self.count_layer = layer  # the first block with softmax attention counts the rows
        if layer == self.count_layer:
            self.count += keep

    def grams(self) -> tuple[np.ndarray, np.ndarray]:
        """(L, H, D, D) Gram matrices and (L, H, D) column sums; NaN in blocks without softmax attention."""
        shape_g = next(g.shape for g in self.gram if g is not None)
        shape_t = next(t.shape for t in self.total if t is not None)
        gram = np.stack([np.full(shape_g, np.nan) if g is None else g for g in self.gram])
        total = np.stack([np.full(shape_t, np.nan) if t is None else t for t in self.total])
        return gram, total


@dataclass
class GatePart(Part):
    """Gated attention: per sample and head, the mean gate over every token and the head's dims:
    (N, L, H), NaN in layers without a gate. Cells whose factor could not be read (NaN: the attention
    output was exactly 0 there) are left out of the mean."""

    n_layers: int
    chunks: list = field(init=False)

    def __post_init__(self):
        self.chunks = [[] for _ in range(self.n_layers)]

    def on_gate(self, batch, layer, gate):
        g = gate.double()  # (B, S, H, D)
        ok = ~torch.isnan(g)
        total = torch.where(ok, g, 0.0).sum(dim=(1, 3))
        count = ok.sum(dim=(1, 3))
        self.chunks[layer].append((total / count).cpu().numpy())  # (B, H)

    def result(self) -> np.ndarray | None:
        """(N, L, H) mean gates, or None when no layer is gated."""
        return _stack_layers(self.chunks) if any(self.chunks) else None


class HeadCountPart(Part):
    """Records the number of query heads (the same in every layer) and the blocks that ran softmax attention."""

    def __init__(self):
        self.n_heads: int | None = None
        self.softmax_layers: list[int] = []

    def on_attention(self, batch, layer, query, key, scaling, window, softcap, sinks, fused=None):
        self.n_heads = int(query.shape[1])
        self.softmax_layers = sorted({*self.softmax_layers, layer})


@dataclass
class AblationPart(Part):
    """Zero chosen heads' slices of the output-projection input. keep: (L, H) of 0/1."""

    keep: torch.Tensor

    def on_attention_output(self, batch, layer, output):
        k = self.keep[layer].to(device=output.device, dtype=output.dtype)
        return output * k[None, None, :, None]


@dataclass
class P0Part(Part):
    """Position 0's norm against its sequence's other positions, per sequence (N, ...):

    - after each block (the residual stream): ||h[0]|| / median_{t>=1} ||h[t]|| (N, L), h[0] (N, L, d)
      and the mean of the other positions' h[t] (N, L, d), which centres the direction test;
    - before block 0 (the embeddings as the blocks see them): the same ratio (N,);
    - of what each block's attention and MLP write (``capture/sublayers.py``): (N, L) each, NaN in
      blocks without that sublayer.
    """

    n_layers: int
    ratio: list = field(init=False)
    vectors: list = field(init=False)
    others: list = field(init=False)
    embeddings: list = field(init=False)
    sublayers: dict = field(init=False)

    def __post_init__(self):
        self.ratio = [[] for _ in range(self.n_layers)]
        self.vectors = [[] for _ in range(self.n_layers)]
        self.others = [[] for _ in range(self.n_layers)]
        self.embeddings = []
        self.sublayers = {kind: [[] for _ in range(self.n_layers)] for kind in SUBLAYER_KINDS}

    def on_block_output(self, batch, layer, hidden):
        h = hidden.float()  # (B, S, d)
        self.ratio[layer].append(_norm_ratio(h))
        # copies of the first rows only: on CPU ``.cpu().numpy()`` of the view h[:, 0] would share, and
        # so keep alive until the probe ends, the whole (B, S, d) hidden state of every layer
        self.vectors[layer].append(h[:, 0].to("cpu", copy=True).numpy())
        self.others[layer].append(h[:, 1:].mean(dim=1).cpu().numpy())  # a new (B, d) tensor: no view kept

    def on_block_input(self, batch, layer, hidden):
        if layer == 0:
            self.embeddings.append(_norm_ratio(hidden.float()))

    def on_sublayer_output(self, batch, layer, kind, output):
        self.sublayers[kind][layer].append(_norm_ratio(output.float()))

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """ratio (N, L), vectors (N, L, d)."""
        return _stack_layers(self.ratio), _stack_layers(self.vectors)

    def others_result(self) -> np.ndarray:
        """(N, L, d): each sequence's mean of h[t], t >= 1, after each block."""
        return _stack_layers(self.others)

    def embeddings_result(self) -> np.ndarray | None:
        """(N,) the embeddings' norm ratio; None when the target hands no block input."""
        return np.concatenate(self.embeddings) if self.embeddings else None

    def sublayer_result(self, kind: str) -> np.ndarray | None:
        """(N, L) the norm ratio of what ``kind`` writes; None when no block has that sublayer."""
        return _stack_layers(self.sublayers[kind]) if any(self.sublayers[kind]) else None


def _norm_ratio(x: torch.Tensor) -> np.ndarray:
    """(B, S, ...) -> (B,): ||x[0]|| / median_{t>=1} ||x[t]|| over the flattened feature axes."""
    norms = torch.linalg.vector_norm(x.flatten(2), dim=-1)  # (B, S)
    return metrics.norm_ratio_per_sequence(norms).cpu().numpy()


class ProbeCollector:
    """Fans capture's callbacks out to parts; ``batch`` is set by the monitor before each forward.
    ``softmax_layers``: the blocks whose softmax attention reached the collector."""

    def __init__(self, parts: list[Part]):
        self.parts = parts
        self.batch = slice(0, 0)
        self._softmax: set[int] = set()
        self._fused: tuple[int, AttentionOutput] | None = None  # this call's fused pass, until on_attention

    @property
    def softmax_layers(self) -> list[int]:
        return sorted(self._softmax)

    def on_fused_attention(self, layer, fused):
        self._fused = (layer, fused)

    def on_attention(self, layer, query, key, scaling, window, softcap, sinks=None):
        self._softmax.add(layer)
        held, self._fused = self._fused, None  # held for this call only
        fused = held[1] if held is not None and held[0] == layer else None
        for p in self.parts:
            p.on_attention(self.batch, layer, query, key, scaling, window, softcap, sinks, fused=fused)

    def on_attention_output(self, layer, output):
        for p in self.parts:
            output = p.on_attention_output(self.batch, layer, output)
        return output

    def on_head_output(self, layer, output):
        for p in self.parts:
            p.on_head_output(self.batch, layer, output)

    def on_gate(self, layer, gate):
        for p in self.parts:
            p.on_gate(self.batch, layer, gate)

    def on_block_output(self, layer, hidden):
        for p in self.parts:
            p.on_block_output(self.batch, layer, hidden)

    def on_block_input(self, layer, hidden):
        for p in self.parts:
            p.on_block_input(self.batch, layer, hidden)

    def on_sublayer_output(self, layer, kind, output):
        for p in self.parts:
            p.on_sublayer_output(self.batch, layer, kind, output)
