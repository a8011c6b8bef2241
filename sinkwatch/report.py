"""``sinkwatch report STORE [STORE ...]``: markdown + PNG figures from replay stores or live runs.

Several stores overlay in one set of figures (the paper compares three models side by side). For a
store whose model has published figures, the paper's trajectory is drawn beside ours (dashed) and
the findings table flags every mismatch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import findings as F
from .records import best_induction_score
from .replay import failed_revisions, merged_records
from .reporting.figures import _plt, record_heatmaps, save
from .reporting.jsonl import read_jsonl
from .stages import INDUCTION_STATES, P0_STAGES


class Store:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"no store at {self.path} (a directory with records.jsonl)")
        self.records = merged_records(self.path)
        if not self.records:
            raise ValueError(f"{self.path} holds no successful records yet")
        self.model = self.records[-1]["model"]
        self.label = self.model if self.model not in ("", None) else self.path.name
        self.failed = failed_revisions(self.path)
        self.events = read_jsonl(self.path / "events.jsonl")
        self.is_replay = any(r.get("revision") for r in self.records)
        self.reference_key = F.reference_key(self.model)

    def x(self) -> list[float]:
        """Tokens seen (step when tokens are unknown)."""
        return [float(r["tokens"]) if r.get("tokens") is not None else float(r.get("step") or 0) for r in self.records]

    def column(self, key: str, fn=lambda v: v) -> list:
        return [fn(r[key]) if r.get(key) is not None else None for r in self.records]


def _xaxis(ax, log: bool) -> None:
    ax.set_xlabel("tokens seen")
    if log:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _plot(ax, x, y, **kw):
    pts = [(a, b) for a, b in zip(x, y) if b is not None and (not isinstance(b, float) or math.isfinite(b))]
    if pts:
        ax.plot(*zip(*pts), **kw)


def _log_axis(stores: Sequence[Store]) -> bool:
    return all(s.is_replay for s in stores)


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
        total = recs[-1]["n_layers"] * recs[-1]["n_heads"]
        _plot(
            a1,
            s.x(),
            [sum(r["sink_heads_per_layer"]) / total if "sink_heads_per_layer" in r else None for r in recs],
            color=c,
            marker="o",
            label=s.label,
        )
        _plot(a2, s.x(), s.column("n_induction_ge50"), color=c, marker="o", label=f"{s.label} >= 50x")
        _plot(a2, s.x(), s.column("n_induction_ge30"), color=c, marker="^", alpha=0.5, label=f"{s.label} >= 30x")
        if s.reference_key:
            t = F.trajectory_from_reference(s.reference_key, reference)
            _plot(a1, t.tokens, t.sink_fraction, color=c, ls="--", alpha=0.7, label=f"{s.reference_key} (paper)")
            _plot(a2, t.tokens, t.ind_ge30, color=c, ls="--", alpha=0.7, label="paper >= 30x")
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    a1.set_ylabel("sink-head fraction (first-token >= 30x)")
    a2.set_ylabel("induction heads")
    for ax in (a1, a2):
        _xaxis(ax, log)
        _legend(ax)
    a1.set_title("sink-head fraction")
    a2.set_title("induction heads (selectivity screen)")
    fig.tight_layout()
    save(fig, out / "sink_and_induction_heads.png")
    return "sink_and_induction_heads.png"


def figure_final_layers(stores, out: Path, reference: dict) -> str | None:
    plt = _plt()
    rows = [(s, s.records[-1]["sink_heads_per_layer"]) for s in stores if "sink_heads_per_layer" in s.records[-1]]
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
    ax.set_xlabel("layer")
    ax.set_ylabel("sink heads at the final revision")
    _legend(ax)
    fig.tight_layout()
    save(fig, out / "final_sink_heads_per_layer.png")
    return "final_sink_heads_per_layer.png"


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
    _xaxis(a2, _log_axis(stores))
    a1.grid(alpha=0.3)
    fig.tight_layout()
    save(fig, out / "stage_timeline.png")
    return "stage_timeline.png"


def figure_sink_rate(stores, out: Path) -> str | None:
    plt = _plt()
    if not any("sink_rate" in s.records[-1] for s in stores):
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, s in enumerate(stores):
        _plot(a1, s.x(), s.column("sink_rate"), color=f"C{i}", marker="o", label=s.label)
        _plot(a2, s.x(), s.column("circuit_layer"), color=f"C{i}", marker="s", label=f"{s.label} circuit layer")
    last = stores[0]
    prof = [r.get("sink_profile") for r in last.records]
    if all(p is not None for p in prof):
        prof = np.array(prof, dtype=float)
        for k in range(1, min(prof.shape[1], 4)):
            _plot(a1, last.x(), list(prof[:, k]), ls="--", alpha=0.6, label=f"{last.label} Sink_{k}")
    a1.set_ylabel("sink rate Sink_0 (dashed: Sink_k)")
    a2.set_ylabel("P0 circuit layer")
    for ax in (a1, a2):
        _xaxis(ax, _log_axis(stores))
        _legend(ax)
    fig.tight_layout()
    save(fig, out / "sink_rate.png")
    return "sink_rate.png"


def figure_prefix(stores, out: Path) -> str | None:
    plt = _plt()
    if not any("induction_score" in s.records[-1] for s in stores):
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, s in enumerate(stores):
        best = [
            best_induction_score(r)
            for r in s.records
        ]
        _plot(a1, s.x(), best, color=f"C{i}", marker="o", label=s.label)
        _plot(a2, s.x(), s.column("icl_score"), color=f"C{i}", marker="o", label=s.label)
    a1.set_ylabel("best prefix-matching (induction) score")
    a2.set_ylabel("ICL score: 2nd-copy - 1st-copy loss (nats)")
    a2.axhline(0, color="k", lw=0.5)
    for ax in (a1, a2):
        _xaxis(ax, _log_axis(stores))
        _legend(ax)
    fig.tight_layout()
    save(fig, out / "induction_score_and_icl.png")
    return "induction_score_and_icl.png"


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


# ---- markdown ------------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return _tokens(v) if abs(v) >= 1e4 else f"{v:.3g}"
    return str(v)


def _tokens(v) -> str:
    """Token counts as people write them: 6.29B, 614K."""
    if v is None:
        return "—"
    v = float(v)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.0f}"


def _trajectory_table(s: Store) -> list[str]:
    head = "| revision / step | tokens | sink rate | sink heads | ind >= 30x | ind >= 50x | prefix best | ICL | P0 stage | induction |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in s.records:
        best = best_induction_score(r)
        lines.append(
            f"| {r.get('revision') or r.get('step')} | {_tokens(r.get('tokens'))} | {_fmt(r.get('sink_rate'))} | "
            f"{sum(r['sink_heads_per_layer']) if 'sink_heads_per_layer' in r else '—'} | "
            f"{_fmt(r.get('n_induction_ge30'))} | {_fmt(r.get('n_induction_ge50'))} | "
            f"{_fmt(best)} | {_fmt(r.get('icl_score'))} | {r.get('p0_stage')} | {r.get('induction_state')} |"
        )
    return lines


def _findings_section(s: Store, reference: dict) -> list[str]:
    try:
        ours = F.findings(F.trajectory_from_records(s.records, s.label))
    except ValueError:
        return []
    lines = [f"### Findings: {s.label}", ""]
    if s.reference_key:
        paper = F.paper_findings(s.reference_key, reference)
        lines += ["| finding | ours | paper (Xu 2026) | |", "|---|---|---|---|"]
        for row in F.compare(ours, paper):
            flag = {True: "match", False: "**MISMATCH**", None: "n/a"}[row["match"]]
            lines.append(f"| {row['finding']} | {_fmt(row['ours'])} | {_fmt(row['paper'])} | {flag} |")
        lines.append("")
        lines.append(
            f"Our induction milestone uses rule `{ours['induction_rule']}`; the paper's figure is its published milestone "
            "(the release carries only >= 30x counts per revision)."
        )
    else:
        lines += ["| finding | value |", "|---|---|"]
        for key in (
            "sink_fraction_ge_10pct",
            "sink_fraction_ge_50pct",
            "induction_formed",
            "induction_to_sink_gap",
            "final_sink_fraction",
            "l0_l1_floor",
            "recall_67pct",
        ):
            lines.append(f"| {key} | {_fmt(ours.get(key))} |")
    if ours["recall"] and any(r is not None for r in ours["recall"]):
        lines += [
            "",
            "Recall of the final >= 50x induction set per revision: "
            + ", ".join(f"{rev}: {_fmt(r)}" for rev, r in zip(F.trajectory_from_records(s.records).revisions, ours["recall"])),
        ]
    if ours["pr_lead"]:
        lines += [
            "",
            "PR rising before induction selectivity crosses 50x (per head of the final set):",
            "",
            "| head | PR >= 1.5x first | selectivity >= 50x | lead |",
            "|---|---|---|---|",
        ]
        for h in ours["pr_lead"]:
            lines.append(f"| {h['head']} | {_tokens(h['pr_jump_tokens'])} | {_tokens(h['selectivity_50x_tokens'])} | {_fmt(h['lead'])} |")
    return lines + [""]


def build_report(stores: Sequence[str | os.PathLike], out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``report.md`` and its PNG figures; returns the markdown path."""
    loaded = [Store(p) for p in stores]
    out = Path(out_dir) if out_dir else loaded[0].path / "report"
    out.mkdir(parents=True, exist_ok=True)
    reference = F.load_reference()
    figures = [
        figure_sink_heads(loaded, out, reference),
        figure_final_layers(loaded, out, reference),
        figure_sink_rate(loaded, out),
        figure_prefix(loaded, out),
        figure_stages(loaded, out),
    ]
    heatmaps = [n for i, s in enumerate(loaded) for n in figure_heatmaps(s, out, i)]
    md = ["# sinkwatch report", ""]
    md += ["Stores: " + ", ".join(f"`{s.path}` ({s.label}, {len(s.records)} records)" for s in loaded), ""]
    for name in figures:
        if name:
            md += [f"![{name}]({name})", ""]
    for s in loaded:
        md += [f"## {s.label}", ""] + _trajectory_table(s) + [""]
        if s.failed:
            md += (
                ["Failed revisions (recorded with their reason; rerun to retry):", ""]
                + [f"- `{rev}`: {err}" for rev, err in s.failed.items()]
                + [""]
            )
        if s.events:
            md += ["Stage events:", ""] + [f"- {e['message']} (evidence: {e.get('evidence')})" for e in s.events] + [""]
        md += _findings_section(s, reference)
    if heatmaps:
        md += ["## Layer x head heatmaps", ""] + [f"![{n}]({n})" for n in heatmaps] + [""]
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n")
    return path
