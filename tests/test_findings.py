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


def test_induction_formation_by_the_paper_rule_over_all_heads():
    """>= 3 heads at >= 50x counted over all heads (the per-head tables): 6.29B / 23B / 20B, the
    paper's milestones. The >= 30x proxy the old release forced gave OLMo 10B."""
    assert ours(PYTHIA)["induction_formed"] == pytest.approx(6.29e9)
    assert ours(OLMO)["induction_formed"] == pytest.approx(23e9)
    assert ours(OLMOE)["induction_formed"] == pytest.approx(20e9)
    assert {ours(m)["induction_rule"] for m in (PYTHIA, OLMO, OLMOE)} == {"ge50"}
    proxy = F.trajectory_from_reference(OLMO)
    proxy.ind_ge50 = None
    assert F.findings(proxy)["induction_formed"] == pytest.approx(10e9) and F.findings(proxy)["induction_rule"] == "ge30-proxy"
    # the published milestones agree with the computed ones, and the gap function gives 11x and 21x
    for m in (PYTHIA, OLMO, OLMOE):
        assert F.paper_findings(m)["induction_formed"] == pytest.approx(ours(m)["induction_formed"])
    assert round(F.paper_findings(OLMO)["induction_to_sink_gap"]) == 11
    assert round(F.paper_findings(OLMOE)["induction_to_sink_gap"]) == 21


def test_pr_lead_from_the_released_pr_trajectories():
    """Finding 5: Pythia L4H4's PR is 27.35 at 0.536B tokens (step256), 11.7x earlier in tokens than
    its induction selectivity reaches 50x (6.29B)."""
    traj = F.trajectory_from_reference(PYTHIA)
    assert traj.pr[4][4, 4] == pytest.approx(27.3469)  # revision index 4 = step256
    lead = {h["head"]: h for h in F.findings(traj)["pr_lead"]}
    assert lead["L4H4"]["pr_jump_tokens"] == pytest.approx(0.537e9)
    assert lead["L4H4"]["selectivity_50x_tokens"] == pytest.approx(6.29e9)
    assert lead["L4H4"]["lead"] == pytest.approx(6.29 / 0.537)


def test_findings_from_records_match_the_reference_loader():
    """Records carrying the same counts give the same findings as the reference trajectory."""
    ref = F.load_reference()["models"][OLMO]
    sets = F.trajectory_from_reference(OLMO).induction_sets  # the >= 50x sets of the per-head tables
    records = []
    for r, ge50 in zip(ref["revisions"], sets):
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
                "n_induction_ge50": len(ge50),
                "induction_heads": ge50,
                "selectivity": {"induction": np.zeros((16, 16)).tolist()},
                "pr": None,
            }
        )
    mine = F.findings(F.trajectory_from_records(records))
    paper = F.findings(F.trajectory_from_reference(OLMO))
    for key in ("sink_fraction_ge_10pct", "sink_fraction_ge_50pct", "induction_formed", "final_sink_fraction"):
        assert mine[key] == pytest.approx(paper[key]), key
    assert mine["largest_jump"]["to_revision"] == paper["largest_jump"]["to_revision"]
    assert mine["recall_67pct"] == pytest.approx(23e9)  # 2 of the final 3 heads (L2H11, L4H12) first at 23B
    rows = {r["finding"]: r for r in F.compare(mine, F.paper_findings(OLMO))}
    assert rows["sink heads >= 50% (tokens)"]["match"] is True
    assert rows[">= 3 induction heads at 50x (tokens)"]["match"] is True  # 23B both, by the same rule
    assert "50x" in rows[">= 3 induction heads at 50x (tokens)"]["rule"]  # every row names the rule it applies
    # the published 67%-recall milestone (10B) used the >= 30x sets: flagged against the >= 50x rule's 23B
    assert rows["67% recall of final 50x set (tokens)"]["match"] is False
    proxy = [dict(r, n_induction_ge50=r["n_induction_ge30"]) for r in records]
    row = {r["finding"]: r for r in F.compare(F.findings(F.trajectory_from_records(proxy)), F.paper_findings(OLMO))}
    assert row[">= 3 induction heads at 50x (tokens)"]["match"] is False  # 10B vs 23B: flagged


def test_reference_keys():
    """Model names map to their published reference keys; unknown models to None."""
    assert F.reference_key("pythia-1b") == PYTHIA
    assert F.reference_key("allenai/OLMoE-1B-7B-0924") == OLMOE
    assert F.reference_key("gpt2") is None


def test_findings_that_do_not_apply_are_na_with_the_reason():
    """11.12: a model with no sink head at all used to get `l0_l1_floor: yes`."""
    t = F.Trajectory(
        label="x",
        revisions=["a", "b"],
        tokens=[0.0, 10.0],
        sink_heads=[0, 0],
        total_heads=8,
        ind_ge30=[0, 0],
        ind_ge50=[0, 0],
        induction_sets=[[], []],
        final_sink_per_layer=[0, 0, 0, 0],
    )
    f = F.findings(t)
    assert f["l0_l1_floor"] is None and "no sink head" in f["not_applicable"]["l0_l1_floor"]
    assert f["induction_formed"] is None and "50x" in f["not_applicable"]["induction_formed"]
    assert "never reach 50%" in f["not_applicable"]["sink_fraction_ge_50pct"]
    assert "pr_lead" in f["not_applicable"] and "induction_to_sink_gap" in f["not_applicable"]
