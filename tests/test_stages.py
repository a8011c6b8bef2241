"""Stages and events (SPEC §6): planted circuits, a real trajectory, and tracker semantics."""

import json

import numpy as np
import planted
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sinkwatch import InductionProbe, Monitor, RepeatedRandomProbe, StageConfig, StageTracker
from sinkwatch.stages import INDUCTION_STATES, P0_STAGES, classify_induction, classify_p0


def probe_planted(model):
    monitor = Monitor([InductionProbe(n=32, seq_len=128), RepeatedRandomProbe(n=8, seq_len=64)])
    return monitor, monitor.probe(model).to_record()


@pytest.mark.parametrize(
    "build, stage",
    [
        (planted.p0_final, "final"),
        (planted.p0_early, "early"),
        (planted.p0_transitional_position1, "transitional"),
        (planted.p0_transitional_spread, "transitional"),
        (planted.p0_none, "none"),
    ],
)
def test_planted_p0_stages(build, stage):
    """Each planted model is classified in its P0 stage."""
    _, record = probe_planted(build())
    assert record["p0_stage_now"] == stage, {k: record[k] for k in ("sink_rate", "sink_profile", "sink_center", "circuit_layer")}


def test_planted_final_measurements():
    """The planted models' position-0 measurements have the values they were built with."""
    _, r = probe_planted(planted.p0_final())
    assert r["circuit_layer"] == 0 and min(r["p0_norm_ratio"]) > 20 and min(r["p0_direction_consistency"]) > 0.99
    assert r["sink_heads_per_layer"] == [0, 0, 3, 3]  # the L0/L1 floor, later layers sink
    assert r["sink_rate_per_layer"] == [0.0, 0.0, 1.0, 1.0]
    _, early = probe_planted(planted.p0_early())
    assert early["circuit_layer"] == 2 and early["p0_norm_ratio"][1] < 2
    _, moved = probe_planted(planted.p0_transitional_position1())
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
    """none -> final, then final again: one event, after `patience` probes."""
    monitor = Monitor([InductionProbe(n=16, seq_len=128)])
    tracker = StageTracker(monitor.config.stages)
    events = []
    for model in (planted.p0_none(), planted.p0_final(), planted.p0_final(), planted.p0_final()):
        events += tracker.update(monitor.probe(model).to_record())
    p0 = [e for e in events if e.timeline == "p0"]
    assert [(e.previous, e.stage) for e in p0] == [("none", "final")]
    assert tracker.p0_stage == "final"


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
    # the event points at the probe where the rule's heads appear, confirmed `patience` probes later
    assert formed[0].since_step == first_step(trajectory, rule)
    assert formed[0].step == formed[0].since_step + 100 * (cfg.patience - 1)
    assert tracker.induction_state == "formed"
    # 'forming' is the early warning: it is declared before 'formed'
    forming = [e for e in events if e.stage == "forming"]
    assert len(forming) == 1 and forming[0].since_step < formed[0].since_step


def test_trajectory_prefix_rule_precedes_the_paper_rule(trajectory):
    """The prefix rule fires before the paper's 50x selectivity rule."""
    prefix, paper = first_step(trajectory, "prefix"), first_step(trajectory, "selectivity")
    assert prefix is not None and paper is not None
    assert prefix < paper, (prefix, paper)
    at_prefix = next(r for r in trajectory if r["step"] == prefix)
    assert at_prefix["n_induction_ge50"] == 0  # copying whole segments before any 50x head
    final = trajectory[-1]
    assert final["n_induction_ge50"] >= 1 and final["icl_score"] < -2


# ---- tracker semantics on synthetic records -----------------------------------------------------
def synthetic_record(step, p0_level, ind_level, jitter):
    """A minimal record whose now-stages are (roughly) the given levels, with noise near thresholds."""
    L, H = 4, 4
    profile = [0.0] * 8
    centre, circuit = 0, None
    if p0_level >= 1:
        profile[0] = 0.02 + jitter * 0.01  # hovers around sink_rate_floor
    if p0_level == 2:
        profile[1] = 0.06
    if p0_level == 3:
        circuit = 0 if jitter > -0.5 else 2
    sel = np.zeros((L, H))
    if ind_level >= 1:
        sel[1, 1] = 30 + 2 * jitter
    if ind_level >= 2:
        sel[2, 0] = 50 + 3 * jitter
    return {
        "step": step, "tokens": step * 1000, "n_layers": L, "n_heads": H,
        "sink_rate": profile[0], "sink_profile": profile, "sink_center": centre, "circuit_layer": circuit,
        "selectivity": {"induction": sel.tolist()},
    }


