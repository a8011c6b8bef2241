"""The packaged per-head tables (xu2026_per_head.json) against the per-revision figures
(xu2026_developmental.json), and ``sinkwatch report --paper`` from the packaged data alone."""

import json

import numpy as np
import pytest

from sinkwatch import findings as F
from sinkwatch import metrics as M
from sinkwatch.cli import main

REF = F.load_reference()
PH = F.load_per_head()
POINTS = [(m, r["revision"]) for m in REF["models"] for r in REF["models"][m]["revisions"]]


def test_every_published_point_has_a_per_head_table():
    """3 models x 10 revisions = 30 (model, revision) points, two counts each: 60 published figures."""
    assert len(POINTS) == 30 and all(rev in PH["per_revision"][m] for m, rev in POINTS)


@pytest.mark.parametrize("model,revision", POINTS)
def test_per_head_counts_equal_the_per_revision_figures(model, revision):
    sel = F.paper_selectivity(model, revision)
    fig = next(r for r in REF["models"][model]["revisions"] if r["revision"] == revision)
    assert int((sel["first"] >= M.SINK_HEAD_MIN_SELECTIVITY).sum()) == fig["sink_heads"]
    assert int((sel["induction"] >= M.INDUCTION_HEAD_MIN_SELECTIVITY).sum()) == fig["ind_ge30"]


@pytest.mark.parametrize("model", list(REF["models"]))
def test_final_per_layer_sink_counts_and_circuit_match(model):
    final = REF["models"][model]["revisions"][-1]["revision"]
    sel = F.paper_selectivity(model, final)
    assert (sel["first"] >= 30).sum(axis=1).tolist() == REF["models"][model]["final_sink_heads_per_layer"]
    assert M.head_names(sel["induction"] >= 50) == REF["models"][model]["induction_circuit_ge50"]
    # the listed heads' best class, recomputed by the paper's rule, equals the class it published
    extra = PH["per_revision"][model][final]["heads_extra"]
    best = M.best_class(sel)
    names = {"previous-token": "previous", "duplicate-token": "duplicate", "first-token": "first"}
    for (l, h, *_), e in zip(PH["per_revision"][model][final]["heads"], extra):
        assert best[l, h] == names.get(e[2], e[2]), (l, h)


def test_report_paper_writes_the_published_report_and_findings_json(tmp_path):
    out = tmp_path / "paper"
    assert main(["report", "--paper", "--out", str(out)]) == 0
    data = json.loads((out / "findings.json").read_text())
    expect = {"EleutherAI/pythia-1b": 6.29, "allenai/OLMo-1B-0724-hf": 23.0, "allenai/OLMoE-1B-7B-0924": 20.0}
    for model, b in expect.items():
        f = data[model]
        assert f["induction_formed_b"] == pytest.approx(b) and f["induction_rule"] == "ge50"
        assert set(f) == {"induction_formed_b", "induction_rule", "sink_ge50pct_b", "sink_ge10pct_b", "ablation_top1"}
        assert set(f["ablation_top1"]) == {"baseline", "circuit", "matched_random"}
    assert data["EleutherAI/pythia-1b"]["ablation_top1"]["matched_random"] == 0.0425  # the induction circuit's control
    assert data["allenai/OLMoE-1B-7B-0924"]["sink_ge50pct_b"] == 419
    text = (out / "report.md").read_text()
    for needle in ("published data", "6.29B", "23B", "20B", "0.0425", "L4H4"):
        assert needle in text, needle
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs and all((out / p).stat().st_size > 1000 for p in pngs)
    assert np.isfinite(data["allenai/OLMo-1B-0724-hf"]["sink_ge10pct_b"])
