"""How the induction events on the paper's three published tables move with the hysteresis settings.

    python benchmarks/stage_sensitivity.py            # print the table
    python benchmarks/stage_sensitivity.py --write    # rewrite docs/stages.md's generated block

For each published per-revision table (sinkwatch/data/xu2026_per_head.json, every head's selectivity
and PR at ten revisions) and each (hold_factor, patience), the tracker's first ``formed`` event:
where the rule was first met and where it was declared, in billions of tokens, and how many
induction events the run fired (a regression adds two). tests/test_stage_dynamics.py checks that
docs/stages.md holds this script's output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common, when loaded from elsewhere (the tests)
from common import generated_block  # noqa: E402

from sinkwatch import StageConfig, StageTracker  # noqa: E402
from sinkwatch import findings as F  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "stages.md"
HOLD_FACTORS = (0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # 0.45: the default, from the selectivity's noise
PATIENCES = (1, 2, 3)
SHORT = {"EleutherAI/pythia-1b": "Pythia-1B", "allenai/OLMo-1B-0724-hf": "OLMo-1B-0724", "allenai/OLMoE-1B-7B-0924": "OLMoE-1B-7B"}


def formed_event(records: list[dict], config: StageConfig) -> tuple[float | None, float | None, int]:
    """(first-met B tokens, declared B tokens, induction events) of the first ``formed`` event."""
    tracker = StageTracker(config)
    events = [e for r in records for e in tracker.update(dict(r)) if e.timeline == "induction"]
    formed = next((e for e in events if e.stage == "formed"), None)
    if formed is None:
        return None, None, len(events)
    return formed.first_met_tokens / 1e9, formed.tokens / 1e9, len(events)


def _b(x: float | None) -> str:
    return "–" if x is None else f"{x:g}"


def table() -> str:
    records = {m: F.published_stage_records(m) for m in SHORT}
    head = "| hold_factor | patience | " + " | ".join(f"{SHORT[m]} (paper {F.PAPER_INDUCTION_MILESTONES_B[m]:g} B)" for m in SHORT) + " |"
    lines = [head, "|" + "---|" * (2 + len(SHORT))]
    for f in HOLD_FACTORS:
        for p in PATIENCES:
            cells = []
            for m in SHORT:
                first, declared, n = formed_event(records[m], StageConfig(hold_factor=f, patience=p))
                mark = "" if first == F.PAPER_INDUCTION_MILESTONES_B[m] else " ✗"
                cells.append(f"{_b(first)}{mark} → {_b(declared)} ({n} ev.)")
            lines.append(f"| {f:g} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite docs/stages.md's generated block")
    a = ap.parse_args(argv)
    block = table()
    if a.write:
        DOC.write_text(generated_block(DOC, "sensitivity", block))
    else:
        sys.stdout.write(block + "\n")


if __name__ == "__main__":
    main()
