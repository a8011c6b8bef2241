"""The comparison with the paper (Xu 2026): our findings beside its findings, the PR lead beside its
released PR, our group ablation beside its ablation, each saying under which protocol ours was measured."""

from __future__ import annotations

from collections.abc import Sequence

from ..metrics import head_index
from . import findings as F
from .markdown import _fmt, _tokens, _value
from .store import Store

PROTOCOL_NOTE = {
    "paper": "the paper's protocol (docs/design.md §8): its numbers are directly comparable",
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
        traj = F.trajectory_from_records(s.records, s.label)
        ours = F.findings(traj)
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
            + ", ".join(f"{rev}: {_fmt(r)}" for rev, r in zip(traj.revisions, ours["recall"])),
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
    for head in sorted(set(mine) | set(theirs), key=head_index):
        a, b = mine.get(head, {}), theirs.get(head, {})
        lines.append(
            f"| {head} | {_value(a.get('pr_jump_tokens'), s.has_tokens)} | {_value(a.get('selectivity_50x_tokens'), s.has_tokens)} | "
            f"{_fmt(a.get('lead'))} | {_tokens(b.get('pr_jump_tokens'))} | {_tokens(b.get('selectivity_50x_tokens'))} | "
            f"{_fmt(b.get('lead'))} |"
        )
    return lines


# ---- group ablation ----------------------------------------------------------------------------------------
def _named_difference(ours: Sequence[str], paper: Sequence[str]) -> str:
    """`same`, or the heads only one side has, named."""
    a, b = set(ours), set(paper)
    if a == b:
        return "same"
    parts = []
    if a - b:
        parts.append("only ours: " + ", ".join(sorted(a - b, key=head_index)))
    if b - a:
        parts.append("only the paper's: " + ", ".join(sorted(b - a, key=head_index)))
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
            f"{', '.join(sorted(paper_heads, key=head_index)) or 'none'} | {_named_difference(ours_heads, paper_heads)} |"
        )
    return lines + [""]
