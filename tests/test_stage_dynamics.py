"""The stage rules on records built to break them (docs/stages.md, "Hysteresis and events"): an
emergence-block tie under noise, the P0 paper's own order, a real drop of the sink rate, an alert's
evidence, and the published tables across the hysteresis settings. Every record here carries the
numbers a probe writes (rho per block, the centred consistency, the Sink_k profile), so the P0 rules
recompute the circuit from them, as they do on a stored run."""

import benchmark_scripts
import numpy as np
import pytest

from sinkwatch import StageConfig, StageTracker
from sinkwatch.stages import P0_RANK, circuit, classify_p0, p0_holds

L = 8  # blocks of the built records


def p0_record(step, rho, sink, *, centre=0, consistency=1.0, emb=1.0):
    """A record with position 0's norm ratio after each block (``rho``) and the Sink_k profile ``sink``."""
    profile = list(sink) + [0.0] * (8 - len(sink))
    return {
        "step": step, "tokens": step * 1000, "n_layers": L, "n_heads": 4,
        "sink_rate": profile[0], "sink_profile": profile, "sink_center": centre,
        "p0_norm_ratio": [float(r) for r in rho], "p0_norm_ratio_embeddings": emb,
        "p0_direction_consistency_centered": [consistency] * L,
    }  # fmt: skip


def two_amplifiers(shallow_gain, deep_gain):
    """rho after each block: block 1 multiplies position 0's norm by ``shallow_gain``, block 5 by ``deep_gain``."""
    return np.array([1.0] + [shallow_gain] * 4 + [shallow_gain * deep_gain] * 3)


def p0_events(records, config=None):
    tracker = StageTracker(config)
    return [e for r in records for e in tracker.update(r) if e.timeline == "p0"], tracker


@pytest.mark.parametrize("deep_gain", [10.0, 11.0, 12.0])  # a tie, a 10 % and a 20 % gap
def test_an_emergence_block_tie_under_noise_does_not_flip_flop(deep_gain):
    """Two blocks that amplify position 0 alike (a circuit moving towards blocks 0-1 passes through
    that tie): with 5 % noise on every rho and on the sink rate the largest-gain block flips from
    probe to probe, but the stage reads the share gained in blocks 0-1, which moves smoothly, behind a
    hold band: one event in 200 probes (the stage entered), where the block-based rule gave 38."""
    rng = np.random.RandomState(0)
    records = []
    for i in range(200):
        rho = two_amplifiers(10.0, deep_gain) * np.exp(rng.normal(0, 0.05, L))
        records.append(p0_record(i, rho, [0.6 * np.exp(rng.normal(0, 0.05))]))
    events, tracker = p0_events(records)
    blocks = {circuit(r, StageConfig(), bos=False)["circuit_layer"] for r in records}
    assert blocks == {1, 5}  # the emergence block really does flip: the test would catch a block-based rule
    assert [e.previous for e in events] == ["none"] and tracker.p0_stage in ("final", "deep"), [e.key for e in events]


def test_the_p0_papers_order_is_progress_never_a_regression():
    """The P0 paper's path: a circuit first deeper with a low sink rate (early), the sink established on
    it (deep), several sink positions (transitional), the centre on position 1 for a while with the
    circuit already shallow (shifted), then the circuit in blocks 0-1 with one sink on position 0
    (final). Each phase 6 probes with noise: every change is declared, none is a regression, only
    `final` alerts at WARN."""
    rng = np.random.RandomState(1)
    deep = np.array([1.0] * 5 + [50.0] * 3)  # amplified at block 5
    moving = np.array([1.0, 4.0, 4.0, 4.0, 4.0, 50.0, 50.0, 50.0])  # part of it moved to block 1 (share 0.35)
    shallow = np.array([1.0] + [50.0] * 7)  # amplified at block 1
    phases = [
        ("early", deep, [0.10]),
        ("deep", deep, [0.50]),
        ("transitional", moving, [0.50, 0.30]),
        ("shifted", shallow, [0.05, 0.50]),
        ("final", shallow, [0.60, 0.02]),
    ]
    records = []
    for stage, rho, sink in phases:
        for _ in range(6):
            noisy = [s * np.exp(rng.normal(0, 0.05)) for s in sink]
            centre = int(np.argmax(noisy))
            r = p0_record(len(records), rho * np.exp(rng.normal(0, 0.05, L)), noisy, centre=centre)
            assert classify_p0(r, StageConfig())[0] == stage, (stage, r)
            records.append(r)
    events, tracker = p0_events(records)
    assert [e.key for e in events] == [
        "p0:none->early", "p0:early->deep", "p0:deep->transitional", "p0:transitional->shifted", "p0:shifted->final",
    ]  # fmt: skip
    assert not [e for e in events if e.regression]
    assert [e.level for e in events] == ["INFO", "INFO", "INFO", "INFO", "WARN"]
    assert P0_RANK["deep"] == P0_RANK["transitional"] == P0_RANK["shifted"] < P0_RANK["final"]


