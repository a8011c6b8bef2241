"""Stages and events (docs/stages.md): planted circuits, the paper's published trajectories, a real
training trajectory, and the tracker's hysteresis."""

import json

import numpy as np
import planted
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sinkwatch import InductionProbe, Monitor, RepeatedRandomProbe, StageConfig, StageTracker
from sinkwatch import findings as F
from sinkwatch.stages import (
    INDUCTION_STATES,
    P0_RANK,
    P0_RULES,
    P0_STAGES,
    _Lean,
    _P0Facts,
    classify_induction,
    classify_p0,
    induction_holds,
    p0_holds,
)


def probe_planted(model):
    monitor = Monitor([InductionProbe(n=32, seq_len=128), RepeatedRandomProbe(n=8, seq_len=64)])
    return monitor, monitor.probe(model).to_record()


@pytest.mark.parametrize(
    "build, stage",
    [
        (planted.p0_final, "final"),
        (planted.p0_early, "early"),
        (planted.p0_shifted_position1, "shifted"),
        (planted.p0_transitional_spread, "transitional"),
        (planted.p0_none, "none"),
    ],
)
def test_planted_p0_stages(build, stage):
    """Each planted model is classified in its P0 stage (on the synthetic induction probe, no BOS)."""
    _, record = probe_planted(build())
    assert record["p0_stage_now"] == stage, {k: record[k] for k in ("sink_rate", "sink_profile", "sink_center", "circuit_layer")}
    assert record["p0_anchor"] == ("position" if record["circuit_layer"] is not None else None)


def test_planted_final_measurements():
    """The planted models' position-0 measurements have the values they were built with: block 0's
    MLP amplifies position 0 (p0_final) or block 2's does (p0_early), from that block on."""
    _, r = probe_planted(planted.p0_final())
    assert r["circuit_layer"] == 0 and min(r["p0_norm_ratio"]) > 20 and min(r["p0_direction_consistency"]) > 0.99
    assert r["p0_emergence_block"] == 0 and r["p0_persistence"] == 1.0 and r["p0_concentration"] == 1.0
    assert r["rho_max"] == max(r["p0_norm_ratio"]) and r["p0_norm_ratio_embeddings"] == pytest.approx(1.0, abs=0.05)
    assert min(r["p0_direction_consistency_centered"]) > 0.99
    assert r["sink_heads_per_layer"] == [0, 0, 3, 3]  # the L0/L1 floor, later layers sink
    assert r["sink_rate_per_layer"] == [0.0, 0.0, 1.0, 1.0]
    _, early = probe_planted(planted.p0_early())
    assert early["circuit_layer"] == early["p0_emergence_block"] == 2 and early["p0_norm_ratio"][1] < 2
    assert early["p0_concentration"] == 0.0
    _, moved = probe_planted(planted.p0_shifted_position1())
    assert moved["sink_center"] == 1 and moved["sink_rate"] == 0.0 and moved["sink_profile"][1] == 0.5
    _, spread = probe_planted(planted.p0_transitional_spread())
    assert spread["sink_positions"] == 3


def test_planted_induction_circuit_is_formed_and_ablation_removes_copying():
    """A planted induction circuit is 'formed', and ablating either half removes copying."""
    model = planted.induction_circuit()
    monitor, r = probe_planted(model)
    assert r["induction_state_now"] == "formed"
    assert r["induction_heads"] == ["L1H0"] and r["previous_token_heads"] == ["L0H0"]
    assert r["best_class"][1][0] == "induction" and r["best_class"][0][0] == "previous"
    assert r["icl_score"] < -5
    res = monitor.ablate(model, ["L0H0", "L1H0"])
    assert res["baseline"]["top1"] > 0.9
    assert res["ablated"]["top1"] < 0.1 and res["ablated"]["loss"] > res["baseline"]["loss"] + 3
    assert res["control"]["top1"] > 0.9  # a matched random pair changes nothing
    for only in (["L0H0"], ["L1H0"]):  # either half of the circuit is necessary
        assert monitor.ablate(model, only)["ablated"]["top1"] < 0.1


