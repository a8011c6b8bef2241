"""A full record, key for key, equals the one the code produced before the tidy-up (issue 12).

The fixture tests/data/golden_record.json was written by this file's ``main()`` from the code as it
was before ``Monitor._run`` was restructured: a fixed-seed tiny Llama (GQA) trained 60 steps on the
copy task, probed twice — with a natural probe (sinks come from natural text) and without one
(sinks come from the induction probe). Regenerate only on purpose:
``PYTHONPATH=. python tests/test_record_golden.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tiny_models import VOCAB, build, train

from sinkwatch import InductionProbe, Monitor, MonitorConfig, NaturalProbe, RepeatedRandomProbe

GOLDEN = Path(__file__).parent / "data" / "golden_record.json"
FLOAT_RTOL = 1e-6  # float32 statistics recomputed on the same inputs
FLOAT_ATOL = 1e-12  # ... cells that are exactly or nearly zero
IGNORED = {"probe_seconds"}  # wall-clock time


def _natural_tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(2, VOCAB, (2000,), generator=g)


def golden_records() -> dict[str, dict]:
    """The records of the two configurations, from the code on the path (one thread: the float32
    reduction order, which training amplifies, is then the same on every run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _records()
    finally:
        torch.set_num_threads(threads)


def _records() -> dict[str, dict]:
    model = build("llama", seed=0)
    train(model, 60, seed=0)
    cfg = MonitorConfig(classical_pr=True)
    induction, repeated = InductionProbe(n=12, seq_len=64), RepeatedRandomProbe(n=4, seq_len=32)
    natural = NaturalProbe(tokens=_natural_tokens(), n=6, seq_len=40)
    with_natural = Monitor([induction, repeated, natural], config=cfg).probe(model, step=60, tokens=60 * 16 * 64)
    without_natural = Monitor([induction, repeated], config=cfg).probe(model, step=60, tokens=60 * 16 * 64)
    return {"with_natural": with_natural.to_record(), "without_natural": without_natural.to_record()}


def _compare(got, want, path: str) -> list[str]:
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            return [f"{path}: keys {list(got) if isinstance(got, dict) else type(got).__name__} != {list(want)}"]
        return [m for k in want if k not in IGNORED for m in _compare(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: {got!r} != {want!r}"]
        return [m for i, (g, w) in enumerate(zip(got, want)) for m in _compare(g, w, f"{path}[{i}]")]
    if isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
        ok = math.isclose(got, want, rel_tol=FLOAT_RTOL, abs_tol=FLOAT_ATOL) or (math.isnan(got) and math.isnan(want))
        return [] if ok else [f"{path}: {got!r} != {want!r}"]
    return [] if (type(got) is type(want) and got == want) else [f"{path}: {got!r} != {want!r}"]


def test_record_equals_golden_record():
    """Every key of both records equals the pre-refactor record (floats to 1e-6 relative, the rest exactly)."""
    want = json.loads(GOLDEN.read_text())
    got = json.loads(json.dumps(golden_records()))  # what a reporter writes
    mismatches = _compare(got, want, "record")
    assert not mismatches, "\n".join(mismatches[:20])


def main() -> None:
    GOLDEN.write_text(json.dumps(golden_records(), indent=1, sort_keys=False) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
