"""The paper's developmental findings (Xu 2026), computed by the same functions from our records and
from the published per-revision figures, so the report can put them side by side.

A ``Trajectory`` is the per-revision view both sources share: tokens, sink-head counts (first-token
selectivity >= 30x), induction-head counts (>= 30x, and >= 50x where known), the >= 50x sets, the
per-layer sink heads at the final revision, and (ours only) per-head PR and selectivity.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np

from .. import metrics
from ..records import n_sink_heads, softmax_heads

MIN_HEADS = 3  # the paper's "induction formed": >= 3 heads at >= 50x
RECALL_MILESTONE = 2 / 3


def load_reference() -> dict:
    """The paper's released figures, packaged with sinkwatch."""
    return json.loads(resources.files("sinkwatch.data").joinpath("xu2026_developmental.json").read_text())


_PER_HEAD: dict | None = None


def load_per_head() -> dict:
    """The paper's released per-head tables (sinkwatch/data/xu2026_per_head.json): per model and
    revision every head's six selectivities (``all_heads``) and the 45 listed heads, its ablation
    sweeps, and every head's PR trajectory (n = 500, float16). Read once (600 KB)."""
    global _PER_HEAD
    if _PER_HEAD is None:
        _PER_HEAD = json.loads(resources.files("sinkwatch.data").joinpath("xu2026_per_head.json").read_text())
    return _PER_HEAD


# the per-head json's class names -> sinkwatch's
PAPER_COLUMNS = {
    "induction": "induction",
    "previous": "previous",
    "duplicate": "duplicate",
    "first": "first",
    "self": "self",
    "local": "local",
}


def paper_selectivity(model_key: str, revision: str, per_head: dict | None = None) -> dict[str, np.ndarray]:
    """class -> (L, H) selectivity of every head at one of the paper's revisions (its ``all_heads``)."""
    ph = per_head or load_per_head()
    table = ph["per_revision"][model_key][revision]["all_heads"]
    cols = ph["all_heads_columns"]
    L = max(r[0] for r in table) + 1
    H = max(r[1] for r in table) + 1
    out = {c: np.full((L, H), np.nan) for c in PAPER_COLUMNS.values()}
    for row in table:
        for name, c in PAPER_COLUMNS.items():
            out[c][row[0], row[1]] = row[cols.index(name)]
    return out


def paper_pr(model_key: str, per_head: dict | None = None) -> list[np.ndarray]:
    """The paper's per-head PR (n = 500, float16) at each of its revisions: a list of (L, H)."""
    t = (per_head or load_per_head())["pr_trajectories"][model_key]
    L, H = t["n_layer"], t["num_heads"]
    return [np.array([[t["pr"][f"L{l}_H{h}"][i] for h in range(H)] for l in range(L)]) for i in range(len(t["revisions"]))]


PAPER_INDUCTION_MILESTONES_B = {"EleutherAI/pythia-1b": 6.29, "allenai/OLMo-1B-0724-hf": 23.0, "allenai/OLMoE-1B-7B-0924": 20.0}


def published_stage_records(model_key: str, reference: dict | None = None, per_head: dict | None = None) -> list[dict]:
    """The paper's per-revision tables of ``model_key`` (every head's selectivities and PR) as the records
    the stage tracker reads, one per revision in token order (``step`` is the revision's index)."""
    reference = reference or load_reference()
    per_head = per_head or load_per_head()
    prs = paper_pr(model_key, per_head)
    out = []
    for i, rev in enumerate(reference["models"][model_key]["revisions"]):
        sel = paper_selectivity(model_key, rev["revision"], per_head)
        L, H = sel["induction"].shape
        out.append(
            {
                "step": i, "tokens": round(rev["tokens_b"] * 1e9), "revision": rev["revision"], "n_layers": L, "n_heads": H,
                "selectivity": {k: v.tolist() for k, v in sel.items()}, "pr": prs[i].tolist(),
            }
        )  # fmt: skip
    return out


def reference_key(model: str, reference: dict | None = None) -> str | None:
    """The reference entry for a model id or a short name (``pythia-1b``), or None."""
    ref = reference or load_reference()
    for key in ref["models"]:
        short = key.split("/")[-1].lower()
        if model == key or model.lower() == short or model.split("/")[-1].lower() == short:
            return key
    return None