def test_planted_transition_fires_once_through_the_tracker():
    """none -> final, then final again: one event, at the second probe that holds it."""
    monitor = Monitor([InductionProbe(n=16, seq_len=128)])
    tracker = StageTracker(monitor.config.stages)
    events = []
    for model in (planted.p0_none(), planted.p0_final(), planted.p0_final(), planted.p0_final()):
        events += tracker.update(monitor.probe(model).to_record())
    p0 = [e for e in events if e.timeline == "p0"]
    assert [(e.previous, e.stage) for e in p0] == [("none", "final")]
    assert tracker.p0_stage == "final"
    visited = tracker.visited["p0"]
    assert [(v["stage"], v["probes"]) for v in visited] == [("none", 1), ("final", 3)]


# ---- a real trajectory ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trajectory(trajectory_run):
    return trajectory_run[0]


def first_step(records, rule, state="formed"):
    cfg = StageConfig(induction_rule=rule)
    return next((r["step"] for r in records if classify_induction(r, cfg)[0] == state), None)


@pytest.mark.parametrize("rule", ["prefix", "selectivity"])
def test_trajectory_induction_forms_and_the_tracker_reports_it(trajectory, rule):
    """On a training trajectory the tracker declares 'forming' then 'formed' once, at the rule's step."""
    cfg = StageConfig(induction_rule=rule)
    tracker = StageTracker(cfg)
    events = [e for r in trajectory for e in tracker.update(dict(r)) if e.timeline == "induction"]
    assert classify_induction(trajectory[0], cfg)[0] == "absent"
    formed = [e for e in events if e.stage == "formed"]
    assert len(formed) == 1, [e.key for e in events]
    # the event names the probe where the rule's heads appear, confirmed by the next probe's hold rule
    assert formed[0].first_met_step == first_step(trajectory, rule)
    assert formed[0].step == formed[0].first_met_step + 100 * (cfg.patience - 1)
    assert tracker.induction_state == "formed"
    # 'forming' is the early warning: it is declared before 'formed'
    forming = [e for e in events if e.stage == "forming"]
    assert len(forming) == 1 and forming[0].first_met_step < formed[0].first_met_step


def test_trajectory_prefix_rule_precedes_the_paper_rule(trajectory):
    """The prefix rule fires before the paper's 50x selectivity rule."""
    prefix, paper = first_step(trajectory, "prefix"), first_step(trajectory, "selectivity")
    assert prefix is not None and paper is not None
    assert prefix < paper, (prefix, paper)
    at_prefix = next(r for r in trajectory if r["step"] == prefix)
    assert at_prefix["n_induction_ge50"] == 0  # copying whole segments before any 50x head
    final = trajectory[-1]
    assert final["n_induction_ge50"] >= 1 and final["icl_score"] < -2


# ---- the paper's published trajectories -------------------------------------------------------------
PAPER_MILESTONES_B = F.PAPER_INDUCTION_MILESTONES_B
published_records = F.published_stage_records


@pytest.mark.parametrize("model", list(PAPER_MILESTONES_B))
def test_published_trajectories_declare_induction_at_the_papers_milestone(model):
    """The paper's three per-revision tables through the tracker at the live defaults: 'formed' is
    declared at the revision after the paper's milestone and names it (first_met_tokens), once,
    and never undone. (Forward-only patience declared OLMo formed at 264B, 'since 117B'.)"""
    records = published_records(model)
    tracker = StageTracker()
    events = [e for r in records for e in tracker.update(r) if e.timeline == "induction"]
    formed = [e for e in events if e.stage == "formed"]
    assert len(formed) == 1, [e.message() for e in events]
    milestone = round(PAPER_MILESTONES_B[model] * 1e9)
    assert formed[0].first_met_tokens == milestone
    tokens = [r["tokens"] for r in records]
    assert formed[0].tokens == tokens[tokens.index(milestone) + 1]
    assert f"{milestone:,}" in formed[0].message()
    assert all(r["induction_state"] == "formed" for r in records[tokens.index(milestone) + 1 :])
    assert not [e for e in events if e.regression]
    # the milestone is the paper's own rule (findings.induction_formed) on the same tables
    assert F.induction_formed(F.trajectory_from_reference(model))[0] == milestone


