"""``build_report``: the markdown of one or more stores, assembled from the figures and tables."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from . import findings as F
from .axes import _x_label
from .figures import (
    figure_final_layers,
    figure_heatmaps,
    figure_p0_profile,
    figure_prefix,
    figure_sink_heads,
    figure_sink_rate,
    figure_stages,
)
from .heads import _head_comparison_lines, figure_head_comparison, head_comparisons
from .markdown import _image, _write_markdown
from .paper import PROTOCOL_NOTE, _ablation_lines, _findings_section
from .store import Store
from .tables import _provenance_lines, _trajectory_table


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
        figure_p0_profile(loaded, out),
        figure_prefix(loaded, out),
        figure_stages(loaded, out),
    ]
    heatmaps = [n for i, s in enumerate(loaded) for n in figure_heatmaps(s, out, i)]
    md = ["# sinkwatch report", ""]
    md += (
        ["Stores:", ""]
        + [
            f"- `{s.path}`: {s.label}, {len(s.records)} records, protocol **{s.protocol}**"
            + (f" ({s.segment_note})" if s.segment_note else "")
            for s in loaded
        ]
        + [""]
    )
    for name in figures:
        if name:
            md += [_image(name), ""]
    for i, s in enumerate(loaded):
        md += [f"## {s.label}", "", f"Protocol: **{s.protocol}** — {PROTOCOL_NOTE.get(s.protocol, 'see docs/design.md §8')}.", ""]
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
        md += ["## Layer x head heatmaps", ""] + [_image(n) for n in heatmaps] + [""]
    return _write_markdown(out, md)
