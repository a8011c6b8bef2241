"""The probe split over data-parallel ranks (SPEC §9, issue 25 item 10): each rank runs its share of
every probe set's sequences, the same number of forwards everywhere, one all-reduce combines the
shares, and the record equals one process's.

Tolerances (the issue's): float32, continuous keys within 1e-5 relative (1e-6 absolute, for
probabilities near 0); bf16 within 1e-2 relative (1e-3 absolute); discrete keys (head lists,
counts, classes, circuit layer, stages) equal — none of this random model's heads sits near a
threshold (its best selectivity is printed by a failure). The launch (3 gloo processes, under a
watchdog and a timeout) runs in tests/probe_split.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from torchrun import run_logged, torchrun

from sinkwatch.reporting.jsonl import read_jsonl

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import parallel_matrix as pm  # noqa: E402
import probe_split as ps  # noqa: E402

W = 3
LAUNCH_TIMEOUT_S = 420
SPLIT_ONLY = {"probe_split"}  # differs by design: how many ranks shared the probe


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("split")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    env.pop("SINKWATCH_TEST_FAULT", None)
    rc, log = run_logged(torchrun(HERE / "probe_split.py", str(out), nproc=W), out, env, LAUNCH_TIMEOUT_S)
    return out, rc, log


def case(launch, name: str) -> tuple[Path, list[dict]]:
    out, rc, log = launch
    d = out / name
    missing = [r for r in range(W) if not (d / f"rank{r}.json").exists()]
    assert not missing, f"{name}: ranks {missing} never finished (launch rc {rc}; a hang shows the watchdog's stacks)\n{log[-6000:]}"
    results = [json.loads((d / f"rank{r}.json").read_text()) for r in range(W)]
    for r in results:
        assert r["status"] == "ok", r.get("traceback")
    return d, results


def without(record: dict, keys) -> dict:
    return {k: v for k, v in record.items() if k not in keys}


def assert_split_equals_single(got: dict, want: dict, *, rtol: float, atol: float) -> None:
    assert got["probe_split"] == {"ranks": W, "sequences": {"natural": 2, "induction": 11, "repeated": 7}}, got["probe_split"]
    assert "probe_split" not in want
    best = max(max(row) for row in want["selectivity"]["induction"])
    try:
        pm.assert_records_equal(without(got, SPLIT_ONLY), want, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n(best induction selectivity of the single process: {best:.3g}x)") from exc


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_a_split_probe_equals_one_process_in_float32(launch, name):
    d, results = case(launch, name)
    assert all(r["split"] for r in results)
    (got,) = read_jsonl(d / "sw" / "records.jsonl")  # rank 0 alone writes
    (want,) = read_jsonl(launch[0] / "ddp" / "single" / "records.jsonl")  # the same model, one process
    assert_split_equals_single(got, want, rtol=1e-5, atol=1e-6)
    assert set(got["p0_anchor_views"]) == {"bos", "position"}  # the BOS-free twin ran split too
    assert got["circuit_layer_twin"] == want["circuit_layer_twin"]  # its values compared above, in p0_anchor_views
    assert got["pr_sequences"] == want["pr_sequences"] == 11  # PR's Gram matrices summed over the shares


def test_a_split_probe_equals_one_process_in_bf16(launch):
    d, _ = case(launch, "bf16")
    (got,) = read_jsonl(d / "sw" / "records.jsonl")
    (want,) = read_jsonl(d / "single" / "records.jsonl")
    assert got["probe_dtype"] == want["probe_dtype"] == "bfloat16"
    assert_split_equals_single(got, want, rtol=1e-2, atol=1e-3)


SETS = [(11, 64), (7, 32), (2, 40), (2, 39)]  # (sequences, tokens): induction, repeated (2 x 16), natural, its BOS-free twin
PREFLIGHT = [(1, 64), (1, 32), (1, 40)]  # one sequence of each set (no twin: one window)


def expected_work(rank: int, sets) -> tuple[int, int, int]:
    """(forwards, tokens, tokens of its own sequences) of ``rank``: ceil(n / W) sequences per rank,
    ``192 // T`` per forward, every rank as many forwards as the fullest, one-sequence padding."""
    forwards = tokens = own = 0
    for n, T in sets:
        micro, per = 192 // T, -(-n // W)
        real = max(0, min(n, (rank + 1) * per) - rank * per)
        count, real_count = -(-per // micro), -(-real // micro)
        forwards += count
        own += real * T
        tokens += real * T + (count - real_count) * T
    return forwards, tokens, own


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_every_rank_runs_the_same_forwards_and_its_share_of_the_tokens(launch, name):
    _, results = case(launch, name)
    for r, res in enumerate(results):
        f1, t1, _ = expected_work(r, PREFLIGHT)
        f2, t2, _ = expected_work(r, SETS)
        assert res["work"]["0"] == {"forwards": f1 + f2, "tokens": t1 + t2}, (r, res["work"])
    assert len({res["work"]["0"]["forwards"] for res in results}) == 1  # equal counts: under FSDP each forward is a collective
    whole = sum(n * T for n, T in SETS)
    assert sum(expected_work(r, SETS)[2] for r in range(W)) == whole  # every sequence on exactly one rank
    assert max(expected_work(r, SETS)[1] for r in range(W)) <= 0.4 * whole  # ~1/W: ceil shares of 11, 7 and 2 sequences


def test_a_fault_in_one_ranks_forward_under_ddp_skips_that_probe_and_the_next_is_written(launch):
    d, results = case(launch, "fault")
    rows = read_jsonl(d / "sw" / "records.jsonl")
    records = [r for r in rows if "error" not in r]
    assert [r["step"] for r in records] == [0, 4], rows
    single = {r["step"]: r for r in read_jsonl(d / "single" / "records.jsonl")}
    for rec in records:
        assert_split_equals_single(rec, single[rec["step"]], rtol=1e-5, atol=1e-6)
    (skipped,) = [r for r in rows if "error" in r]
    assert skipped["step"] == 2 and "rank 1: InjectedFault" in skipped["error"], skipped
    assert all(r["work"]["2"]["forwards"] == 1 for r in results)  # every rank stopped after the faulting forward


def test_the_launch_ran_every_case(launch):
    out, rc, log = launch
    assert rc == 0, log[-6000:]
    assert {p.name for p in out.iterdir() if p.is_dir()} == set(ps.CASES)