def test_published_olmo_dips_are_held_not_undone():
    """OLMo's >= 50x head count dips to 2 at 52B and 1,350B (3 at >= 30x): the hold rule keeps 'formed'."""
    records = published_records("allenai/OLMo-1B-0724-hf")
    tracker = StageTracker()
    for r in records:
        tracker.update(r)
    dips = [r for r in records if r["induction_state_now"] != "formed" and r["induction_state"] == "formed"]
    assert [r["tokens"] for r in dips] == [52 * 10**9, 1350 * 10**9]  # at 52B the hold rule confirmed it
    assert all(induction_holds(r, "formed", tracker.config) for r in dips)
    visited = {v["stage"]: v for v in tracker.visited["induction"]}
    assert visited["forming"]["first_tokens"] == 10 * 10**9 and visited["forming"]["last_tokens"] == 1350 * 10**9


# ---- tracker semantics on synthetic records -----------------------------------------------------
def synthetic_record(step, p0_level, ind_level, jitter):
    """A minimal record whose now-stages are (roughly) the given levels, with noise near thresholds.
    p0_level: 0 none, 1 early (weak sink), 2 transitional (two sinks), 3 final or deep (circuit depth
    jitters), 4 shifted."""
    L, H = 4, 4
    profile = [0.0] * 8
    centre, circuit = 0, None
    if p0_level == 1:
        profile[0] = 0.02 + jitter * 0.01  # hovers around sink_rate_floor
    if p0_level >= 2:
        profile[0] = 0.5 + 0.3 * jitter  # around established_sink_rate's hold band
    if p0_level == 2:
        profile[1] = profile[0] * (0.25 + 0.1 * jitter)  # around second_sink_ratio
    if p0_level == 3:
        circuit = 0 if jitter > -0.5 else 2
    if p0_level == 4:
        profile[0], profile[1], centre, circuit = 0.0, 0.6, 1, 1
    sel = np.zeros((L, H))
    if ind_level >= 1:
        sel[1, 1] = 30 + 2 * jitter
    if ind_level >= 2:
        sel[2, 0] = 50 + 3 * jitter
    return {
        "step": step, "tokens": step * 1000, "n_layers": L, "n_heads": H,
        "sink_rate": profile[0], "sink_profile": profile, "sink_center": centre, "circuit_layer": circuit,
        "selectivity": {"induction": sel.tolist()},
    }  # fmt: skip


def holds(timeline, record, stage, cfg):
    return p0_holds(record, stage, cfg) if timeline == "p0" else induction_holds(record, stage, cfg)


def rank(timeline, stage):
    return P0_RANK[stage] if timeline == "p0" else INDUCTION_STATES.index(stage)


records_strategy = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2), st.floats(-1, 1)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(records_strategy, st.integers(1, 4), st.data())
def test_tracker_is_a_schmitt_trigger(seq, patience, data):
    """Every declared change is backed by the probes: entered where the stage's rule was met and held
    by the next patience-1 probes; a declared stage is left (on the P0 timeline in any direction, on the
    induction timeline downwards) only after `patience` probes in a row fail its hold rule; every declared change fires one event (a
    re-entry after a regression too, so the events and the records' stages never disagree); resume is exact."""
    cfg = StageConfig(patience=patience)
    tracker = StageTracker(cfg)
    records = [synthetic_record(10 * i, p, q, j) for i, (p, q, j) in enumerate(seq)]
    all_events = []
    declared = {"p0": ["none"], "induction": ["absent"]}
    for r in records:
        evs = tracker.update(r)
        all_events += [(len(declared["p0"]) - 1, e) for e in evs]
        declared["p0"].append(r["p0_stage"])
        declared["induction"].append(r["induction_state"])
    for t, e in all_events:
        tl = e.timeline
        start = next(i for i, r in enumerate(records) if r["step"] == e.first_met_step)
        assert e.step == records[t]["step"] and start <= t
        now = records[start][f"{'p0_stage' if tl == 'p0' else 'induction_state'}_now"]
        assert rank(tl, now) >= rank(tl, e.stage) if tl == "induction" else now == e.stage  # the rule was met there
        assert all(holds(tl, records[i], e.stage, cfg) for i in range(start, t + 1))  # ... and held since
        assert t - start + 1 >= patience
        if tl == "p0" or rank(tl, e.stage) <= rank(tl, e.previous):  # leaving a stage: its hold rule failed `patience` times
            assert all(not holds(tl, records[i], e.previous, cfg) for i in range(t - patience + 1, t + 1))
    for tl in ("p0", "induction"):  # the declared stage changes exactly at the events, re-entries included
        seq_ = declared[tl]
        changes = [(i, f"{tl}:{seq_[i]}->{seq_[i + 1]}") for i in range(len(records)) if seq_[i + 1] != seq_[i]]
        assert changes == [(t, e.key) for t, e in all_events if e.timeline == tl]
    assert [(f["key"], f["step"]) for f in tracker.fired] == [(e.key, e.step) for _, e in all_events]

    # a tracker restored from its serialised state continues exactly as the original
    cut = data.draw(st.integers(0, len(records)))
    first = StageTracker(cfg)
    replay_events = []
    for r in records[:cut]:
        replay_events += first.update(dict(r))
    restored = StageTracker.from_state_dict(json.loads(json.dumps(first.state_dict())))
    for r in records[cut:]:
        replay_events += restored.update(dict(r))
    assert [e.to_dict() for e in replay_events] == [e.to_dict() for _, e in all_events]
    assert restored.state_dict() == tracker.state_dict()