@dataclass
class Trajectory:
    label: str
    revisions: list[str]
    tokens: list[float]  # tokens seen at each revision
    sink_heads: list[int]
    total_heads: int
    ind_ge30: list[int]
    ind_ge50: list[int] | None = None  # not in the paper's release
    induction_sets: list[list[str]] | None = None  # >= 50x sets per revision (ours)
    final_induction_set: list[str] = field(default_factory=list)
    final_sink_per_layer: list[int] | None = None
    pr: list[np.ndarray] | None = None  # (L, H) per revision
    selectivity: list[np.ndarray] | None = None  # induction selectivity (L, H) per revision
    protocol: str | None = None  # the protocol of the records ("paper", "sinkwatch"; None: the published data)

    @property
    def sink_fraction(self) -> list[float]:
        return [s / self.total_heads for s in self.sink_heads]


def trajectory_from_records(records: Sequence[dict], label: str | None = None) -> Trajectory:
    """From replay (or live) records that carry the induction probe's screen."""
    recs = [r for r in records if "sink_heads_per_layer" in r]
    if not recs:
        raise ValueError("these records have no selectivity screen (run the induction probe) to compute the paper's findings from")
    return Trajectory(
        protocol=recs[-1].get("protocol", "sinkwatch"),
        label=label or recs[0]["model"],
        revisions=[r.get("revision") or f"step{r.get('step')}" for r in recs],
        tokens=[float(r["tokens"]) if r.get("tokens") is not None else float(r.get("step") or 0) for r in recs],
        sink_heads=[n_sink_heads(r) for r in recs],
        total_heads=softmax_heads(recs[0]),  # hybrid stacks: the heads of softmax blocks
        ind_ge30=[int(r["n_induction_ge30"]) for r in recs],
        ind_ge50=[int(r["n_induction_ge50"]) for r in recs],
        induction_sets=[list(r["induction_heads"]) for r in recs],
        final_induction_set=list(recs[-1]["induction_heads"]),
        final_sink_per_layer=list(recs[-1]["sink_heads_per_layer"]),
        pr=[np.asarray(r["pr"], dtype=float) for r in recs] if all(r.get("pr") is not None for r in recs) else None,
        selectivity=[np.asarray(r["selectivity"]["induction"], dtype=float) for r in recs],
    )


def trajectory_from_reference(model_key: str, reference: dict | None = None, per_head: dict | None = None) -> Trajectory:
    """The paper's trajectory: counts from its per-revision figures, and from its per-head tables
    the >= 50x counts and sets over all heads, the induction selectivity and the released PR."""
    ref = reference or load_reference()
    m = ref["models"][model_key]
    revs = m["revisions"]
    ph = per_head or load_per_head()
    names = [r["revision"] for r in revs]
    tables = ph["per_revision"].get(model_key, {})
    induction = [paper_selectivity(model_key, r, ph)["induction"] for r in names] if all(r in tables for r in names) else None
    sets = [metrics.head_names(sel >= metrics.INDUCTION_CIRCUIT_MIN_SELECTIVITY) for sel in induction] if induction else None
    pr_t = ph["pr_trajectories"].get(model_key)
    pr = paper_pr(model_key, ph) if pr_t and pr_t["revisions"] == names else None
    return Trajectory(
        label=f"{model_key} (paper)",
        revisions=names,
        tokens=[r["tokens_b"] * 1e9 for r in revs],
        sink_heads=[r["sink_heads"] for r in revs],
        total_heads=m["layers"] * m["heads_per_layer"],
        ind_ge30=[r["ind_ge30"] for r in revs],
        ind_ge50=[len(s_) for s_ in sets] if sets else None,
        induction_sets=sets,
        final_induction_set=sets[-1] if sets else list(m.get("induction_circuit_ge50", [])),
        final_sink_per_layer=list(m["final_sink_heads_per_layer"]),
        pr=pr,
        selectivity=induction,
    )


# ---- the findings ------------------------------------------------------------------------------------
def first_tokens(tokens: Sequence[float], ok: Sequence[bool]) -> float | None:
    for t, flag in zip(tokens, ok):
        if flag:
            return t
    return None


def sink_milestone(traj: Trajectory, fraction: float) -> float | None:
    """Tokens at the first revision where >= ``fraction`` of all heads are sink heads."""
    return first_tokens(traj.tokens, [f >= fraction for f in traj.sink_fraction])


