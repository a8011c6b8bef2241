"""The findings code, checked on the published trajectories themselves (Xu 2026's released figures)."""

import numpy as np
import pytest

from sinkwatch import findings as F

PYTHIA, OLMO, OLMOE = "EleutherAI/pythia-1b", "allenai/OLMo-1B-0724-hf", "allenai/OLMoE-1B-7B-0924"


def ours(model):
    return F.findings(F.trajectory_from_reference(model))


def test_sink_saturation_milestones_are_recovered():
    """The sink-fraction milestones of the three published trajectories are recovered."""
    assert ours(PYTHIA)["sink_fraction_ge_50pct"] == pytest.approx(299.89e9)
    assert ours(OLMO)["sink_fraction_ge_50pct"] == pytest.approx(264e9)
    assert ours(OLMOE)["sink_fraction_ge_50pct"] == pytest.approx(419e9)
    assert ours(PYTHIA)["sink_fraction_ge_10pct"] == pytest.approx(6.29e9)
    assert ours(OLMO)["sink_fraction_ge_10pct"] == pytest.approx(264e9)
    assert ours(OLMOE)["sink_fraction_ge_10pct"] == pytest.approx(41e9)


def test_olmo_transition_is_one_abrupt_jump():
    """OLMo's largest sink jump is the published 7.4% -> 70.3% between the named revisions."""
    jump = ours(OLMO)["largest_jump"]
    assert round(jump["from"] * 100, 1) == 7.4 and round(jump["to"] * 100, 1) == 70.3
    assert (jump["from_revision"], jump["to_revision"]) == ("step56000-tokens117B", "step126000-tokens264B")


def test_the_l0_l1_floor_holds_in_all_three_models():
    """No sink heads in layers 0 and 1 at the end of all three trajectories."""
    for m in (PYTHIA, OLMO, OLMOE):
        assert ours(m)["l0_l1_floor"] is True


def test_induction_formation_and_the_token_gaps():
    # from the released >= 30x counts (the release has no per-revision >= 50x counts):
    """Induction milestones and the induction-to-sink token gaps match the paper's."""
    assert ours(PYTHIA)["induction_formed"] == pytest.approx(6.29e9)
    assert ours(OLMOE)["induction_formed"] == pytest.approx(20e9)
    assert ours(OLMO)["induction_formed"] == pytest.approx(10e9)  # the paper's 23B needs >= 50x counts
    assert ours(OLMO)["induction_rule"] == "ge30 proxy"
    # with the published milestones (6.29B / 23B / 20B), the same gap function gives 11x and 21x
    assert F.paper_findings(OLMO)["induction_formed"] == pytest.approx(23e9)
    assert round(F.paper_findings(OLMO)["induction_to_sink_gap"]) == 11
    assert round(F.paper_findings(OLMOE)["induction_to_sink_gap"]) == 21
    assert F.paper_findings(PYTHIA)["induction_formed"] == pytest.approx(6.29e9)


def test_findings_from_records_match_the_reference_loader():
    """Records carrying the same counts give the same findings as the reference trajectory."""
    ref = F.load_reference()["models"][OLMO]
    records = []
    for r in ref["revisions"]:
        per_layer = [0] * 16
        for i in range(r["sink_heads"]):
            per_layer[2 + i % 14] += 1  # spread over layers 2..15
        records.append(
            {
                "model": OLMO,
                "revision": r["revision"],
                "tokens": int(r["tokens_b"] * 1e9),
                "n_layers": 16,
                "n_heads": 16,
                "sink_heads_per_layer": per_layer,
                "n_induction_ge30": r["ind_ge30"],
                "n_induction_ge50": r["ind_ge30"],
                "induction_heads": [f"L2H{i}" for i in range(r["ind_ge30"])],
                "selectivity": {"induction": np.zeros((16, 16)).tolist()},
                "pr": None,
            }
        )
    mine = F.findings(F.trajectory_from_records(records))
    paper = F.findings(F.trajectory_from_reference(OLMO))
    for key in ("sink_fraction_ge_10pct", "sink_fraction_ge_50pct", "induction_formed", "final_sink_fraction"):
        assert mine[key] == pytest.approx(paper[key]), key
    assert mine["largest_jump"]["to_revision"] == paper["largest_jump"]["to_revision"]
    assert mine["recall_67pct"] == pytest.approx(10e9)  # 2 of the final 3 heads present at 10B
    rows = {r["finding"]: r for r in F.compare(mine, F.paper_findings(OLMO))}
    assert rows["sink heads >= 50% (tokens)"]["match"] is True
    assert rows[">= 3 induction heads at 50x (tokens)"]["match"] is False  # 10B (records) vs 23B: flagged
    assert rows["67% recall of final 50x set (tokens)"]["match"] is True


def test_reference_keys():
    """Model names map to their published reference keys; unknown models to None."""
    assert F.reference_key("pythia-1b") == PYTHIA
    assert F.reference_key("allenai/OLMoE-1B-7B-0924") == OLMOE
    assert F.reference_key("gpt2") is None
