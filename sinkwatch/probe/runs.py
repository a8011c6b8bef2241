"""One entry per probe kind: the parts it adds to the captured forward and the values it computes
(docs/design.md §5). ``Monitor.probe`` runs the entries of its probe sets over one capture."""

from __future__ import annotations

import numpy as np
import torch

from .. import metrics, stages
from ..capture.head import ProbeForward
from ..probes import ProbeSet
from .collectors import GatePart, HeadOutputPart, P0Part, RowColumnsPart, SinkPart
from .config import PAPER_PR_SEQUENCES, MonitorConfig
from .share import State


class ProbeRun:
    """One probe set's share of ``Monitor.probe``: ``parts`` ride the captured forward, ``observe``
    sees each micro-batch's sequences, ids and ``ProbeForward`` (last-position logits, per-token
    losses when asked), ``state`` is what the run kept (``probe_share.State``: arrays per sequence,
    and the sums named in ``SUMS``), and ``values`` turns the whole probe's state into (record
    values, n_heads or None). Nothing between ``state`` and ``values`` may depend on which rank
    computed which sequence: under a ``ProbeShare`` the states of every rank are combined first."""

    token_losses = False  # whether the forward must return every position's next-token loss
    SUMS: tuple[str, ...] = ()
    # name -> the axis of the query heads, for the arrays that have one: under tensor parallelism each rank
    # computes its own heads' and ``probe_share.combine`` assembles the heads in their global order
    HEADS: dict[str, int] = {}

    def __init__(self, probe: ProbeSet, n_layers: int, config: MonitorConfig):
        self.probe, self.config = probe, config
        self.parts: list = []

    def observe(self, batch: slice, ids: torch.Tensor, out: ProbeForward) -> None:
        pass

    def state(self) -> State:
        return {}

    def values(self, state: State, softmax_layers: list[int]) -> tuple[dict, int | None]:
        """``softmax_layers``: the blocks that ran softmax attention (all of them but in hybrid stacks)."""
        return {}, None


class SinkRun(ProbeRun):
    """Sink and position-0 keys (``sink_*``, ``p0_*``, ``circuit_layer``), on the set that carries them;
    with them the learned sinks' importance (``sink_learned_*``) and gated attention's mean gates
    (``attn_gate_mean``), which describe the same rows."""

    HEADS = {"alpha": 2, "learned": 2, "gates": 2}

    def __init__(self, probe: ProbeSet, n_layers: int, config: MonitorConfig):
        super().__init__(probe, n_layers, config)
        self.sink, self.p0, self.gate = SinkPart(n_layers, config.n_first, config.backend), P0Part(n_layers), GatePart(n_layers)
        self.parts = [self.sink, self.p0, self.gate]

    def state(self) -> State:
        ratio, vectors = self.p0.result()
        return {
            "alpha": self.sink.result(),  # (n, L, H, K), NaN in blocks without softmax attention
            "learned": self.sink.learned_result(),  # (n, L, H): layers with learned sink logits, or None
            "gates": self.gate.result(),  # (n, L, H): gated attention, or None
            "ratio": ratio,  # (n, L)
            "vectors": vectors,  # (n, L, d)
            "others": self.p0.others_result(),  # (n, L, d): each sequence's mean of the other positions
            "embeddings": self.p0.embeddings_result(),  # (n,) or None
            "attention": self.p0.sublayer_result("attention"),  # (n, L) or None
            "mlp": self.p0.sublayer_result("mlp"),  # (n, L) or None
        }

    def values(self, state: State, softmax_layers: list[int]) -> tuple[dict, int | None]:
        alpha = state["alpha"]
        values = {
            **_sink_values(alpha, self.config, softmax_layers),
            **_p0_values(state, self.probe.tokens[:, 0].numpy(), self.config),
        }
        learned = state["learned"]
        if learned is not None:
            values["sink_learned_alpha"] = learned.mean(axis=0)
            with_sink = ~np.isnan(learned).all(axis=(0, 2))
            values["sink_learned_rate"] = float((np.nan_to_num(learned[:, with_sink], nan=-np.inf) > self.config.sink_epsilon).mean())
        if state["gates"] is not None:
            values["attn_gate_mean"] = state["gates"].mean(axis=0)
        return values, alpha.shape[2]


