"""``sinkwatch report --paper``: the paper's published data alone, no replay."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..metrics import head_index
from ..reporters.figures import _plt
from . import findings as F
from .axes import SINK_FRACTION_LABEL, _final_layers_axes, _legend, _plot, _saved, _xaxis
from .markdown import _fmt, _image, _tokens, _write_markdown


def build_paper_report(out_dir: str | os.PathLike) -> Path:
    """``sinkwatch report --paper``: what the paper's released tables say, without a replay — the
    three trajectories, findings by its own rules, per-layer sink counts, PR of the final circuits and
    the ablations — plus ``findings.json``. Returns the markdown path."""
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
    shown = []  # the figures, in the order the markdown shows them

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, m in enumerate(models):
        t = trajs[m]
        _plot(a1, t.tokens, t.sink_fraction, color=f"C{i}", marker="o", label=m)
        _plot(a2, t.tokens, t.ind_ge50, color=f"C{i}", marker="o", label=f"{m} >= 50x")
        _plot(a2, t.tokens, t.ind_ge30, color=f"C{i}", marker="^", ls="--", alpha=0.5, label=f"{m} >= 30x")
    a2.axhline(F.MIN_HEADS, color="k", lw=0.5, ls=":")
    a1.set_ylabel(SINK_FRACTION_LABEL)
    a2.set_ylabel("induction heads (all heads counted)")
    for ax in (a1, a2):
        _xaxis(ax, None, log=True, label="tokens seen")
        _legend(ax)
    fig.suptitle("Xu 2026, published per-head tables", fontsize=10)
    shown.append(_saved(fig, out, "paper_trajectories.png"))

    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        per = reference["models"][m]["final_sink_heads_per_layer"]
        ax.bar(np.arange(len(per)) + i * width, per, width, color=f"C{i}", label=f"{m.split('/')[-1]} @ {trajs[m].revisions[-1]}")
    _final_layers_axes(ax)
    shown.append(_saved(fig, out, "paper_final_sink_heads_per_layer.png"))

    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        t = trajs[m]
        for k, name in enumerate(t.final_induction_set):
            l, h = head_index(name)
            _plot(ax, t.tokens, [p[l, h] for p in t.pr], color=f"C{k}", marker="o", label=name)
        ax.set_title(m.split("/")[-1], fontsize=9)
        ax.set_ylabel("PR (n = 500, float16)")
        _xaxis(ax, None, log=True, label="tokens seen")
        _legend(ax)
    shown.append(_saved(fig, out, "paper_pr_of_final_circuit.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    kinds = ("baseline", "circuit", "matched_random")
    for k, kind in enumerate(kinds):
        vals = [summary[m]["ablation_top1"][kind] or 0.0 for m in models]
        ax.bar(np.arange(len(models)) + k * 0.27, vals, 0.27, label=kind)
    ax.set_xticks(np.arange(len(models)) + 0.27, [m.split("/")[-1] for m in models], fontsize=8)
    ax.set_ylabel("top-1 accuracy on B (induction probe)")
    ax.set_title("group ablation of the >= 50x induction circuit (float16, final checkpoint)", fontsize=9)
    _legend(ax)
    shown.append(_saved(fig, out, "paper_ablation.png"))

    md = [
        "# Xu 2026: the published data alone",
        "",
        "Everything below is computed from sinkwatch's packaged copy of the paper's released tables "
        "(sinkwatch/data/xu2026_developmental.json, xu2026_per_head.json) by the paper's own rules — no replay. "
        "`findings.json` beside this file holds the milestones and ablations.",
        "",
        *(line for name in shown for line in (_image(name), "")),
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
    return _write_markdown(out, md)