def largest_jump(traj: Trajectory) -> dict | None:
    """The largest rise of the sink-head fraction between adjacent revisions (the transition's shape)."""
    f = traj.sink_fraction
    if len(f) < 2:
        return None
    i = int(np.argmax(np.diff(f)))
    return {
        "from": f[i],
        "to": f[i + 1],
        "from_tokens": traj.tokens[i],
        "to_tokens": traj.tokens[i + 1],
        "from_revision": traj.revisions[i],
        "to_revision": traj.revisions[i + 1],
    }


def l0_l1_floor(traj: Trajectory) -> bool | None:
    """True when layers 0 and 1 hold no sink head at the final revision."""
    per = traj.final_sink_per_layer
    # a block without softmax attention (null: hybrid stacks) holds no sink head either
    return None if per is None else bool(not per[0] and not per[1])


def induction_formed(traj: Trajectory, min_heads: int = MIN_HEADS) -> tuple[float | None, str]:
    """Tokens where >= ``min_heads`` heads first reach >= 50x, and the rule used.

    The paper's rule counts >= 50x heads over all heads (its per-head tables). Where only >= 30x
    counts exist, they stand in, and the rule says so ("ge30-proxy").
    """
    if traj.ind_ge50 is not None:
        return first_tokens(traj.tokens, [n >= min_heads for n in traj.ind_ge50]), "ge50"
    return first_tokens(traj.tokens, [n >= min_heads for n in traj.ind_ge30]), "ge30-proxy"


def token_gap(later: float | None, earlier: float | None) -> float | None:
    if later is None or earlier is None or earlier <= 0:
        return None
    return later / earlier


def recall_series(traj: Trajectory) -> list[float | None] | None:
    """Recall of the final >= 50x induction set at each revision."""
    if traj.induction_sets is None:
        return None
    return [metrics.circuit_recall(s, traj.final_induction_set) for s in traj.induction_sets]


def pr_lead(traj: Trajectory, factor: float = 1.5) -> list[dict]:
    """Per head of the final >= 50x set: tokens when its PR first reached ``factor`` x its first PR,
    tokens when its selectivity first reached 50x, and the lead (ratio)."""
    if traj.pr is None or traj.selectivity is None:
        return []
    out = []
    for name in traj.final_induction_set:
        l, h = metrics.head_index(name)
        pr = [p[l, h] for p in traj.pr]
        sel = [s[l, h] for s in traj.selectivity]
        base = pr[0]
        t_pr = first_tokens(traj.tokens, [np.isfinite(p) and np.isfinite(base) and p >= factor * base for p in pr])
        t_sel = first_tokens(traj.tokens, [np.isfinite(s) and s >= metrics.INDUCTION_CIRCUIT_MIN_SELECTIVITY for s in sel])
        out.append({"head": name, "pr_jump_tokens": t_pr, "selectivity_50x_tokens": t_sel, "lead": token_gap(t_sel, t_pr)})
    return out


RULES = {
    "induction_formed": "paper: first revision with >= 3 heads at induction >= 50x (all heads)",
    "sink_fraction_ge_10pct": "paper: first revision with >= 10% of heads at first-token >= 30x",
    "sink_fraction_ge_50pct": "paper: first revision with >= 50% of heads at first-token >= 30x",
    "recall_67pct": "paper: first revision holding 2/3 of the final >= 50x set",
    "l0_l1_floor": "paper: layers 0 and 1 hold no sink head at the final revision",
    "pr_lead": "tokens when PR first reached 1.5x its first value vs when induction selectivity reached 50x",
}


def findings(traj: Trajectory) -> dict[str, Any]:
    """The findings of one trajectory; ``not_applicable`` gives, per finding that does not apply, why."""
    formed, rule = induction_formed(traj)
    s10, s50 = sink_milestone(traj, 0.10), sink_milestone(traj, 0.50)
    recall = recall_series(traj)
    floor = l0_l1_floor(traj)
    na: dict[str, str] = {}
    has_sinks = traj.final_sink_per_layer is not None and sum(n or 0 for n in traj.final_sink_per_layer) > 0
    if not has_sinks:
        floor = None
        na["l0_l1_floor"] = "no sink head at all at the final revision: an empty L0/L1 says nothing"
    for key, value, frac in (("sink_fraction_ge_10pct", s10, "10%"), ("sink_fraction_ge_50pct", s50, "50%")):
        if value is None:
            na[key] = f"sink heads never reach {frac} of all heads in these revisions"
    if formed is None:
        na["induction_formed"] = f"fewer than {MIN_HEADS} heads at >= 50x at every revision"
    gap = token_gap(s50, formed)
    if gap is None:
        na["induction_to_sink_gap"] = "needs both milestones"
    leads = pr_lead(traj)
    if not leads:
        na["pr_lead"] = "no per-head PR in these records" if traj.pr is None else "no head at >= 50x at the final revision"
    r67 = first_tokens(traj.tokens, [r is not None and r >= RECALL_MILESTONE - 1e-9 for r in recall]) if recall else None
    if r67 is None:
        na["recall_67pct"] = "no >= 50x induction set at the final revision" if not traj.final_induction_set else "never reached"
    return {
        "sink_fraction_ge_10pct": s10,
        "sink_fraction_ge_50pct": s50,
        "final_sink_fraction": traj.sink_fraction[-1],
        "l0_l1_floor": floor,
        "largest_jump": largest_jump(traj),
        "induction_formed": formed,
        "induction_rule": rule,
        "induction_to_sink_gap": gap,
        "recall": recall,
        "recall_67pct": r67,
        "pr_lead": leads,
        "not_applicable": na,
        "protocol": traj.protocol,
    }


