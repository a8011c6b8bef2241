"""``sinkwatch report STORE [STORE ...]``: markdown + PNG figures from replay stores or live runs.

Several stores overlay in one set of figures (the paper compares three models side by side). For a
store whose model has published figures, the paper's trajectory is drawn beside ours (dashed) and
the findings table flags every mismatch.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import findings as F
from .records import best_induction_score, n_sink_heads, softmax_heads
from .replay import failed_revisions, merged_records, read_ablation
from .replay.provenance import flagged_records, moved_branches
from .replay.store import stored_records
from .reporting.figures import _plt, record_heatmaps, save
from .reporting.jsonl import read_jsonl
from .stages import INDUCTION_STATES, P0_STAGES


class Store:
    def __init__(self, path: str | os.PathLike, reference: dict | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"no store at {self.path} (a directory with records.jsonl)")
        merged = merged_records(self.path)
        if not merged:
            raise ValueError(f"{self.path} holds no successful records yet")
        # a revision named without a step (main, a tag) is measured but is no point of the trajectory:
        # listed apart, never drawn at step 0 (which cost the whole store its token axis)
        self.outside = [r for r in merged if r.get("step") is None and r.get("tokens") is None and r.get("revision")]
        self.records = [r for r in merged if r not in self.outside] or merged
        if self.records is merged:
            self.outside = []
        stored = stored_records(self.path)
        self.flagged = flagged_records(stored)  # duplicates: kept out of the trajectory, listed in the report
        self.moved = moved_branches(stored)  # branches measured at more than one commit
        self.run = None  # a parallel run's name when this is one series of a store (``series``)
        self.model = self.records[-1]["model"]
        self.label = self.model if self.model not in ("", None) else self.path.name
        self.failed = failed_revisions(self.path)
        self.events = read_jsonl(self.path / "events.jsonl")
        self.is_replay = any(r.get("revision") for r in self.records)
        self.reference_key = F.reference_key(self.model, reference)
        # records from before sinkwatch named the protocol were made with sinkwatch's
        self.protocols = sorted({r.get("protocol", "sinkwatch") for r in self.records})
        self.protocol = self.protocols[0] if len(self.protocols) == 1 else "mixed: " + ", ".join(self.protocols)
        self.has_tokens = all(r.get("tokens") is not None for r in self.records)
        self.ablation = read_ablation(self.path)  # DIR/ablation.json: the group ablation, when the replay ran it
        self.segment_note = ""

    def segments(self) -> list[Store]:
        """One series per run and configuration in this store, each drawn as its own line.

        A live store read in file order is cut where ``config_hash`` changes (a resume with other
        probes or stage thresholds: the numbers are not comparable across it) and where the step does
        not increase (a run appended to an earlier run's file, as sinkwatch did before each new run
        moved the old store aside). Replay stores, and a live store that is one segment, are themselves.
        """
        if self.is_replay:
            return [self]
        rows = [r for r in read_jsonl(self.path / "records.jsonl") if "n_layers" in r]  # file order, not sorted by step
        runs = split_segments(rows)
        if len(runs) < 2:
            return [self]
        hashes = [seg[0].get("config_hash") for seg in runs]
        out = []
        for i, (seg, events) in enumerate(zip(runs, _events_by_segment(self.events, runs))):
            part = copy.copy(self)
            part.records = seg
            part.events = events
            part.has_tokens = all(r.get("tokens") is not None for r in seg)
            tag = hashes[i] or "no config_hash"
            part.label = f"{self.label} [{tag}]" if hashes.count(hashes[i]) == 1 else f"{self.label} [{tag} run {i + 1}]"
            part.segment_note = (
                f"segment {i + 1} of {len(runs)} in this store: config_hash {hashes[i]}, steps {seg[0].get('step')}-{seg[-1].get('step')}"
            )
            out.append(part)
        return out

    def series(self) -> list[Store]:
        """One view per run (OLMo-2's stage-2 ingredients are parallel runs): the main run, then each
        parallel run as its own series, labelled ``label [run]``; a store with one run is itself."""
        runs = list(dict.fromkeys(r.get("run") for r in self.records))
        if len(runs) <= 1:
            return [self]
        out = []
        for run in runs:
            view = copy.copy(self)
            view.records = [r for r in self.records if r.get("run") == run]
            view.run = run
            view.label = self.label if run is None else f"{self.label} [{run}]"
            view.has_tokens = all(r.get("tokens") is not None for r in view.records)
            if run is not None:  # what belongs to the store as a whole is reported once, with the main run
                view.outside, view.flagged, view.moved, view.failed, view.events, view.ablation = [], [], {}, {}, [], None
            out.append(view)
        return out

    def x(self) -> list[float]:
        """Tokens seen (the step when tokens are unknown: ``has_tokens`` says which)."""
        return [float(r["tokens"]) if r.get("tokens") is not None else float(r.get("step") or 0) for r in self.records]

    def column(self, key: str, fn=lambda v: v) -> list:
        return [fn(r[key]) if r.get(key) is not None else None for r in self.records]


def split_segments(records: Sequence[dict]) -> list[list[dict]]:
    """Live records in file order, cut into runs of one ``config_hash`` and increasing steps."""
    runs: list[list[dict]] = []
    for r in records:
        prev = runs[-1][-1] if runs else None
        step, prev_step = r.get("step"), (prev or {}).get("step")
        if (
            prev is None
            or r.get("config_hash") != prev.get("config_hash")
            or (step is not None and prev_step is not None and step <= prev_step)
        ):
            runs.append([])
        runs[-1].append(r)
    return runs


def _events_by_segment(events: Sequence[dict], runs: Sequence[Sequence[dict]]) -> list[list[dict]]:
    """Each event under the segment whose steps hold its step. Segments whose step ranges overlap
    (runs appended to one file) cannot be told apart by step: their events stay with the last such
    segment, which says so."""
    spans = [(seg[0].get("step") or 0, seg[-1].get("step") or 0) for seg in runs]
    out: list[list[dict]] = [[] for _ in runs]
    for e in events:
        step = e.get("step") or 0
        hits = [i for i, (a, b) in enumerate(spans) if a <= step <= b]
        out[hits[-1] if hits else len(runs) - 1].append({**e, "ambiguous": True} if len(hits) > 1 else e)
    return out


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
    a1.set_ylabel("sink-head fraction (first-token >= 30x)")
    a2.set_ylabel("induction heads")
    for ax in (a1, a2):
        _xaxis(ax, stores, log)
        _legend(ax)
    a1.set_title("sink-head fraction")
    a2.set_title("induction heads (selectivity screen)")
    fig.tight_layout()
    save(fig, out / "sink_and_induction_heads.png")
    return "sink_and_induction_heads.png"


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
    ax.set_xlabel("layer")
    ax.set_ylabel("sink heads at the final revision")
    entries = len(ax.get_legend_handles_labels()[0])
    ax.set_ylim(0, max(ax.get_ylim()[1], 1) * (1 + 0.12 * entries))  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left")
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
    _xaxis(a2, stores)
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
        _xaxis(ax, stores)
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
            f"{n_sink_heads(r) if 'sink_heads_per_layer' in r else '—'} | "
            f"{_fmt(r.get('n_induction_ge30'))} | {_fmt(r.get('n_induction_ge50'))} | "
            f"{_fmt(best)} | {_fmt(r.get('icl_score'))} | {r.get('p0_stage')} | {r.get('induction_state')} |"
        )
    return lines


def _value(v: Any, has_tokens: bool) -> str:
    """A milestone: tokens (6.29B), or the step when the store's tokens are unknown."""
    if isinstance(v, float) and not has_tokens:
        return f"step {v:.0f}"
    return _fmt(v)


def _provenance_lines(s: Store) -> list[str]:
    """Revisions outside the trajectory, duplicated weights and moved branches (issue 20)."""
    lines: list[str] = []
    if s.outside:
        lines += ["Outside the trajectory (named, but no step in the name: measured, not drawn):", ""]
        lines += ["| revision | commit | sink rate | ind >= 50x |", "|---|---|---|---|"]
        lines += [
            f"| {r['revision']} | {(r.get('commit') or '—')[:10]} | {_fmt(r.get('sink_rate'))} | {_fmt(r.get('n_induction_ge50'))} |"
            for r in s.outside
        ] + [""]
    if s.flagged:
        groups = {tuple(r.get("duplicate_group") or [r["revision"]]): r for r in s.flagged}
        lines += [
            "Duplicated weights: revisions whose weight files are another revision's (identical, or a shared file such as a "
            "shard: EleutherAI/pythia#205, #206). Flagged as a group, not drawn, left out of the stages:",
            "",
            "| revisions | duplicate_of | kind |",
            "|---|---|---|",
        ]
        lines += [f"| {', '.join(g)} | {r['duplicate_of']} | {r.get('duplicate_kind', '—')} |" for g, r in groups.items()] + [""]
    if s.moved:
        lines += ["Moved branches (measured again at the new commit; the latest record is the one drawn):", ""]
        lines += ["| revision | commits |", "|---|---|"]
        lines += [f"| {rev} | moved: {' -> '.join(c[:10] for c in commits)} |" for rev, commits in s.moved.items()] + [""]
    return lines


PROTOCOL_NOTE = {
    "paper": "the paper's protocol (SPEC §8): its numbers are directly comparable",
    "sinkwatch": (
        "sinkwatch's protocol (float32 statistics, PR over every sequence): NOT the paper's precision choices, so heads near "
        "30x/50x can differ from its tables for that reason alone; rerun with `--protocol paper` for a like-for-like comparison"
    ),
    "custom": (
        "a recipe's measurement changed by options (its probes or dtype; see what changed below): NOT the recipe's "
        "protocol, so its numbers are not the paper's even where the precision choices are"
    ),
}


def _findings_section(s: Store, reference: dict) -> list[str]:
    try:
        ours = F.findings(F.trajectory_from_records(s.records, s.label))
    except ValueError:
        return []
    lines = [f"### Findings: {s.label}", ""]
    na = ours.get("not_applicable", {})

    def shown(key, v):
        return f"n/a ({na[key]})" if key in na and v is None else _value(v, s.has_tokens)

    if s.reference_key:
        paper = F.paper_findings(s.reference_key, reference)
        lines += [f"Our numbers: {PROTOCOL_NOTE.get(s.protocol, s.protocol)}.", ""]
        lines += ["| finding | rule | ours | paper (Xu 2026) | |", "|---|---|---|---|---|"]
        keys = {
            "sink heads >= 10% (tokens)": "sink_fraction_ge_10pct",
            "sink heads >= 50% (tokens)": "sink_fraction_ge_50pct",
            ">= 3 induction heads at 50x (tokens)": "induction_formed",
            "67% recall of final 50x set (tokens)": "recall_67pct",
            "no sink heads in L0/L1 (final)": "l0_l1_floor",
        }
        for row in F.compare(ours, paper):
            flag = {True: "match", False: "**MISMATCH**", None: "n/a"}[row["match"]]
            if row["match"] is False and s.protocol != "paper":
                flag += " (sinkwatch protocol)"
            key = keys.get(row["finding"])
            mine = shown(key, row["ours"]) if key else _value(row["ours"], s.has_tokens)
            lines.append(f"| {row['finding']} | {row.get('rule') or '—'} | {mine} | {_fmt(row['paper'])} | {flag} |")
        lines.append("")
        lines.append(
            f"Both induction milestones apply the paper's rule (`{ours['induction_rule']}`: >= 3 heads at induction >= 50x, "
            "counted over all heads; the paper's from its per-head tables). The stage events and the `induction` column above "
            "are the live tracker's rule (docs/stages.md), a different question: the two need not agree."
        )
    else:
        lines += [f"Protocol: {s.protocol}.", "", "| finding | rule | value |", "|---|---|---|"]
        for key in (
            "sink_fraction_ge_10pct",
            "sink_fraction_ge_50pct",
            "induction_formed",
            "induction_to_sink_gap",
            "final_sink_fraction",
            "l0_l1_floor",
            "recall_67pct",
        ):
            rule = F.RULES.get(key, "")
            if key == "induction_formed" and ours["induction_rule"] != "ge50":
                rule = "ge30-proxy: >= 3 heads at >= 30x"
            lines.append(f"| {key} | {rule or '—'} | {shown(key, ours.get(key))} |")
        lines += [
            "",
            "`induction_formed` is the paper's rule (>= 3 heads at >= 50x in the selectivity screen); the stage events and the "
            "`induction` column are the live tracker's (docs/stages.md): the two answer different questions and need not agree.",
        ]
    if ours["recall"] and any(r is not None for r in ours["recall"]):
        lines += [
            "",
            "Recall of the final >= 50x induction set per revision: "
            + ", ".join(f"{rev}: {_fmt(r)}" for rev, r in zip(F.trajectory_from_records(s.records).revisions, ours["recall"])),
        ]
    lines += _pr_lead_lines(ours, s, reference)
    return lines + [""]


def _pr_lead_lines(ours: dict, s: Store, reference: dict) -> list[str]:
    """Finding 5 (PR rises before selectivity crosses 50x), ours beside the paper's released PR."""
    paper = F.findings(F.trajectory_from_reference(s.reference_key, reference))["pr_lead"] if s.reference_key else []
    if not ours["pr_lead"] and not paper:
        why = ours.get("not_applicable", {}).get("pr_lead")
        return ["", f"PR lead: n/a ({why})."] if why else []
    lines = [
        "",
        f"PR rising before induction selectivity crosses 50x (rule: {F.RULES['pr_lead']}); the paper's column is computed from "
        "its released PR trajectories (n = 500, float16)"
        + (f"; ours: PR over {s.records[-1].get('pr_sequences', 'all')} sequences, protocol {s.protocol}" if ours["pr_lead"] else "")
        + ":",
        "",
        "| head | ours: PR >= 1.5x first | ours: >= 50x | ours: lead | paper: PR >= 1.5x first | paper: >= 50x | paper: lead |",
        "|---|---|---|---|---|---|---|",
    ]
    mine = {h["head"]: h for h in ours["pr_lead"]}
    theirs = {h["head"]: h for h in paper}
    for head in sorted(set(mine) | set(theirs), key=lambda n: tuple(int(x) for x in n[1:].split("H"))):
        a, b = mine.get(head, {}), theirs.get(head, {})
        lines.append(
            f"| {head} | {_value(a.get('pr_jump_tokens'), s.has_tokens)} | {_value(a.get('selectivity_50x_tokens'), s.has_tokens)} | "
            f"{_fmt(a.get('lead'))} | {_tokens(b.get('pr_jump_tokens'))} | {_tokens(b.get('selectivity_50x_tokens'))} | "
            f"{_fmt(b.get('lead'))} |"
        )
    return lines


# ---- group ablation ----------------------------------------------------------------------------------------
def _head_key(name: str) -> tuple[int, int]:
    layer, head = name[1:].split("H")
    return int(layer), int(head)


def _named_difference(ours: Sequence[str], paper: Sequence[str]) -> str:
    """`same`, or the heads only one side has, named."""
    a, b = set(ours), set(paper)
    if a == b:
        return "same"
    parts = []
    if a - b:
        parts.append("only ours: " + ", ".join(sorted(a - b, key=_head_key)))
    if b - a:
        parts.append("only the paper's: " + ", ".join(sorted(b - a, key=_head_key)))
    return "; ".join(parts)


def _ablation_lines(s: Store, reference: dict) -> list[str]:
    """Our group ablation (``ablation.json``) beside the paper's: top-1 of baseline, circuit and
    matched random, and the two head sets with their differences named."""
    a = s.ablation
    if a is None:
        return []
    lines = [f"### Group ablation: {s.label}", ""]
    if a.get("status") != "ok":
        return lines + [f"The ablation at `{a.get('revision')}` failed ({a.get('error')}); rerun the replay to retry.", ""]
    lines += [
        f"Ours: the >= {a['threshold']:g}x induction set of `{a['revision']}` ({a['screen']}), ablated in {a['dtype']} "
        f"under the {a['protocol']} protocol; control: {a['control_rule']}. Top-1 of the target B over the valid probe sequences.",
        "",
    ]
    if a.get("note"):
        lines += [f"Note: {a['note']}.", ""]
    paper = (reference["models"].get(s.reference_key) or {}) if s.reference_key else {}
    pub = paper.get("ablation_top1")
    if not pub:
        lines += ["| | top-1 | heads |", "|---|---|---|"]
        lines.append(f"| baseline | {_fmt(a['baseline']['top1'])} | |")
        lines.append(f"| circuit ablated | {_fmt(a['ablated']['top1'])} | {', '.join(a['heads']) or 'none'} |")
        lines.append(f"| matched random | {_fmt(a['control']['top1'])} | {', '.join(a['control_heads']) or 'none'} |")
        return lines + [""]
    if a["protocol"] != "paper":
        lines += [f"Ours: {PROTOCOL_NOTE['sinkwatch']}; its control is not the paper's draw either.", ""]
    paper_circuit = list(paper.get("induction_circuit_ge50") or [])
    paper_control = [f"L{l}H{h}" for l, hs in (pub.get("matched_random_heads") or {}).items() for h in hs]
    lines += [
        f"Paper (Xu 2026): `{pub.get('revision')}`, {pub.get('dtype')}, {pub.get('n_examples')} sequences ({pub.get('source')}).",
        "",
        "| | ours: top-1 | paper: top-1 | ours: heads | paper: heads | heads differ |",
        "|---|---|---|---|---|---|",
        f"| baseline | {_fmt(a['baseline']['top1'])} | {_fmt(pub.get('baseline'))} | | | |",
    ]
    for label, ours_key, pub_key, ours_heads, paper_heads in (
        ("circuit ablated", "ablated", "circuit_ablated", a["heads"], paper_circuit),
        ("matched random", "control", "matched_random", a["control_heads"], paper_control),
    ):
        lines.append(
            f"| {label} | {_fmt(a[ours_key]['top1'])} | {_fmt(pub.get(pub_key))} | {', '.join(ours_heads) or 'none'} | "
            f"{', '.join(sorted(paper_heads, key=_head_key)) or 'none'} | {_named_difference(ours_heads, paper_heads)} |"
        )
    return lines + [""]


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
    fig.tight_layout()
    name = f"head_comparison_{index}.png"
    save(fig, out / name)
    return name


def _head_comparison_lines(s: Store, comps: list[dict], figure: str | None) -> list[str]:
    if not comps:
        return []
    lines = [f"### Head by head vs the paper: {s.label}", "", f"Ours: {PROTOCOL_NOTE.get(s.protocol, s.protocol)}.", ""]
    if figure:
        lines += [f"![{figure}]({figure})", ""]
    lines += ["| revision | largest relative deviation | heads whose best class or 30x/50x/100x side differs |", "|---|---|---|"]
    for c in comps:
        w = c["largest_deviation"]
        worst = f"{w['deviation']:.2%} ({w['head']} {w['class']}: ours {w['ours']:.4g}, paper {w['paper']:.4g})" if "head" in w else "0"
        diffs = "; ".join(f"{d['head']} {d['what']}" for d in c["differences"]) or "none"
        lines.append(f"| {c['revision']} | {worst} | {diffs} |")
    return lines + [""]


def build_report(
    stores: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike | None = None,
    *,
    reference: dict | None = None,
    per_head: dict | None = None,
) -> Path:
    """Write ``report.md`` and its PNG figures; returns the markdown path.

    ``reference`` / ``per_head``: the published figures and per-head tables to compare with
    (default: the packaged Xu 2026 data).
    """
    reference = reference or F.load_reference()
    loaded = [part for p in stores for part in Store(p, reference).segments()]
    out = Path(out_dir) if out_dir else loaded[0].path / "report"
    out.mkdir(parents=True, exist_ok=True)
    loaded = [view for s in loaded for view in s.series()]  # a parallel run is its own series
    figures = [
        figure_sink_heads(loaded, out, reference),
        figure_final_layers(loaded, out, reference),
        figure_sink_rate(loaded, out),
        figure_prefix(loaded, out),
        figure_stages(loaded, out),
    ]
    heatmaps = [n for i, s in enumerate(loaded) for n in figure_heatmaps(s, out, i)]
    md = ["# sinkwatch report", ""]
    md += ["Stores:", ""] + [
        f"- `{s.path}`: {s.label}, {len(s.records)} records, protocol **{s.protocol}**" + (f" ({s.segment_note})" if s.segment_note else "")
        for s in loaded
    ] + [""]
    for name in figures:
        if name:
            md += [f"![{name}]({name})", ""]
    for i, s in enumerate(loaded):
        md += [f"## {s.label}", "", f"Protocol: **{s.protocol}** — {PROTOCOL_NOTE.get(s.protocol, 'see SPEC §8')}.", ""]
        changes = list(dict.fromkeys(c for r in s.records for c in r.get("protocol_changes") or []))
        if changes:
            md += [f"What changed from recipe protocol {s.records[-1].get('protocol_base')}: " + "; ".join(changes) + ".", ""]
        if not s.has_tokens:
            md += [f"Tokens seen are unknown for these records: figures show the {_x_label([s])}.", ""]
        md += _trajectory_table(s) + [""]
        md += _provenance_lines(s)
        if s.failed:
            md += (
                ["Failed revisions (recorded with their reason; rerun to retry):", ""]
                + [f"- `{rev}`: {err}" for rev, err in s.failed.items()]
                + [""]
            )
        if s.events:
            md += ["Stage events (the live tracker's rules, docs/stages.md):", ""]
            md += [
                f"- {e['message']} (evidence: {e.get('evidence')})"
                + (" (several runs in this file reached this step: the event may be another run's)" if e.get("ambiguous") else "")
                for e in s.events
            ] + [""]
        md += _findings_section(s, reference)
        md += _ablation_lines(s, reference)
        comps = head_comparisons(s, per_head)
        md += _head_comparison_lines(s, comps, figure_head_comparison(s, comps, out, i))
    if heatmaps:
        md += ["## Layer x head heatmaps", ""] + [f"![{n}]({n})" for n in heatmaps] + [""]
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n")
    return path


# ---- the paper's published data alone --------------------------------------------------------------------
def build_paper_report(out_dir: str | os.PathLike) -> Path:
    """``sinkwatch report --paper``: what the paper's released tables say, without a replay — the
    three trajectories, findings by its own rules, per-layer sink counts, PR of the final circuits and
    the ablations — plus ``findings.json`` (issue 13, Deliver 4). Returns the markdown path."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reference = F.load_reference()
    ph = F.load_per_head()
    models = list(reference["models"])
    trajs = {m: F.trajectory_from_reference(m, reference, ph) for m in models}
    summary = F.published_findings_json(reference)
    (out / "findings.json").write_text(json.dumps(summary, indent=1) + "\n")
    plt = _plt()

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, m in enumerate(models):
        t = trajs[m]
        _plot(a1, t.tokens, t.sink_fraction, color=f"C{i}", marker="o", label=m)
        _plot(a2, t.tokens, t.ind_ge50, color=f"C{i}", marker="o", label=f"{m} >= 50x")
        _plot(a2, t.tokens, t.ind_ge30, color=f"C{i}", marker="^", ls="--", alpha=0.5, label=f"{m} >= 30x")
    a2.axhline(F.MIN_HEADS, color="k", lw=0.5, ls=":")
    a1.set_ylabel("sink-head fraction (first-token >= 30x)")
    a2.set_ylabel("induction heads (all heads counted)")
    for ax in (a1, a2):
        _xaxis(ax, None, log=True, label="tokens seen")
        _legend(ax)
    fig.suptitle("Xu 2026, published per-head tables", fontsize=10)
    fig.tight_layout()
    save(fig, out / "paper_trajectories.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        per = reference["models"][m]["final_sink_heads_per_layer"]
        ax.bar(np.arange(len(per)) + i * width, per, width, color=f"C{i}", label=f"{m.split('/')[-1]} @ {trajs[m].revisions[-1]}")
    ax.set_xlabel("layer")
    ax.set_ylabel("sink heads at the final revision")
    ax.set_ylim(0, ax.get_ylim()[1] * (1 + 0.12 * len(models)))  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save(fig, out / "paper_final_sink_heads_per_layer.png")

    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        t = trajs[m]
        for k, name in enumerate(t.final_induction_set):
            l, h = (int(x) for x in name[1:].split("H"))
            _plot(ax, t.tokens, [p[l, h] for p in t.pr], color=f"C{k}", marker="o", label=name)
        ax.set_title(m.split("/")[-1], fontsize=9)
        ax.set_ylabel("PR (n = 500, float16)")
        _xaxis(ax, None, log=True, label="tokens seen")
        _legend(ax)
    fig.tight_layout()
    save(fig, out / "paper_pr_of_final_circuit.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    kinds = ("baseline", "circuit", "matched_random")
    for k, kind in enumerate(kinds):
        vals = [summary[m]["ablation_top1"][kind] or 0.0 for m in models]
        ax.bar(np.arange(len(models)) + k * 0.27, vals, 0.27, label=kind)
    ax.set_xticks(np.arange(len(models)) + 0.27, [m.split("/")[-1] for m in models], fontsize=8)
    ax.set_ylabel("top-1 accuracy on B (induction probe)")
    ax.set_title("group ablation of the >= 50x induction circuit (float16, final checkpoint)", fontsize=9)
    _legend(ax)
    fig.tight_layout()
    save(fig, out / "paper_ablation.png")

    md = [
        "# Xu 2026: the published data alone",
        "",
        "Everything below is computed from sinkwatch's packaged copy of the paper's released tables "
        "(sinkwatch/data/xu2026_developmental.json, xu2026_per_head.json) by the paper's own rules — no replay. "
        "`findings.json` beside this file holds the milestones and ablations.",
        "",
        "![paper_trajectories.png](paper_trajectories.png)",
        "",
        "![paper_final_sink_heads_per_layer.png](paper_final_sink_heads_per_layer.png)",
        "",
        "![paper_pr_of_final_circuit.png](paper_pr_of_final_circuit.png)",
        "",
        "![paper_ablation.png](paper_ablation.png)",
        "",
        "| model | induction formed (rule) | published milestone | sink heads >= 10% | >= 50% | final >= 50x circuit | "
        "ablation top-1: baseline / circuit / matched random |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in models:
        f = summary[m]
        published = reference.get("milestones_tokens_b", {}).get("induction_formed_ge3_heads_ge50", {}).get(m.split("/")[-1])
        a = f["ablation_top1"]
        md.append(
            f"| {m} | {_tokens((f['induction_formed_b'] or 0) * 1e9)} ({f['induction_rule']}: >= 3 heads at >= 50x, all heads) | "
            f"{_tokens(published * 1e9) if published is not None else '—'} | {_tokens((f['sink_ge10pct_b'] or 0) * 1e9)} | "
            f"{_tokens((f['sink_ge50pct_b'] or 0) * 1e9)} | {', '.join(trajs[m].final_induction_set)} | "
            f"{a['baseline']} / {a['circuit']} / {a['matched_random']} |"
        )
    md += ["", "## Per revision (counts over all heads)", ""]
    for m in models:
        t = trajs[m]
        md += [f"### {m}", "", "| revision | tokens | sink heads | ind >= 30x | ind >= 50x | >= 50x set |", "|---|---|---|---|---|---|"]
        for k, rev in enumerate(t.revisions):
            md.append(
                f"| {rev} | {_tokens(t.tokens[k])} | {t.sink_heads[k]} | {t.ind_ge30[k]} | {t.ind_ge50[k]} | "
                f"{', '.join(t.induction_sets[k])} |"
            )
        leads = F.findings(t)["pr_lead"]
        md += ["", f"PR lead (Finding 5; {F.RULES['pr_lead']}), from the released PR trajectories (n = 500, float16):", ""]
        md += ["| head | PR >= 1.5x first | selectivity >= 50x | lead |", "|---|---|---|---|"]
        md += [
            f"| {h['head']} | {_tokens(h['pr_jump_tokens'])} | {_tokens(h['selectivity_50x_tokens'])} | {_fmt(h['lead'])} |" for h in leads
        ]
        sweep = ph["ablation_sweep"].get(m)
        if sweep:
            md += [
                "",
                f"Ablation sweep at `{sweep['revision']}` ({sweep['n_examples']} sequences, float16; one RandomState(123) across "
                "the thresholds 2, 10, 30, 50, 100):",
                "",
                "| condition | heads | top-1 | top-5 | loss |",
                "|---|---|---|---|---|",
            ]
            md += [f"| {r['name']} | {r['n_ablated']} | {r['acc_top1']} | {r['acc_top5']} | {r['loss']:.3f} |" for r in sweep["results"]]
        md.append("")
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n")
    return path
