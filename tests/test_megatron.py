"""Megatron-core with tensor parallelism on gloo: two launches of tests/megatron_cells.py (2 processes; 4 for
tensor x data parallelism) under a timeout (each cell under a watchdog) build real ``GPTModel``s (local spec; the CPU workarounds live in
tests/megatron_helpers.py only) and trains one by hand with ``SinkWatchMegatron``. Checked here:

- every record of tensor parallelism 2 (GQA with 2 groups; and 1 group, fewer than the ranks) equals an
  independent float64 forward of the master weights (tests/independent.py's re-derivation of every metric,
  heads in their global order);
- the tensor-parallel record equals the record of the same master weights at tensor parallelism 1;
- training is untouched: every loss and every rank's final parameters are ``torch.equal`` to the same steps
  without the monitor, a fault in sinkwatch's statistics on tensor-parallel rank 1 included (that probe is
  skipped on every rank, the next one written);
- what cannot be probed is refused with the reason (tests below the launch).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from torchrun import run_logged, torchrun  # noqa: E402

from sinkwatch.monitor import MonitorConfig  # noqa: E402
from sinkwatch.reporting.jsonl import read_jsonl  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import independent as ind  # noqa: E402
import megatron_cells as mc  # noqa: E402
import megatron_helpers as mh  # noqa: E402

LAUNCH_TIMEOUT_S = 180
CELLS = ["tp2", "tp1", "gqa1", "other2", "other1", "refusals"]
CELLS_4 = ["tp2", "tp1"]  # 4 processes: tensor parallelism 2 x data parallelism 2 (and tp1: data parallelism 4)
RTOL, ATOL = 1e-5, 1e-6  # float32 noise: the same weights, reductions ordered differently over the ranks


def _launch(tmp_path_factory, nproc: int, cells: list[str]):
    out = tmp_path_factory.mktemp(f"megatron-cells-{nproc}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    env.pop("SINKWATCH_TEST_FAULT", None)
    rc, log = run_logged(torchrun(HERE / "megatron_cells.py", str(out), *cells, nproc=nproc), out, env, LAUNCH_TIMEOUT_S)
    return out, rc, log, nproc


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    return _launch(tmp_path_factory, 2, CELLS)


@pytest.fixture(scope="module")
def launch4(tmp_path_factory):
    return _launch(tmp_path_factory, 4, CELLS_4)


@pytest.fixture(params=[2, 4], ids=["tp2", "tp2xdp2"])
def either(request):
    """The 2-process launch (tensor parallelism 2) or the 4-process one (tensor parallelism 2 x data parallelism 2)."""
    return request.getfixturevalue("launch" if request.param == 2 else "launch4")


def cell(launch, name: str) -> tuple[Path, list[dict]]:
    out, rc, output, nproc = launch
    d = out / name
    missing = [r for r in range(nproc) if not (d / f"result-rank{r}.json").exists()]
    assert not missing, f"{name}: ranks {missing} never finished (launch rc {rc})\n{output[-6000:]}"
    results = [json.loads((d / f"result-rank{r}.json").read_text()) for r in range(nproc)]
    for r in results:
        assert r["status"] == "ok", r.get("traceback")
    return d, results


def check_against_float64(record: dict, d: Path, weights: str, *, groups: int, other: bool = False) -> None:
    sets = torch.load(d / "sets.pt", weights_only=False)
    shape = {"layers": 3, "heads": 6, "groups": 2} if other else {"layers": 2, "heads": 4, "groups": groups}
    eager = mh.eager64(torch.load(d / weights, weights_only=True), **shape, other=other)
    ind.check_record(record, mh.ProbeSets(sets, MonitorConfig()), mh.VOCAB, eager)


def test_megatron_tp2_records_equal_a_float64_forward(either):
    """Tensor parallelism 2, 4 query heads in 2 groups (x data parallelism 2: each replica a share of the
    sequences, each of its ranks its heads): the records at step 0 and at the last step equal the float64
    re-derivation on the master weights, head by head in global order."""
    d, results = cell(either, "tp2")
    dp = either[3] // 2
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, mc.EVERY, mc.STEPS]
    ok = [r for r in records if "error" not in r]
    assert [r["step"] for r in ok] == [0, mc.STEPS]
    assert [r["tokens"] for r in ok] == [0, mc.STEPS * mh.BATCH * mh.SEQ * dp]  # every replica's batches, not the TP peers'
    for r in ok:
        assert r["model"] == "megatron.GPTModel" and r["n_heads"] == 4 and r["tensor_parallel"] == 2
        assert r["probe_split"]["ranks"] == dp
        assert r["probe_dtype"] == "float32"
    check_against_float64(ok[0], d, "initial.pt", groups=2)
    check_against_float64(ok[1], d, "final.pt", groups=2)


def test_megatron_tp2_record_equals_tp1(either):
    """The tensor-parallel record at the last step equals the record of the same master weights probed at tensor
    parallelism 1 (every rank a data-parallel share of the sequences), with the same probe sets."""
    d2, _ = cell(either, "tp2")
    d1, _ = cell(either, "tp1")
    tp2 = read_jsonl(d2 / "sw" / "records.jsonl")[-1]
    (tp1,) = read_jsonl(d1 / "sw" / "records.jsonl")
    assert tp2["step"] == tp1["step"] == mc.STEPS and "tensor_parallel" not in tp1
    assert tp1["probe_split"]["ranks"] == either[3]
    assert_same_numbers(tp2, tp1)


def assert_same_numbers(got: dict, want: dict) -> None:
    """Two records of the same weights: every value that describes them equal within float32 noise."""
    import parallel_matrix as pm

    got, want = mh.numbers(got), mh.numbers(want)
    assert set(got) == set(want)
    for key, value in want.items():
        if key in pm.TRACKED:  # the run's history (stages visited since its first probe), not these weights
            continue
        pm._assert_value_equal(got[key], value, key, rtol=RTOL, atol=ATOL)


def test_megatron_other_model_tp2_equals_tp1(launch):
    """A Llama-like Megatron model (RMSNorm, SwiGLU, QK layer norm, no biases, tied embeddings, query-key layer
    scaling; 3 layers, 6 heads in 2 groups) trained two steps at tensor parallelism 2 with the adapter at its
    defaults: probes at 0 and at the last step, the last equal to the same weights' record at tensor parallelism 1."""
    d2, _ = cell(launch, "other2")
    d1, _ = cell(launch, "other1")
    records = read_jsonl(d2 / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2] and all("error" not in r for r in records)
    assert {r["n_heads"] for r in records} == {6} and {r["n_layers"] for r in records} == {3}
    (tp1,) = read_jsonl(d1 / "sw" / "records.jsonl")
    assert_same_numbers(records[-1], tp1)