def paper_findings(model_key: str, reference: dict | None = None) -> dict[str, Any]:
    """The paper's numbers: its milestones as published, the rest computed from its trajectories."""
    ref = reference or load_reference()
    computed = findings(trajectory_from_reference(model_key, ref))
    short = model_key.split("/")[-1]
    ms = {name: table.get(short) for name, table in ref.get("milestones_tokens_b", {}).items()}
    b = lambda x: None if x is None else x * 1e9  # noqa: E731
    published = {
        "sink_fraction_ge_10pct": b(ms.get("sink_fraction_ge_10pct")),
        "sink_fraction_ge_50pct": b(ms.get("sink_fraction_ge_50pct")),
        "induction_formed": b(ms.get("induction_formed_ge3_heads_ge50")),
        "recall_67pct": b(ms.get("recall_67pct_of_final_induction_circuit")),
    }
    out = dict(computed)
    out["computed_from_tables"] = {k: computed[k] for k in published}
    out.update({k: v for k, v in published.items() if v is not None})
    out["induction_rule"] = computed["induction_rule"]
    out["induction_to_sink_gap"] = token_gap(out["sink_fraction_ge_50pct"], out["induction_formed"])
    out["ablation_top1"] = ref["models"][model_key].get("ablation_top1")
    return out


# ---- side by side ---------------------------------------------------------------------------------------
def _tokens_match(a: float | None, b: float | None) -> bool | None:
    if a is None or b is None:
        return None if a is b else False
    return math.isclose(a, b, rel_tol=0.02)


def compare(ours: dict, paper: dict) -> list[dict]:
    """Rows (finding, ours, paper, match) with mismatches flagged; match None = not comparable."""
    rows = []

    def add(name, a, b, match, rule=""):
        rows.append({"finding": name, "ours": a, "paper": b, "match": match, "rule": rule})

    for key, label in (
        ("sink_fraction_ge_10pct", "sink heads >= 10% (tokens)"),
        ("sink_fraction_ge_50pct", "sink heads >= 50% (tokens)"),
        ("induction_formed", ">= 3 induction heads at 50x (tokens)"),
        ("recall_67pct", "67% recall of final 50x set (tokens)"),
    ):
        rule = RULES[key] if key != "induction_formed" or ours.get("induction_rule") == "ge50" else "ge30-proxy: >= 3 heads at >= 30x"
        add(label, ours.get(key), paper.get(key), _tokens_match(ours.get(key), paper.get(key)), rule)
    a, b = ours.get("induction_to_sink_gap"), paper.get("induction_to_sink_gap")
    add("sink 50% / induction formed (token gap)", a, b, None if a is None or b is None else abs(math.log(a / b)) < math.log(1.5))
    add(
        "final sink-head fraction",
        ours.get("final_sink_fraction"),
        paper.get("final_sink_fraction"),
        abs(ours["final_sink_fraction"] - paper["final_sink_fraction"]) <= 0.05,
    )
    add(
        "no sink heads in L0/L1 (final)",
        ours.get("l0_l1_floor"),
        paper.get("l0_l1_floor"),
        None if ours.get("l0_l1_floor") is None else ours.get("l0_l1_floor") == paper.get("l0_l1_floor"),
        RULES["l0_l1_floor"],
    )
    ja, jb = ours.get("largest_jump"), paper.get("largest_jump")
    same = None if ja is None or jb is None else (ja["from_revision"] == jb["from_revision"] and ja["to_revision"] == jb["to_revision"])
    add(
        "largest sink jump (between revisions)",
        ja and f"{ja['from']:.1%} -> {ja['to']:.1%} ({ja['from_revision']} -> {ja['to_revision']})",
        jb and f"{jb['from']:.1%} -> {jb['to']:.1%} ({jb['from_revision']} -> {jb['to_revision']})",
        same,
    )
    return rows


