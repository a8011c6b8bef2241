"""The probe split over data-parallel ranks (docs/design.md §9): each rank runs its share of
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
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",  # mismatched collectives fail instead of pairing silently
    }  # fmt: skip
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


# ---- faults real runs produce, under FSDP2: the probe is skipped, the run goes on ---------------------
def _fault_case(launch, name: str) -> tuple[dict, list[dict]]:
    """The case's skipped probe (step 2) and its written records (0 and 4), each equal to one process's."""
    d, results = case(launch, name)
    rows = read_jsonl(d / "sw" / "records.jsonl")
    assert [r["step"] for r in rows] == [0, 2, 4], rows
    skipped, written = rows[1], [rows[0], rows[2]]
    assert "error" in skipped and "no rank wrote it" in skipped["error"], skipped
    ref = launch[0] / ("fallback" if name == "fallback" else "ddp") / "single" / "records.jsonl"
    (want, *_) = read_jsonl(ref)  # the same weights (no training here): every step's record equals step 0's
    for got in written:
        assert_split_equals_single(got, want, rtol=1e-5, atol=1e-6)
    assert len({r["work"]["2"]["forwards"] for r in results}) == 1  # every rank ran the same forwards, the faulted one too
    return skipped, written


def test_an_out_of_memory_on_every_rank_skips_the_probe(launch):
    """Every rank runs out of memory in the middle block, each message with its own PID and byte counts
    (before: the fault signatures differed by those numbers, and every rank raised ProbeForwardBroken)."""
    skipped, _ = _fault_case(launch, "oom")
    assert skipped["error"].count("ProbeFaultEverywhere") == W, skipped["error"]
    assert "probe forward 1, block 1" in skipped["error"] and "CUDA out of memory" in skipped["error"]


def test_shape_errors_that_differ_by_rank_skip_the_probe(launch):
    """A real shape error in the middle block on every rank, its numbers each rank's share of the rows
    (before: different messages, ProbeForwardBroken on every rank)."""
    skipped, _ = _fault_case(launch, "shapes")
    for r, rows in enumerate((3, 3, 1)):
        assert f"rank {r}: RuntimeError: shape '[{rows}, 33, -1]' is invalid" in skipped["error"], skipped["error"]


def test_one_ranks_value_error_in_a_sharded_forward_skips_the_probe(launch):
    """A ValueError in rank 1's middle block only: held to the end of the forward, so rank 1 joins every
    all-gather of it, and the next agreement skips the probe everywhere (before: it bypassed the verdict,
    and rank 1's FAIL all-reduce met the other ranks' all-gathers)."""
    skipped, _ = _fault_case(launch, "value")
    assert "rank 1: ValueError: rank 1's rows cannot run here" in skipped["error"], skipped["error"]
    assert "rank 0:" not in skipped["error"] and "rank 2:" not in skipped["error"]


def test_extra_forwards_of_an_unreproducible_head_are_agreed_under_the_split(launch):
    """The repeated probe's losses from extra one-sequence forwards (the head cannot be reproduced): each
    rank's share has another row count, yet every rank runs as many extra forwards (before: unpaired
    FSDP collectives). Every probe is written and equals one process's."""
    d, results = case(launch, "fallback")
    rows = read_jsonl(d / "sw" / "records.jsonl")
    assert [r["step"] for r in rows] == [0, 2, 4] and not any("error" in r for r in rows), rows
    single = {r["step"]: r for r in read_jsonl(d / "single" / "records.jsonl")}
    for rec in rows:
        assert_split_equals_single(rec, single[rec["step"]], rtol=1e-5, atol=1e-6)
    assert len({r["work"]["0"]["forwards"] for r in results}) == 1
    _, plain = case(launch, "ddp")
    assert results[0]["work"]["0"]["forwards"] > plain[0]["work"]["0"]["forwards"]  # the extra forwards ran


def test_the_paper_protocols_first_n_pr_under_the_split(launch):
    """``protocol="paper"``: PR over the first N induction sequences, all in rank 0's share; the other
    ranks contribute zeros to the one all-reduce (before: they had no PR data and every probe failed)."""
    d, _ = case(launch, "paper")
    (got,) = read_jsonl(d / "sw" / "records.jsonl")
    (want,) = read_jsonl(d / "single" / "records.jsonl")
    assert got["pr_sequences"] == want["pr_sequences"] == ps.PAPER_PR
    assert_split_equals_single(got, want, rtol=1e-5, atol=1e-6)


def test_fsdp2_parameter_mixed_precision_records_say_bf16(launch):
    """FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16)`` (OLMo-core's standard configuration): the probe
    computes in bf16 and the record says so (before: ``probe_dtype: float32``, so a replay of the store probed
    in another dtype); its numbers are the float32 ones within bf16 rounding."""
    d, _ = case(launch, "fsdp2_mp")
    (got,) = read_jsonl(d / "sw" / "records.jsonl")
    (want,) = read_jsonl(launch[0] / "ddp" / "single" / "records.jsonl")
    assert got["probe_dtype"] == "bfloat16" and want["probe_dtype"] == "float32"
    for key in ("sink_alpha", "p0_norm_ratio", "induction_score"):
        import numpy as np

        np.testing.assert_allclose(np.array(got[key], dtype=float), np.array(want[key], dtype=float), rtol=5e-2, atol=2e-2, err_msg=key)