def test_one_noisy_probe_neither_declares_nor_undoes():
    """formed for two probes is declared; one empty probe keeps it; two in a row undo it (a WARN regression)."""
    tracker = StageTracker(StageConfig(patience=2))
    levels = [0, 2, 0, 2, 2, 0, 2, 0, 0]
    events = [(i, e) for i, lv in enumerate(levels) for e in tracker.update(synthetic_record(i, 0, lv, 0.0))]
    assert [(i, e.key, e.level) for i, e in events] == [
        (4, "induction:absent->formed", "WARN"),
        (8, "induction:formed->absent", "WARN"),
    ]
    assert events[0][1].first_met_step == 3  # the run that confirmed it, not the lone probe at 1


def test_a_stage_seen_for_one_probe_is_kept_in_visited():
    """A one-probe 'transitional' between 'early' and 'early' is never declared but is reported."""
    tracker = StageTracker(StageConfig(patience=2))
    for i, lv in enumerate([1, 1, 2, 1, 1]):
        tracker.update(synthetic_record(i, lv, 0, 1.0))  # a sink of 0.03, past none's hold band (0.025)
    assert tracker.p0_stage == "early"
    seen = {v["stage"]: v for v in tracker.visited["p0"]}
    once = {"first_step": 2, "first_tokens": 2000, "last_step": 2, "last_tokens": 2000, "probes": 1}
    assert seen["transitional"] == {"stage": "transitional", **once}


def test_noise_inside_the_hold_band_never_flaps():
    """Noise around an entry threshold that stays inside the stage's hold band declares the stage once
    and never leaves it: one event per timeline in 200 probes."""
    tracker = StageTracker(StageConfig(patience=2))
    rng = np.random.RandomState(0)
    events = []
    for i in range(200):  # sink rate 0.017-0.028 around the 0.02 floor (P0 band 0.016-0.025); the best head 49.1-52.4x around 50x
        events += tracker.update(synthetic_record(i, 1, 2, rng.uniform(-0.3, 0.8)))
    assert sorted(e.key for e in events) == ["induction:absent->formed", "p0:none->early"]


def test_a_stage_re_entered_after_a_regression_fires_again():
    """forming, lost for good, then forming again: three events, and the records' stages agree with them
    (the demo's seed 1 did this: an early blip at steps 500-800, induction for real from 1300)."""
    tracker = StageTracker(StageConfig(patience=2))
    levels = [0, 1, 1, 0, 0, 1, 1, 2, 2]
    events = [(i, e) for i, lv in enumerate(levels) for e in tracker.update(synthetic_record(i, 0, lv, 0.0))]
    assert [(i, e.key) for i, e in events] == [
        (2, "induction:absent->forming"),
        (4, "induction:forming->absent"),
        (6, "induction:absent->forming"),
        (8, "induction:forming->formed"),
    ]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(0, 1), min_size=8, max_size=8),
    st.integers(0, 7),
    st.one_of(st.none(), st.integers(0, 5)),
)
def test_p0_rules_partition_every_record_and_hold_rules_are_weaker(profile, centre, layer):
    """Exactly one P0 rule holds for any record, and every stage's rule implies its hold rule."""
    cfg = StageConfig()
    view = {"sink_rate": profile[0], "sink_profile": profile, "sink_center": centre, "circuit_layer": layer}
    exact = [s for s, rule in P0_RULES.items() if rule(_P0Facts(view, cfg, bos=False, lean=_Lean(None)))]
    assert len(exact) == 1, exact
    assert classify_p0(view, cfg)[0] == exact[0] and p0_holds(view, exact[0], cfg)


