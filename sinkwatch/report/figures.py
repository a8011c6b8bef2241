"""The trajectory figures: sink-head fraction and induction heads (the paper's beside ours, dashed),
final sink heads per layer, the stage timeline, sink rate and circuit layer, prefix score and ICL,
and layer x head heatmaps of a few records."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..records import best_induction_score, n_sink_heads, softmax_heads
from ..reporters.figures import _plt, record_heatmaps, save
from ..stages import INDUCTION_STATES, P0_STAGES, judged_view
from . import findings as F
from .axes import SINK_FRACTION_LABEL, _empty, _final_layers_axes, _legend, _log_axis, _plot, _saved, _x_label, _xaxis
from .store import Store


def figure_sink_heads(stores, out: Path, reference: dict) -> str | None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    drawn = False
    log = _log_axis(stores)
    for i, s in enumerate(stores):
        c = f"C{i}"
        recs = s.records
        if "sink_heads_per_layer" not in recs[-1]:
            continue
        total = softmax_heads(recs[-1])  # heads of softmax blocks (hybrid stacks: the others have none)
        _plot(
            a1,
            s.x(),
            [n_sink_heads(r) / total if "sink_heads_per_layer" in r else None for r in recs],
            color=c,
            marker="o",
            label=s.label,
        )
        _plot(a2, s.x(), s.column("n_induction_ge50"), color=c, marker="o", label=f"{s.label} >= 50x")
        _plot(a2, s.x(), s.column("n_induction_ge30"), color=c, marker="^", alpha=0.5, label=f"{s.label} >= 30x")
        if s.reference_key and s.has_tokens:  # the paper's axis is tokens: never drawn against steps
            t = F.trajectory_from_reference(s.reference_key, reference)
            _plot(a1, t.tokens, t.sink_fraction, color=c, ls="--", alpha=0.7, label=f"{s.reference_key} (paper)")
            _plot(a2, t.tokens, t.ind_ge30, color=c, ls="--", alpha=0.7, label="paper >= 30x")
            if t.ind_ge50 is not None:
                _plot(a2, t.tokens, t.ind_ge50, color=c, ls="-.", alpha=0.7, label="paper >= 50x")
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    a1.set_ylabel(SINK_FRACTION_LABEL)
    a2.set_ylabel("induction heads")
    for ax in (a1, a2):
        _xaxis(ax, stores, log)
        _legend(ax)
    a1.set_title("sink-head fraction")
    a2.set_title("induction heads (selectivity screen)")
    return _saved(fig, out, "sink_and_induction_heads.png")


def figure_final_layers(stores, out: Path, reference: dict) -> str | None:
    plt = _plt()
    # blocks without softmax attention (hybrid stacks) are null: no bar
    rows = [
        (s, [np.nan if n is None else n for n in s.records[-1]["sink_heads_per_layer"]])
        for s in stores
        if "sink_heads_per_layer" in s.records[-1]
    ]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / (len(rows) * 2)
    for i, (s, per) in enumerate(rows):
        L = len(per)
        ax.bar(
            np.arange(L) + (2 * i) * width,
            per,
            width,
            color=f"C{i}",
            label=f"{s.label} @ {s.records[-1].get('revision') or s.records[-1].get('step')}",
        )
        if s.reference_key:
            ref_per = reference["models"][s.reference_key]["final_sink_heads_per_layer"]
            ax.bar(
                np.arange(len(ref_per)) + (2 * i + 1) * width,
                ref_per,
                width,
                color=f"C{i}",
                alpha=0.4,
                hatch="//",
                label=f"{s.reference_key} (paper)",
            )
    _final_layers_axes(ax)
    return _saved(fig, out, "final_sink_heads_per_layer.png")


def figure_stages(stores, out: Path) -> str:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 4.5), sharex=True)
    for i, s in enumerate(stores):
        c = f"C{i}"
        _plot(a1, s.x(), s.column("p0_stage", P0_STAGES.index), color=c, drawstyle="steps-post", marker="o", label=f"{s.label} (tracked)")
        _plot(a1, s.x(), s.column("p0_stage_now", P0_STAGES.index), color=c, ls=":", alpha=0.5)
        _plot(a2, s.x(), s.column("induction_state", INDUCTION_STATES.index), color=c, drawstyle="steps-post", marker="o", label=s.label)
        _plot(a2, s.x(), s.column("induction_state_now", INDUCTION_STATES.index), color=c, ls=":", alpha=0.5)
    a1.set_yticks(range(len(P0_STAGES)), P0_STAGES)
    a2.set_yticks(range(len(INDUCTION_STATES)), INDUCTION_STATES)
    a1.set_title("P0-sink circuit stage (solid: tracked; dotted: this probe alone)", fontsize=9)
    a2.set_title("induction state", fontsize=9)
    _legend(a1)
    _xaxis(a2, stores)
    a1.grid(alpha=0.3)
    return _saved(fig, out, "stage_timeline.png")


def figure_p0_profile(stores, out: Path) -> str | None:
    """Where position 0 is amplified, probe by probe: log10 of its norm ratio after each block (the first
    store), and the share of it gained in blocks 0-1 (``p0_concentration``) beside the sink rate."""
    plt = _plt()
    first = stores[0]
    rows = [judged_view(r)[1].get("p0_norm_ratio") for r in first.records]
    if not rows or any(r is None for r in rows) or len({len(r) for r in rows}) != 1:
        return None
    rho = np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=float)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = first.x()
    im = a1.imshow(np.log10(np.clip(rho.T, 1e-3, None)), aspect="auto", origin="lower", cmap="magma", interpolation="nearest")
    ticks = np.linspace(0, len(x) - 1, min(len(x), 6)).round().astype(int)
    a1.set_xticks(ticks, [f"{x[i]:g}" for i in ticks])
    a1.set_xlabel(f"{_x_label([first])} (probe)")
    a1.set_ylabel("block")
    a1.set_title("log10 of position 0's norm ratio after each block" + (f" ({first.label})" if len(stores) > 1 else ""), fontsize=9)
    fig.colorbar(im, ax=a1, fraction=0.046)
    for i, s in enumerate(stores):
        views = [judged_view(r)[1] for r in s.records]
        shares = [v.get("p0_concentration") for v in views]
        _plot(a2, s.x(), shares, color=f"C{i}", marker="o", label=f"{s.label} concentration (blocks 0-1)")
        _plot(a2, s.x(), [v.get("sink_rate") for v in views], color=f"C{i}", ls="--", alpha=0.7, label=f"{s.label} sink rate")
    a2.set_ylim(-0.02, 1.02)
    a2.set_ylabel("share / rate")
    _xaxis(a2, stores)
    _legend(a2)
    a2.grid(alpha=0.3)
    return _saved(fig, out, "p0_circuit.png")


def figure_sink_rate(stores, out: Path) -> str | None:
    plt = _plt()
    if not any("sink_rate" in s.records[-1] for s in stores):
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, s in enumerate(stores):
        _plot(a1, s.x(), s.column("sink_rate"), color=f"C{i}", marker="o", label=s.label)
        if any(v is not None for v in s.column("circuit_layer")):
            _plot(a2, s.x(), s.column("circuit_layer"), color=f"C{i}", marker="s", label=f"{s.label} circuit layer")
    last = stores[0]
    prof = [r.get("sink_profile") for r in last.records]
    if all(p is not None for p in prof):
        prof = np.array(prof, dtype=float)
        for k in range(1, min(prof.shape[1], 4)):
            _plot(a1, last.x(), list(prof[:, k]), ls="--", alpha=0.6, label=f"{last.label} Sink_{k}")
    a1.set_ylabel("sink rate Sink_0 (dashed: Sink_k)")
    a2.set_ylabel("P0 circuit layer")
    _xaxis(a1, stores)
    _legend(a1)
    if a2.get_lines():
        _xaxis(a2, stores)
        _legend(a2)
    else:
        _empty(
            a2,
            "P0 circuit layer: no probe found one\n(no block met both the norm-ratio and the\n"
            "direction-consistency thresholds, or the\nprobe had no sink source)",
        )
    return _saved(fig, out, "sink_rate.png")


def figure_prefix(stores, out: Path) -> str | None:
    plt = _plt()
    if not any("induction_score" in s.records[-1] for s in stores):
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, s in enumerate(stores):
        best = [best_induction_score(r) for r in s.records]
        _plot(a1, s.x(), best, color=f"C{i}", marker="o", label=s.label)
        _plot(a2, s.x(), s.column("icl_score"), color=f"C{i}", marker="o", label=s.label)
    a1.set_ylabel("best prefix-matching (induction) score")
    a2.set_ylabel("ICL score: 2nd-copy - 1st-copy loss (nats)")
    a2.axhline(0, color="k", lw=0.5)
    for ax in (a1, a2):
        _xaxis(ax, stores)
        _legend(ax)
    return _saved(fig, out, "induction_score_and_icl.png")


def figure_heatmaps(store: Store, out: Path, index: int) -> list[str]:
    recs = store.records
    picks = sorted({0, len(recs) // 2, len(recs) - 1})
    names = []
    for j in picks:
        r = recs[j]
        tag = (r.get("revision") or f"step{r.get('step')}").replace("/", "_")
        for kind, fig in record_heatmaps(r).items():
            name = f"heatmap_{index}_{tag}_{kind}.png"
            save(fig, out / name)
            names.append(name)
    return names