def test_a_run_that_settles_deep_stays_deep_and_leaving_final_is_a_regression():
    """deep is where a run may settle (SmolLM2 does): held for 100 noisy probes it never alerts again;
    a circuit that leaves blocks 0-1 after `final` is a regression, at WARN."""
    rng = np.random.RandomState(2)
    deep = np.array([1.0, 3.0, 3.0, 1.0, 1.0, 170.0, 170.0, 170.0])  # SmolLM2's shape: a precursor, then x170
    records = [p0_record(i, deep * np.exp(rng.normal(0, 0.05, L)), [0.7 * np.exp(rng.normal(0, 0.05))]) for i in range(100)]
    events, tracker = p0_events(records)
    assert [e.key for e in events] == ["p0:none->deep"] and events[0].level == "INFO"
    shallow = np.array([1.0] + [50.0] * 7)
    records = [p0_record(i, shallow if i < 10 else deep, [0.7]) for i in range(20)]
    events, _ = p0_events(records)
    assert [(e.key, e.level, e.regression) for e in events] == [("p0:none->final", "WARN", False), ("p0:final->deep", "WARN", True)]


def test_deep_says_when_no_circuit_was_found():
    """An established sink on position 0 with nothing amplified reads `deep`; the event says no circuit was found."""
    flat = np.ones(L)
    events, _ = p0_events([p0_record(i, flat, [0.6]) for i in range(3)])
    assert [e.key for e in events] == ["p0:none->deep"]
    assert events[0].evidence["circuit_layer"] is None and "no circuit found" in events[0].message()
    events, _ = p0_events([p0_record(i, np.array([1.0] * 5 + [50.0] * 3), [0.6]) for i in range(3)])
    assert events[0].evidence["circuit_layer"] == 5 and "no circuit found" not in events[0].message()


def test_nothing_amplified_reads_no_concentration_and_no_emergence_block():
    """A random initialisation's profile (block 0 stands out, the next block undoes it) has no
    emergence block and no concentration: the rules never call it shallow."""
    rnd = p0_record(0, [2.2, 1.6, 1.4, 1.3, 1.2, 1.1, 1.1, 1.0], [0.0], consistency=0.0)
    stage, evidence = classify_p0(rnd, StageConfig())
    assert stage == "none" and evidence["circuit_layer"] is None
    got = circuit(rnd, StageConfig(), bos=False)
    assert got["p0_emergence_block"] is None and np.isnan(got["p0_concentration"])


def test_a_real_drop_of_the_sink_rate_alerts():
    """`final` with the sink rate at 0.7, then 0.2 for good: the drop leaves the established band and
    alerts as a regression (the hold rule at the old hold_factor 0.6 kept `final` down to 0.18)."""
    shallow = np.array([1.0] + [50.0] * 7)
    records = [p0_record(i, shallow, [0.7 if i < 10 else 0.2]) for i in range(20)]
    events, tracker = p0_events(records)
    assert [e.key for e in events] == ["p0:none->final", "p0:final->early"]
    assert events[1].regression and events[1].level == "WARN" and events[1].first_met_step == 10
    assert p0_holds(records[-1], "early", tracker.config) and not p0_holds(records[-1], "final", tracker.config)


def induction_record(step, n50, n30):
    sel = np.zeros((4, 4))
    sel.flat[:n30] = 35.0
    sel.flat[:n50] = 60.0
    return {"step": step, "tokens": step * 1000, "n_layers": 4, "n_heads": 4, "selectivity": {"induction": sel.tolist()}}


def test_an_alerts_evidence_comes_from_the_probe_that_met_the_rule():
    """formed met with 3 heads at >= 50x, confirmed by a probe that holds it with 2 (3 at >= 30x, as OLMo
    at 52B): the event's evidence is the first probe's 3 heads, never fewer than the rule requires."""
    tracker = StageTracker(StageConfig(min_heads=3))
    events = []
    for i, (n50, n30) in enumerate([(0, 0), (3, 3), (2, 3)]):
        events += [e for e in tracker.update(induction_record(i, n50, n30)) if e.timeline == "induction"]
    assert [e.key for e in events] == ["induction:absent->formed"]
    assert events[0].step == 2 and events[0].first_met_step == 1
    assert events[0].evidence["heads_ge50"] == 3 >= events[0].evidence["min_heads"]


@pytest.mark.parametrize("name", ["stage_sensitivity", "stage_noise"])
def test_docs_tables_are_the_benchmarks_output(name):
    """docs/stages.md's sensitivity and noise tables are what their scripts compute now, from the published
    tables and the committed trajectories (regenerate: python benchmarks/NAME.py --write)."""
    bench = benchmark_scripts.load(name)
    block = bench.table() if name == "stage_sensitivity" else bench.table(*bench.measure())
    marker = "sensitivity" if name == "stage_sensitivity" else "noise"
    assert bench.generated_block(bench.DOC, marker) == block, f"docs/stages.md is stale: python benchmarks/{name}.py --write"


def test_the_defaults_sit_inside_the_noise_bounds_and_keep_the_papers_milestones():
    """p0_hold_factor and hold_factor are no tighter than their keys' noise allows, and at the defaults
    every published table's `formed` is first met at the paper's milestone."""
    _, bound = benchmark_scripts.load("stage_noise").measure()
    cfg = StageConfig()
    assert cfg.p0_hold_factor <= bound["p0"] and cfg.hold_factor <= bound["induction"]
    sensitivity = benchmark_scripts.load("stage_sensitivity")
    from sinkwatch import findings as F

    for model, milestone in F.PAPER_INDUCTION_MILESTONES_B.items():
        first, _, _ = sensitivity.formed_event(F.published_stage_records(model), cfg)
        assert first == milestone, model
