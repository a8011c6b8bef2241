"""The per-revision tables of one store: its trajectory, and the revisions kept out of it
(outside the trajectory, duplicated weights, moved branches)."""

from __future__ import annotations

from ..records import best_induction_score, n_sink_heads
from .markdown import _fmt, _tokens
from .store import Store


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


def _provenance_lines(s: Store) -> list[str]:
    """Revisions outside the trajectory, duplicated weights and moved branches."""
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
    if s.unverified:
        lines += ["Unverified weights (drawn, but their weights could not be read to check them against the other revisions'):", ""]
        lines += [f"- `{r['revision']}`: {r['weights_unverified']}" for r in s.unverified] + [""]
    if s.moved:
        lines += ["Moved branches (measured again at the new commit; the latest record is the one drawn):", ""]
        lines += ["| revision | commits |", "|---|---|"]
        lines += [f"| {rev} | moved: {' -> '.join(c[:10] for c in commits)} |" for rev, commits in s.moved.items()] + [""]
    return lines
