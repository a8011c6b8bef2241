"""Head by head against the paper's per-head tables: per revision, ours vs its selectivity for every
listed head and class (a figure), and the heads whose best class or threshold side differs (a table)."""

from __future__ import annotations

import math
from pathlib import Path

from ..reporters.figures import _plt
from . import findings as F
from .axes import _empty, _saved
from .markdown import _image
from .paper import PROTOCOL_NOTE
from .store import Store


# ---- head by head ---------------------------------------------------------------------------------------
def head_comparisons(s: Store, per_head: dict | None) -> list[dict]:
    if not s.reference_key:
        return []
    ph = per_head or F.load_per_head()
    if s.reference_key not in ph["per_revision"]:
        return []
    return [c for c in (F.head_comparison(r, s.reference_key, ph) for r in s.records) if c is not None]


def figure_head_comparison(s: Store, comps: list[dict], out: Path, index: int) -> str | None:
    """Per revision, ours vs the paper's selectivity for every listed head and class (log-log, identity line);
    heads whose best class or threshold side differs are ringed in red and named."""
    if not comps:
        return None
    plt = _plt()
    n = len(comps)
    cols = min(n, 5)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax, comp in zip(axes.flat, comps):
        pairs = [p for p in comp["pairs"] if p["ours"] > 0 and p["paper"] > 0 and math.isfinite(p["ours"]) and math.isfinite(p["paper"])]
        if not pairs:
            _empty(ax, f"{comp['revision']}: no positive finite pair")
            continue
        for k, c in enumerate(sorted({p["class"] for p in pairs})):
            pts = [(p["paper"], p["ours"]) for p in pairs if p["class"] == c]
            ax.scatter(*zip(*pts), s=8, color=f"C{k}", label=c, alpha=0.7)
        lo = min(min(p["ours"], p["paper"]) for p in pairs)
        hi = max(max(p["ours"], p["paper"]) for p in pairs)
        ax.plot([lo, hi], [lo, hi], color="k", lw=0.6)
        for t in F.THRESHOLD_SIDES:
            if lo < t < hi:
                ax.axvline(t, color="0.7", lw=0.4, ls=":")
        named = sorted({d["head"] for d in comp["differences"]})
        for p in pairs:
            if p["head"] in named and any(d["head"] == p["head"] and p["class"] in d["what"] for d in comp["differences"]):
                ax.scatter([p["paper"]], [p["ours"]], s=40, facecolors="none", edgecolors="red", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{comp['revision']}: {len(named)} head(s) differ", fontsize=8)
        if named:
            ax.text(
                0.02,
                0.98,
                "\n".join(named[:6]) + ("\n..." if len(named) > 6 else ""),
                transform=ax.transAxes,
                va="top",
                fontsize=6,
                color="red",
            )
        ax.tick_params(labelsize=6)
    axes.flat[0].legend(fontsize=6, loc="lower right")
    fig.supxlabel("paper's selectivity (x baseline)", fontsize=9)
    fig.supylabel(f"ours ({s.protocol} protocol)", fontsize=9)
    fig.suptitle(f"{s.label}: head-by-head vs Xu 2026 (the 45 listed heads, six classes)", fontsize=10)
    return _saved(fig, out, f"head_comparison_{index}.png")


def _head_comparison_lines(s: Store, comps: list[dict], figure: str | None) -> list[str]:
    if not comps:
        return []
    lines = [f"### Head by head vs the paper: {s.label}", "", f"Ours: {PROTOCOL_NOTE.get(s.protocol, s.protocol)}.", ""]
    if figure:
        lines += [_image(figure), ""]
    lines += ["| revision | largest relative deviation | heads whose best class or 30x/50x/100x side differs |", "|---|---|---|"]
    for c in comps:
        w = c["largest_deviation"]
        worst = f"{w['deviation']:.2%} ({w['head']} {w['class']}: ours {w['ours']:.4g}, paper {w['paper']:.4g})" if "head" in w else "0"
        diffs = "; ".join(f"{d['head']} {d['what']}" for d in c["differences"]) or "none"
        lines.append(f"| {c['revision']} | {worst} | {diffs} |")
    return lines + [""]
