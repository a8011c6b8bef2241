"""Matplotlib figures from records (headless: the Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def heatmap(matrix, title: str, *, cbar: str = "", log: bool = False, vmax: float | None = None):
    """A layer x head heatmap (rows = layers). Returns the matplotlib Figure."""
    plt = _plt()
    m = np.array([[np.nan if v is None else v for v in row] for row in matrix], dtype=float)
    L, H = m.shape
    fig, ax = plt.subplots(figsize=(max(3.4, 1.4 + 0.35 * H), max(2.6, 1.0 + 0.3 * L)), dpi=100)
    data = np.log10(np.clip(m, 1e-3, None)) if log else m
    im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0 if not log else None, vmax=vmax)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    ax.set_xticks(range(H))
    ax.set_yticks(range(L))
    ax.tick_params(labelsize=6)
    fig.colorbar(im, ax=ax, label=("log10 " if log else "") + cbar)
    fig.tight_layout()
    return fig


def record_heatmaps(record: Mapping[str, Any]) -> dict:
    """The layer x head heatmaps a record supports: sink alpha_0, induction selectivity, prefix score."""
    where = f"step {record['step']}" if record.get("step") is not None else (record.get("revision") or "")
    figs = {}
    if record.get("sink_alpha") is not None:
        figs["sink_alpha"] = heatmap(record["sink_alpha"], f"sink alpha_0 ({where})", cbar="alpha_0", vmax=1.0)
    if record.get("selectivity") is not None:
        figs["induction_selectivity"] = heatmap(
            record["selectivity"]["induction"], f"induction selectivity ({where})", cbar="x baseline", log=True
        )
    if record.get("induction_score") is not None:
        figs["induction_score"] = heatmap(record["induction_score"], f"prefix-matching score ({where})", cbar="score", vmax=1.0)
    return figs


def save(fig, path) -> None:
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def close(figs: Mapping[str, Any] | Sequence) -> None:
    plt = _plt()
    for f in figs.values() if isinstance(figs, Mapping) else figs:
        plt.close(f)
