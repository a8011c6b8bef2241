"""The P0 stage rules on real circuit dynamics (docs/stages.md, "Real trajectories").

The committed trajectories (tests/data/p0_trajectories/NAME/records.jsonl) are real runs of the
product's live path: a real pretrained model whose amplifier is knocked out, retrained with the HF
Trainer and ``SinkWatchTrainerCallback`` (benchmarks/p0_trajectories.py regenerates them; its
``run.json`` says the command, the time and the load). Here the tracker at its defaults reads them
again, from their measurements alone, and must report what a researcher would: every declared P0
event a settled change of the per-probe readings, none on noise, no regression along the path. A
short real run (`sinkwatch demo --p0 --steps 5`) reproduces the start of the committed demo run.
"""

import json
from pathlib import Path

import benchmark_scripts
import pytest
from real_models import smollm2_dir

from sinkwatch import StageConfig, StageTracker
from sinkwatch.cli import main
from sinkwatch.records import jsonable
from sinkwatch.reporting.jsonl import read_jsonl
from sinkwatch.stages import classify_p0

DATA = Path(__file__).parent / "data" / "p0_trajectories"
NAMES = sorted(p.name for p in DATA.iterdir() if (p / "records.jsonl").is_file())
SETTLED = 3  # a phase: at least this many consecutive probes read the same stage by the rules alone


def records_of(name: str) -> list[dict]:
    return read_jsonl(DATA / name / "records.jsonl")


def settled_phases(stages: list[str]) -> list[str]:
    """The stages the per-probe readings settle in, in order: runs of >= SETTLED equal readings,
    consecutive repeats merged (a reading that flickers for one or two probes is not a phase)."""
    phases, i = [], 0
    while i < len(stages):
        j = i
        while j < len(stages) and stages[j] == stages[i]:
            j += 1
        if j - i >= SETTLED and (not phases or phases[-1] != stages[i]):
            phases.append(stages[i])
        i = j
    return phases


DEMO = "smollm2-demo"  # what `sinkwatch demo --p0` writes at its defaults (17 probes); the research runs have >= 20


def test_the_committed_trajectories_are_real_live_runs():
    """Each trajectory: >= 20 probes (the demo's own run: its 17) at a fixed interval from step 0, written by the
    HF callback, and the run.json that says how it was made (command, seconds on this machine, <= 60 minutes)."""
    assert len(NAMES) >= 4 and DEMO in NAMES, NAMES
    for name in NAMES:
        records, run = records_of(name), json.loads((DATA / name / "run.json").read_text())
        steps = [r["step"] for r in records]
        assert len(records) >= (17 if name == DEMO else 20), (name, len(records))
        assert steps[0] == 0 and len({b - a for a, b in zip(steps, steps[1:])}) == 1, (name, steps)
        assert run["seconds"] <= 3600 and run["command"].startswith(("python benchmarks/p0_trajectories.py", "sinkwatch demo --p0"))
        assert all(r["probe"] == "natural" and r["tokens"] == r["step"] * run["run"]["batch"] * run["run"]["seq_len"] for r in records)


@pytest.mark.parametrize("name", NAMES)
def test_every_declared_p0_event_is_a_settled_change_and_none_is_a_regression(name):
    """The tracker at its defaults, re-run over the measurements: its declared P0 stages are exactly the
    phases the per-probe readings settle in (so no event fires on noise and none is missed), each
    event's evidence is the probe that met its rule, and nothing along these paths reads as a regression."""
    records = records_of(name)
    tracker = StageTracker()
    events = [e for r in records for e in tracker.update(dict(r)) if e.timeline == "p0"]
    now = [classify_p0(r, StageConfig())[0] for r in records]
    assert [e.stage for e in events] == settled_phases(now), ([e.key for e in events], now)
    assert not [e for e in events if e.regression], [e.message() for e in events]
    for e in events:
        met = next(r for r in records if r["step"] == e.first_met_step)
        stage, evidence = classify_p0(met, StageConfig())
        assert stage == e.stage and e.evidence == jsonable(evidence)


def test_docs_table_is_the_committed_runs():
    """docs/stages.md's table of the real trajectories is what the committed runs read now
    (regenerate: python benchmarks/p0_trajectories.py --write)."""
    bench = benchmark_scripts.load("p0_trajectories")
    assert bench.generated_block(bench.DOC, "trajectories") == bench.table(DATA), (
        "docs/stages.md is stale: python benchmarks/p0_trajectories.py --write"
    )


def test_the_p0_stage_moves_on_real_dynamics():
    """At least two research trajectories move their P0 stage past the first declaration (the knockout drops
    the sink rate below the established band; the circuit regrows and carries the sink again)."""
    moving = []
    for name in (n for n in NAMES if n != DEMO):
        tracker = StageTracker()
        events = [e for r in records_of(name) for e in tracker.update(dict(r)) if e.timeline == "p0"]
        if len(events) >= 2:
            moving.append(name)
    assert len(moving) >= 2, moving


@pytest.fixture(scope="module")
def short_demo(tmp_path_factory):
    smollm2_dir()  # skips (fails under CI) when SmolLM2 is not installed
    out = tmp_path_factory.mktemp("demo_p0") / "run"
    assert main(["demo", "--p0", "--steps", "5", "--every", "5", "--out", str(out), "--wandb", "disabled"]) == 0
    return out


def test_a_short_real_run_reproduces_the_committed_demo(short_demo):
    """`sinkwatch demo --p0 --steps 5` (SmolLM2's circuit layer knocked out, 5 steps): its probes at steps 0
    and 5 are the committed demo run's, and its report draws the P0 circuit figure."""
    got = read_jsonl(short_demo / "records.jsonl")
    want = records_of(DEMO)[:2]
    assert [r["step"] for r in got] == [0, 5]
    for g, w, rtol in zip(got, want, (1e-4, 2e-2)):  # step 0: the same weights; step 5: 5 AdamW steps of float32 training
        assert g["model"] == w["model"]
        assert g["sink_rate"] == pytest.approx(w["sink_rate"], rel=rtol, abs=1e-3)
        assert g["p0_norm_ratio"] == pytest.approx(w["p0_norm_ratio"], rel=rtol)
        assert g["p0_direction_consistency_centered"] == pytest.approx(w["p0_direction_consistency_centered"], abs=rtol)
    assert (short_demo / "report" / "p0_circuit.png").stat().st_size > 5000