def test_stage_config_validates():
    """StageConfig refuses bad thresholds; a tracker refuses state saved under other thresholds."""
    with pytest.raises(ValueError, match="induction_rule"):
        StageConfig(induction_rule="both")
    with pytest.raises(ValueError, match="patience"):
        StageConfig(patience=0)
    with pytest.raises(ValueError, match="min_heads"):
        StageConfig(min_heads=0)
    with pytest.raises(TypeError, match="finite"):
        StageConfig(circuit_min_norm_ratio=float("nan"))
    with pytest.raises(ValueError, match="weaker"):
        StageConfig(prefix_forming_score=0.9)
    with pytest.raises(ValueError, match="hold_factor"):
        StageConfig(hold_factor=1.5)
    with pytest.raises(ValueError, match="established_sink_rate"):
        StageConfig(established_sink_rate=0.01)
    assert StageConfig().heads_needed(16, 8) == 3  # Pythia-1B: the paper's rule
    assert StageConfig().heads_needed(2, 4) == 1
    with pytest.raises(ValueError, match="different thresholds"):
        StageTracker(StageConfig(patience=3)).load_state_dict(StageTracker().state_dict())
    old = {"config": {"secondary_sink_floor": 0.05}, "recent": {}}  # saved by the forward-only tracker
    with pytest.raises(ValueError, match="new tracker segment"):
        StageTracker.from_state_dict(old)


def test_classify_p0_rules_directly():
    """classify_p0 applies each P0 rule as docs/stages.md states it."""
    cfg = StageConfig()
    base = {"sink_rate": 0.4, "sink_profile": [0.4] + [0.0] * 7, "sink_center": 0}
    assert classify_p0({**base, "circuit_layer": 1}, cfg)[0] == "final"
    assert classify_p0({**base, "circuit_layer": 5}, cfg)[0] == "deep"  # an established sink, a deep circuit
    assert classify_p0({**base, "circuit_layer": None}, cfg)[0] == "deep"
    weak = {"sink_rate": 0.1, "sink_profile": [0.1] + [0.0] * 7, "sink_center": 0}
    assert classify_p0({**weak, "circuit_layer": 5}, cfg)[0] == "early"  # circuit deep, sink rate low
    assert classify_p0({**weak, "circuit_layer": 0}, cfg)[0] == "early"  # final needs the sink level too
    assert classify_p0({**base, "circuit_layer": 0, "sink_center": 1, "sink_profile": [0.0, 0.4] + [0.0] * 6}, cfg)[0] == "shifted"
    assert classify_p0({**base, "circuit_layer": 4, "sink_center": 1, "sink_profile": [0.0, 0.4] + [0.0] * 6}, cfg)[0] == "transitional"
    assert classify_p0({**base, "circuit_layer": 0, "sink_profile": [0.4, 0.1] + [0.0] * 6}, cfg)[0] == "transitional"  # 0.1 = 0.4 / 4
    assert classify_p0({**base, "circuit_layer": 0, "sink_profile": [0.4, 0.09] + [0.0] * 6}, cfg)[0] == "final"  # a faint second
    assert classify_p0({"sink_rate": 0.0, "sink_profile": [0.0] * 8, "sink_center": 0, "circuit_layer": None}, cfg)[0] == "none"
    assert classify_p0({"sink_rate": 0.0, "sink_profile": [0.0] * 8, "sink_center": 0, "circuit_layer": 6}, cfg)[0] == "early"
    assert set(P0_STAGES) == set(P0_RULES)
