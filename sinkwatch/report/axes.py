"""Axes shared by every figure: the x axis labelled by what it shows (tokens or steps, log or not),
lines that skip missing points, legends only where there is something to name, empty panels that say why."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..reporters.figures import save
from .markdown import _tokens

if TYPE_CHECKING:
    from .store import Store


def _x_label(stores: Sequence[Store]) -> str:
    if all(s.has_tokens for s in stores):
        return "tokens seen"
    if not any(s.has_tokens for s in stores):
        return "training step (tokens unknown: replay with --tokens-per-step)"
    return "tokens seen (" + ", ".join(s.label for s in stores if not s.has_tokens) + ": training step)"


def _xaxis(ax, stores: Sequence[Store] | None, log: bool | None = None, label: str | None = None) -> None:
    """Label the x axis by what it shows; a log axis is symlog below the smallest positive x, so a
    step-0 point stays on it, with one labelled tick per decade or fewer (labels never overlap)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ax.set_xlabel(label or _x_label(stores))
    log = _log_axis(stores) if log is None else log
    data_lines = [line for line in ax.get_lines() if line.get_transform() is ax.transData]  # not axhline/axvline
    xs = np.concatenate([np.asarray(line.get_xdata(), dtype=float) for line in data_lines] or [np.zeros(0)])
    xs = xs[np.isfinite(xs)]
    pos = xs[xs > 0]
    if log and len(pos):
        lo, hi = float(pos.min()), float(pos.max())
        if (xs <= 0).any():
            ax.set_xscale("symlog", linthresh=lo, linscale=0.5)
        else:
            ax.set_xscale("log")
        decades = np.arange(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
        step = max(1, math.ceil(len(decades) / 7))
        ticks = [10.0**d for d in decades[::step]] + ([0.0] if (xs <= 0).any() else [])
        ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tokens(v) if v else "0"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3)


def _empty(ax, why: str) -> None:
    """An empty panel says why it is empty instead of drawing a meaningless axis."""
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, fontsize=9, transform=ax.transAxes, color="0.35")


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _plot(ax, x, y, **kw):
    pts = [(a, b) for a, b in zip(x, y) if b is not None and (not isinstance(b, float) or math.isfinite(b))]
    if pts:
        ax.plot(*zip(*pts), **kw)


def _log_axis(stores: Sequence[Store]) -> bool:
    return all(s.is_replay for s in stores)


SINK_FRACTION_LABEL = "sink-head fraction (first-token >= 30x)"


def _final_layers_axes(ax) -> None:
    """Axes of a bar chart of sink heads per layer at the final revision, with room above the bars for its legend."""
    ax.set_xlabel("layer")
    ax.set_ylabel("sink heads at the final revision")
    entries = len(ax.get_legend_handles_labels()[0])
    ax.set_ylim(0, max(ax.get_ylim()[1], 1) * (1 + 0.12 * entries))  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left")


def _saved(fig, out: Path, name: str) -> str:
    """Lay ``fig`` out and save it as ``out/name`` (closing it); returns ``name``, the figure's name in the markdown."""
    fig.tight_layout()
    save(fig, out / name)
    return name