def test_megatron_other_model_tp2_equals_a_float64_forward(launch):
    """The Llama-like variant's records at step 0 and at the last step (tensor parallelism 2) equal the float64
    re-derivation of its master weights (RMSNorm, SwiGLU's gate and up halves, QK RMS norm, no biases, tied
    output), head by head in global order."""
    d, _ = cell(launch, "other2")
    records = read_jsonl(d / "sw" / "records.jsonl")
    check_against_float64(records[0], d, "initial.pt", groups=2, other=True)
    check_against_float64(records[-1], d, "final.pt", groups=2, other=True)


def test_megatron_fewer_kv_groups_than_tp_ranks(launch):
    """One key/value group for 4 query heads at tensor parallelism 2 (Megatron gathers the projection; each rank
    keeps 2 query heads): the step-0 record equals the float64 re-derivation."""
    d, results = cell(launch, "gqa1")
    assert [r["local_heads"] for r in results] == [2, 2]
    (record,) = read_jsonl(d / "sw" / "records.jsonl")
    assert record["step"] == 0 and record["n_heads"] == 4
    check_against_float64(record, d, "initial.pt", groups=1)


def test_megatron_training_is_untouched(either):
    """Every loss and every rank's final parameters with the monitor (probes at 0, 2, 4; the fault at step 2)
    are torch.equal to the same steps without it; the fault on tensor-parallel rank 1 skipped that probe on
    every rank (one error line, rank 0's) and the next probe was written."""
    d, results = cell(either, "tp2")
    for r in results:
        assert r["watched"] == r["plain"]
        assert r["same_params"] is True
    assert [r["tp_rank"] for r in results] == [0, 1] * (either[3] // 2)
    (skipped,) = [r for r in read_jsonl(d / "sw" / "records.jsonl") if "error" in r]
    assert skipped["step"] == mc.EVERY and "rank 1: InjectedFault" in skipped["error"]


def test_megatron_refusals(launch):
    """What cannot be probed live is refused at construction, with the reason: a tensor-parallel Megatron model
    handed to the live core without its layout, sequence parallelism, sliding windows."""
    _, results = cell(launch, "refusals")
    errors = results[0]["errors"]
    assert "tensor-parallel model live" in errors["no_layout"] and "sinkwatch.megatron" in errors["no_layout"]
    assert "sequence_parallel" in errors["sequence_parallel"]
    assert "window_size" in errors["window"]
    assert results[0]["errors"] == results[1]["errors"]


@pytest.fixture(scope="module")
def launch_fault(tmp_path_factory):
    import time

    t0 = time.perf_counter()
    out, rc, log, nproc = _launch(tmp_path_factory, 2, ["tpfault"])
    return out, rc, log, time.perf_counter() - t0


def test_megatron_fault_in_a_block_on_one_tp_rank_stops_the_run(launch_fault):
    """A fault inside a block's own forward on tensor-parallel rank 1 cannot be held (skipping the block on one
    rank would unpair the row-parallel all-reduces): rank 1 raises ProbeForwardBroken after waiting
    fault_timeout_s for the verdict and exits; rank 0, waiting in the block's all-reduce, sees the connection close
    (gloo) and raises ProbeForwardBroken too, or the launcher ends it: never a hang."""
    out, rc, log, seconds = launch_fault
    result = json.loads((out / "tpfault" / "result-rank1.json").read_text())
    assert result["raised"] is not None and result["raised"].startswith("ProbeForwardBroken"), (result, log[-4000:])
    assert "InjectedFault" in result["raised"] and "ranks [0] raised no fault there" in result["raised"]
    assert mc.FAULT_TIMEOUT_S <= result["seconds"] < mc.FAULT_TIMEOUT_S + 20
    assert rc != 0 and seconds < mc.CELL_TIMEOUT_S  # ended with rank 1, not by the watchdog or a timeout
    rank0 = out / "tpfault" / "result-rank0.json"
    if rank0.exists():  # its all-reduce failed when rank 1's process went
        assert json.loads(rank0.read_text())["raised"].startswith("ProbeForwardBroken")


def test_the_megatron_launch_ended_cleanly(either):
    out, rc, output, _ = either
    assert rc == 0, output[-6000:]
    assert "Timeout" not in output and "Traceback" not in output, output[-6000:]


# ---- refusals that a CPU build cannot have, in one process (a world of 1) -----------------------------------------
@pytest.fixture(scope="module")
def one_process_gpt(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('mg1') / 'store'}", rank=0, world_size=1)
    try:
        mh.cpu_megatron(tp=1)
        yield mh.build_gpt(layers=1)
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("multi_latent_attention", True, "multi_latent_attention"),
        ("attention_output_gate", True, "attention_output_gate"),
        ("softmax_type", "off-by-one", "softmax offset"),
        ("context_parallel_size", 2, "context_parallel_size"),
    ],
)
def test_megatron_capture_refuses_what_it_cannot_read(one_process_gpt, monkeypatch, flag, value, says):
    """Multi-latent attention, gated attention output, a softmax offset, context parallelism: refused by the capture
    with the reason (the flag set on a built model's config, as a GPU run's config carries it)."""
    from sinkwatch.capture import UnsupportedModelError
    from sinkwatch.capture.megatron import MegatronTarget

    monkeypatch.setattr(one_process_gpt.config, flag, value)
    with pytest.raises(UnsupportedModelError, match=says):
        MegatronTarget(one_process_gpt)


def test_megatron_pipeline_stage_and_chunks_are_refused(one_process_gpt, monkeypatch, tmp_path):
    """A pipeline stage (no output layer here), a list of virtual-pipeline model chunks, and pipeline or context
    parallelism in Megatron's parallel state: each refused at construction, with the reason."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from sinkwatch.capture import UnsupportedModelError
    from sinkwatch.capture.megatron import MegatronTarget
    from sinkwatch.megatron import SinkWatchMegatron, megatron_parallel

    with pytest.raises(ValueError, match="2 model chunks"):
        SinkWatchMegatron([one_process_gpt, one_process_gpt], out_dir=str(tmp_path), wandb="disabled", console=False)
    bare = SimpleNamespace(pg_collection=None)  # the sizes from parallel_state, stubbed (a world of 1 cannot have them)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match="pipeline parallelism"):
        megatron_parallel(bare)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match="context parallelism"):
        megatron_parallel(bare)
    monkeypatch.setattr(one_process_gpt, "post_process", False)
    with pytest.raises(UnsupportedModelError, match="pipeline stage"):
        MegatronTarget(one_process_gpt)