records_strategy = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 2), st.floats(-1, 1)), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None)
@given(records_strategy, st.integers(1, 4), st.data())
def test_tracker_event_semantics(seq, patience, data):
    """Declared stages follow the per-probe stages after `patience` probes, one event per transition."""
    cfg = StageConfig(patience=patience)
    tracker = StageTracker(cfg)
    records = [synthetic_record(10 * i, p, q, j) for i, (p, q, j) in enumerate(seq)]
    now = {"p0": [], "induction": []}
    declared = {"p0": [], "induction": []}
    all_events = []
    for r in records:
        evs = tracker.update(r)
        all_events += evs
        now["p0"].append(r["p0_stage_now"])
        now["induction"].append(r["induction_state_now"])
        declared["p0"].append(r["p0_stage"])
        declared["induction"].append(r["induction_state"])
    for tl, order in (("p0", P0_STAGES), ("induction", INDUCTION_STATES)):
        idx = [order.index(s) for s in declared[tl]]
        assert idx == sorted(idx), "stages only move forward: no flapping"
        nows = [order.index(s) for s in now[tl]]
        prev = 0
        for t, d in enumerate(idx):
            window = nows[max(0, t - patience + 1) : t + 1]
            if d > prev:  # declared only after `patience` agreeing probes
                assert len(window) == patience and min(window) >= d
            if len(window) == patience and min(window) > prev:  # and then promptly
                assert d >= min(window)
            prev = d
        changes = sum(1 for a, b in zip([0] + idx, idx) if b > a)
        assert len([e for e in all_events if e.timeline == tl]) == changes
    keys = [e.key for e in all_events]
    assert len(keys) == len(set(keys)), "each transition fires once"
    assert [f["key"] for f in tracker.fired] == keys

    # a tracker restored from its serialised state continues exactly as the original
    cut = data.draw(st.integers(0, len(records)))
    first = StageTracker(cfg)
    replay_events = []
    for r in records[:cut]:
        replay_events += first.update(dict(r))
    restored = StageTracker.from_state_dict(json.loads(json.dumps(first.state_dict())))
    for r in records[cut:]:
        replay_events += restored.update(dict(r))
    assert [e.to_dict() for e in replay_events] == [e.to_dict() for e in all_events]
    assert restored.state_dict() == tracker.state_dict()


def test_noise_around_a_threshold_never_flaps():
    """Noise around a threshold never fires the same event twice."""
    tracker = StageTracker(StageConfig(patience=2))
    rng = np.random.RandomState(0)
    for i in range(200):
        tracker.update(synthetic_record(i, 1 if rng.rand() < 0.5 else 0, 2 if rng.rand() < 0.5 else 1, rng.uniform(-1, 1)))
    keys = [f["key"] for f in tracker.fired]
    assert len(keys) == len(set(keys)) <= 5


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
    assert StageConfig().heads_needed(16, 8) == 3  # Pythia-1B: the paper's rule
    assert StageConfig().heads_needed(2, 4) == 1
    with pytest.raises(ValueError, match="different thresholds"):
        StageTracker(StageConfig(patience=3)).load_state_dict(StageTracker().state_dict())


def test_classify_p0_rules_directly():
    """classify_p0 applies each P0 rule as SPEC states it."""
    cfg = StageConfig()
    base = {"sink_rate": 0.4, "sink_profile": [0.4] + [0.0] * 7, "sink_center": 0}
    assert classify_p0({**base, "circuit_layer": 1}, cfg)[0] == "final"
    assert classify_p0({**base, "circuit_layer": 5}, cfg)[0] == "early"
    assert classify_p0({**base, "circuit_layer": None}, cfg)[0] == "early"
    assert classify_p0({**base, "circuit_layer": 0, "sink_center": 1}, cfg)[0] == "transitional"
    assert classify_p0({**base, "circuit_layer": 0, "sink_profile": [0.4, 0.1] + [0.0] * 6}, cfg)[0] == "transitional"
    assert classify_p0({"sink_rate": 0.0, "sink_profile": [0.0] * 8, "sink_center": 0, "circuit_layer": None}, cfg)[0] == "none"
    assert classify_p0({"sink_rate": 0.0, "sink_profile": [0.0] * 8, "sink_center": 0, "circuit_layer": 6}, cfg)[0] == "early"