class InductionRun(ProbeRun):
    """Selectivity at the query row, head classes, PR, and the target's loss / top-k (docs/design.md §5)."""

    SUMS = ("gram", "total", "count")  # PR's sufficient statistics: per-head Gram matrices M^T M, column sums, rows
    HEADS = {"gathered": 2, "entropy": 2, "gram": 1, "total": 1}

    def __init__(self, probe: ProbeSet, n_layers: int, config: MonitorConfig):
        super().__init__(probe, n_layers, config)
        cols, self.layout = metrics.selectivity_columns(probe.seq_len, probe.fields["ab"], probe.fields["baseline_positions"])
        paper = config.protocol == "paper"  # eager float16 rounding of the attention rows, PR on the first 500
        self.rowcols = RowColumnsPart(n_layers, probe.fields["query_row"][:, None], cols[:, None, :], config.backend, eager_half=paper)
        limit = PAPER_PR_SEQUENCES if paper else None
        self.heads = HeadOutputPart(n_layers, probe.fields["query_row"], limit=limit) if config.participation_ratio else None
        self.parts = [self.rowcols] + ([self.heads] if self.heads is not None else [])
        self.target: list[np.ndarray] = []

    def observe(self, batch: slice, ids: torch.Tensor, out: ProbeForward) -> None:
        # per sequence (loss, top-1, top-5) of the target B at the query row: (b, 3), never the (b, V) logits
        targets = torch.as_tensor(self.probe.fields["token_b"][batch])
        self.target.append(metrics.target_scores_per_sequence(out.logits[:, -1].float().cpu(), targets))

    def state(self) -> State:
        gathered, entropy = self.rowcols.result()
        # (n, L, H, 1, G), (n, L, H, 1), (n, 3)
        st: State = {"gathered": gathered, "entropy": entropy, "target": np.concatenate(self.target)}
        if self.heads is not None:
            gram, total = self.heads.grams()  # (L, H, D, D), (L, H, D): NaN in blocks without softmax attention
            st.update(gram=gram, total=total, count=np.asarray(self.heads.count))
        return st

    def values(self, state: State, softmax_layers: list[int]) -> tuple[dict, int | None]:
        probe, cfg = self.probe, self.config
        gathered, entropy = state["gathered"], state["entropy"]
        valid = probe.fields["valid"].astype(bool)
        scores = metrics.selectivity(gathered[:, :, :, 0], self.layout, valid)
        best = metrics.best_class(scores, softmax_layers=softmax_layers)
        screen = metrics.head_screen(scores, best, softmax_layers)
        values = {"selectivity": scores, "best_class": best}
        values.update({k: v for k, v in screen.items() if k != "sink_heads"})
        values["attention_entropy"] = entropy[:, :, :, 0].mean(axis=0)
        values["induction_target"] = metrics.mean_target_scores(state["target"][valid]) if valid.any() else None
        values["induction_valid_sequences"] = int(valid.sum())
        if self.heads is not None:
            count = int(state["count"])
            values["pr"] = metrics.participation_ratio(state["gram"])
            values["pr_sequences"] = count  # PR is bounded by min(N, d_head): N is part of the number
            if cfg.classical_pr:
                values["pr_classical"] = metrics.participation_ratio_classical(state["gram"], state["total"], count)
        return values, gathered.shape[2]


class RepeatedRun(ProbeRun):
    """Prefix-matching induction score and the ICL score (second-copy minus first-copy loss)."""

    # the copy losses need every position's loss: taken from the final hidden states through the
    # output head in row chunks (capture/head.py), never from all-position logits (docs/design.md §9)
    token_losses = True
    HEADS = {"gathered": 2}

    def __init__(self, probe: ProbeSet, n_layers: int, config: MonitorConfig):
        super().__init__(probe, n_layers, config)
        rows, tcols = metrics.repeated_query_columns(probe.params["half_len"], probe.n)
        self.rowcols = RowColumnsPart(n_layers, rows, tcols, config.backend, with_entropy=False)  # the copy rows' entropy is not reported
        self.parts = [self.rowcols]
        self.copy_first: list[np.ndarray] = []
        self.copy_second: list[np.ndarray] = []

    def observe(self, batch: slice, ids: torch.Tensor, out: ProbeForward) -> None:
        a, b = metrics.copy_losses(out.token_losses, self.probe.params["half_len"])  # (B, S-1) -> per-copy means
        self.copy_first.append(a.cpu().numpy())
        self.copy_second.append(b.cpu().numpy())

    def state(self) -> State:
        gathered, _ = self.rowcols.result()  # (n, L, H, L_rep, 1)
        return {"gathered": gathered, "first": np.concatenate(self.copy_first), "second": np.concatenate(self.copy_second)}

    def values(self, state: State, softmax_layers: list[int]) -> tuple[dict, int | None]:
        gathered = state["gathered"]
        values = {
            "induction_score": metrics.induction_score(gathered[..., 0].mean(axis=-1)),
            "icl_score": metrics.icl_score(state["first"], state["second"]),
        }
        return values, gathered.shape[2]