# ---- head by head ------------------------------------------------------------------------------------------
THRESHOLD_SIDES = (30.0, 50.0, 100.0)


def paper_listed_heads(model_key: str, revision: str, per_head: dict | None = None) -> list[tuple[int, int]]:
    """The 45 heads the paper lists per revision (one fixed set, ranked by its PR integral)."""
    return [(int(r[0]), int(r[1])) for r in (per_head or load_per_head())["per_revision"][model_key][revision]["heads"]]


def head_comparison(record: dict, model_key: str, per_head: dict | None = None) -> dict | None:
    """Ours vs the paper's selectivity for every listed head and class at one revision.

    Returns None when the paper has no table for the record's revision. Otherwise ``pairs``
    (head, class, ours, paper), the largest relative deviation, and ``differences``: every listed
    head whose best class or side of 30x / 50x / 100x (any class) differs — named, not averaged.
    """
    ph = per_head or load_per_head()
    rev = record.get("revision")
    tables = ph["per_revision"].get(model_key, {})
    if rev not in tables or record.get("selectivity") is None:
        return None
    paper = paper_selectivity(model_key, rev, ph)
    ours = {c: np.asarray(record["selectivity"][c], dtype=float) for c in metrics.SELECTIVITY_CLASSES}
    if ours["induction"].shape != paper["induction"].shape:
        raise ValueError(f"{model_key}@{rev}: our record has {ours['induction'].shape} heads, the paper's table {paper['induction'].shape}")
    ours_best = metrics.best_class(ours)
    paper_best = metrics.best_class(paper)
    pairs, differences = [], []
    worst = {"deviation": 0.0}
    for l, h in paper_listed_heads(model_key, rev, ph):
        name = f"L{l}H{h}"
        for c in metrics.SELECTIVITY_CLASSES:
            a, b = float(ours[c][l, h]), float(paper[c][l, h])
            pairs.append({"head": name, "class": c, "ours": a, "paper": b})
            dev = abs(a - b) / max(abs(b), 1e-12)
            if math.isfinite(dev) and dev > worst["deviation"]:
                worst = {"deviation": dev, "head": name, "class": c, "ours": a, "paper": b}
            for t in THRESHOLD_SIDES:
                if (a >= t) != (b >= t):
                    differences.append(
                        {
                            "head": name,
                            "what": f"{c} {'>=' if a >= t else '<'} {t:g}x (paper {'>=' if b >= t else '<'})",
                            "ours": a,
                            "paper": b,
                        }
                    )
        if ours_best[l, h] != paper_best[l, h]:
            differences.append(
                {"head": name, "what": f"best class {ours_best[l, h]} (paper {paper_best[l, h]})", "ours": None, "paper": None}
            )
    return {
        "revision": rev,
        "pairs": pairs,
        "largest_deviation": worst,
        "differences": differences,
        "protocol": record.get("protocol", "sinkwatch"),
    }


# ---- findings.json --------------------------------------------------------------------------------------------
def published_findings_json(reference: dict | None = None) -> dict:
    """``{"<model id>": {induction_formed_b, induction_rule, sink_ge50pct_b, sink_ge10pct_b,
    ablation_top1: {baseline, circuit, matched_random}}}`` from the packaged published data alone,
    every number computed by the paper's own rules from its tables."""
    ref = reference or load_reference()
    out = {}
    b = lambda x: None if x is None else round(x / 1e9, 6)  # noqa: E731
    for key, m in ref["models"].items():
        f = findings(trajectory_from_reference(key, ref))
        abl = m.get("ablation_top1") or {}
        out[key] = {
            "induction_formed_b": b(f["induction_formed"]),
            "induction_rule": f["induction_rule"],
            "sink_ge50pct_b": b(f["sink_fraction_ge_50pct"]),
            "sink_ge10pct_b": b(f["sink_fraction_ge_10pct"]),
            "ablation_top1": {
                "baseline": abl.get("baseline"),
                "circuit": abl.get("circuit_ablated"),
                "matched_random": abl.get("matched_random"),
            },
        }
    return out