class NaturalRun(ProbeRun):
    """Natural text computes nothing of its own: it carries the sink keys (``Monitor.probe``)."""


PROBE_RUNS: dict[str, type[ProbeRun]] = {"induction": InductionRun, "repeated": RepeatedRun, "natural": NaturalRun}


def bos_free_twin(natural: ProbeSet) -> ProbeSet | None:
    """The natural windows without their first token (docs/design.md §3) when every window starts with the
    same one (a BOS: ``Monitor._p0_anchor`` then judges the positional circuit on the twin), else None."""
    first = natural.tokens[:, 0]
    if natural.n < 2 or not bool((first == first[0]).all()):
        return None
    return ProbeSet("natural", natural.tokens[:, 1:].clone(), {}, {**natural.params, "bos_free_twin": True})


def _sink_values(alpha: np.ndarray, config: MonitorConfig, softmax_layers: list[int]) -> dict:
    frac = metrics.sink_fractions(alpha, config.sink_epsilon, softmax_layers)
    st = config.stages
    return {
        "sink_rate": frac["rate"],
        "sink_profile": frac["profile"],
        "sink_rate_per_layer": frac["per_layer"],
        "sink_alpha": metrics.sink_alpha_mean(alpha),
        "sink_center": metrics.sink_center(alpha),
        "sink_positions": metrics.sink_positions(frac["profile"], st.second_sink_ratio, st.sink_rate_floor),
    }


# the keys that describe where position 0 is amplified: an anchor's own (``Monitor._p0_anchor``)
P0_CIRCUIT_KEYS = (
    "p0_norm_ratio",
    "p0_norm_ratio_embeddings",
    "p0_direction_consistency",
    "p0_direction_consistency_centered",
    "p0_attn_norm_ratio",
    "p0_mlp_norm_ratio",
    "rho_max",
    "rho_max_block",
    "p0_emergence_block",
    "p0_persistence",
    "p0_concentration",
    "circuit_layer",
    "circuit_layer_first",
)
_VIEW_SINK_KEYS = ("sink_rate", "sink_profile", "sink_center", "sink_positions", "sink_alpha")


def _p0_values(state: State, first_tokens: np.ndarray, config: MonitorConfig) -> dict:
    """Where and how position 0 is amplified (docs/stages.md): rho after each block, before block 0
    and of each block's attention / MLP output; direction consistency (uncentred, and centred on
    the other positions); the circuit's emergence, persistence, concentration and layer; and
    ``circuit_layer_first``, the first block >= R (the circuit layer of earlier sinkwatch)."""
    ratio, vectors, others = state["ratio"], state["vectors"], state["others"]
    L = vectors.shape[1]
    rho = metrics.p0_norm_ratio(ratio)
    uncentred = np.array([metrics.direction_consistency(vectors[:, l], first_tokens) for l in range(L)])
    centred = np.array([metrics.direction_consistency_centered(vectors[:, l], others[:, l], first_tokens) for l in range(L)])
    st = config.stages
    values = {
        "p0_norm_ratio": rho,
        "p0_norm_ratio_embeddings": None if state["embeddings"] is None else float(np.median(state["embeddings"])),
        "p0_direction_consistency": uncentred,
        "p0_direction_consistency_centered": centred,
        "p0_attn_norm_ratio": None if state["attention"] is None else metrics.p0_norm_ratio(state["attention"]),
        "p0_mlp_norm_ratio": None if state["mlp"] is None else metrics.p0_norm_ratio(state["mlp"]),
    }
    values.update(stages.circuit(values, st, bos=False))
    values["circuit_layer_first"] = metrics.circuit_layer(rho, uncentred, st.circuit_min_norm_ratio, st.circuit_min_consistency)
    values["p0_anchor"] = "position" if values["circuit_layer"] is not None else None  # a shared BOS: Monitor._p0_anchor decides
    return values


def anchor_view(values: dict) -> dict:
    """One anchor's numbers, as ``stages.p0_views`` reads them: its windows' sinks and circuit keys."""
    return {k: values.get(k) for k in (*_VIEW_SINK_KEYS, *P0_CIRCUIT_KEYS)}
