"""torchtitan under FSDP2 on 2 gloo processes: one launch of tests/torchtitan_cells.py under a
timeout (each cell under a watchdog) runs torchtitan's debug config for llama3 and qwen3 (two of its
blocks), its own ``parallelize_fn`` (``apply_fsdp_to_decoder``) over its ``ParallelDims`` on a CPU mesh, and
real ``train_step`` calls with ``SinkWatchTrainer`` and with the stock ``Trainer``, each rank on its own
rows (and llama3 once more in torchtitan's default bfloat16 parameter mixed precision). Checked here: the
records are written once (rank 0; rank 1 logs nothing to ``metrics_processor.logger``), count both ranks'
tokens, and the first and last equal a single-process probe of the same weights gathered whole, with rank
0's natural windows, within float32 noise (rtol 1e-5, atol 1e-6: the sharded forward computes on exactly the
weights the single process holds, only reductions may be ordered differently); every rank's final shards are
``torch.equal`` to the stock Trainer's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

from torchrun import run_logged, torchrun  # noqa: E402

from sinkwatch.reporting.jsonl import read_jsonl  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import parallel_matrix as pm  # noqa: E402
import torchtitan_cells as tc  # noqa: E402
import torchtitan_helpers as th  # noqa: E402

LAUNCH_TIMEOUT_S = 240
FAMILIES = ["llama3", "qwen3"]
CELLS = [*FAMILIES, "llama3_bf16", "llama3_tp", "llama3_tp_nosp"]
RTOL, ATOL = 1e-5, 1e-6  # float32 noise (parallel_matrix.RTOL/ATOL)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchtitan-cells")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    rc, log = run_logged(torchrun(HERE / "torchtitan_cells.py", str(out), *CELLS), out, env, LAUNCH_TIMEOUT_S)
    return out, rc, log


@pytest.fixture
def torchtitan_here(monkeypatch):
    """FlexAttention uncompiled, as in the launched cells (tests/torchtitan_helpers.eager_flex)."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", staticmethod(flex_attention))


def cell_results(launch, family: str) -> tuple[Path, list[dict]]:
    out, rc, output = launch
    d = out / family
    missing = [r for r in range(2) if not (d / f"result-rank{r}.json").exists()]
    assert not missing, f"{family}: ranks {missing} never finished (launch rc {rc})\n{output[-6000:]}"
    results = [json.loads((d / f"result-rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["status"] == "ok", r.get("traceback")
    return d, results


def single_process_record(family: str, weights: dict, first: torch.Tensor, tmp: Path) -> dict:
    """The same model unsharded in this process (built from the same config), ``weights`` copied in, one
    probe of the live core with the same probe sets and rank 0's first batch as its natural windows."""
    from sinkwatch.live import LiveConfig, LiveMonitor

    config = tc.stock_config(family)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    model = model_config.build()
    own = dict(model.named_parameters())
    assert sorted(own) == sorted(weights)
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(weights[name])
    live = LiveMonitor(LiveConfig(out_dir=str(tmp), wandb="disabled", console=False, raise_on_error=True))
    live.setup(model.train(), is_global_zero=True)
    th.use_small_probes(live)
    live.batch_start({"input_ids": first})
    live.step_end(0)
    (record,) = read_jsonl(tmp / "records.jsonl")
    return record


@pytest.mark.parametrize("family", FAMILIES)
def test_torchtitan_fsdp2_records_equal_a_single_process_probe(launch, family, tmp_path, torchtitan_here):
    d, results = cell_results(launch, family)
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, tc.EVERY, tc.STEPS]  # once each: rank 0 alone writes
    per_step = tc.BATCH * tc.T * 2  # both ranks' batches
    assert [r["tokens"] for r in records] == [0, tc.EVERY * per_step, tc.STEPS * per_step]
    assert {r["model"] for r in records} == {f"torchtitan.{family.capitalize()}Model"}
    assert {r["probe_split"]["ranks"] for r in records} == {2}  # each rank probed its share of the sequences
    assert [r["logged_steps"] for r in results] == [[0, tc.EVERY, tc.STEPS], []]  # metrics_processor.logger: rank 0 only
    for r in results:
        assert f"FSDP{family.capitalize()}Model" in r["sharded"] and r["skip_lm_head"]  # sharded; the loss applied lm_head
    first = [torch.load(d / f"first-rank{r}.pt", weights_only=True) for r in range(2)]
    assert not torch.equal(first[0], first[1])  # each rank read its own rows
    natural = [torch.load(d / f"natural-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(natural[0], natural[1])  # every rank probed with rank 0's windows
    initial = torch.load(d / "initial.pt", weights_only=True)
    final = torch.load(d / "final.pt", weights_only=True)
    assert any(not torch.equal(initial[k], final[k]) for k in initial)  # it trained
    pm.assert_records_equal(records[0], single_process_record(family, initial, first[0], tmp_path / "initial"), rtol=RTOL, atol=ATOL)
    pm.assert_records_equal(records[-1], single_process_record(family, final, first[0], tmp_path / "final"), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_torchtitan_fsdp2_training_is_the_stock_trainers(launch, family):
    """Every rank's shards after the steps, with sinkwatch probing at 0, 2 and 3, are torch.equal to the stock
    Trainer's from the same initial weights and batches."""
    _, results = cell_results(launch, family)
    assert [r["same_as_stock"] for r in results] == [True, True]


def test_torchtitan_fsdp2_bf16_probes_say_the_dtype_they_compute_in(launch):
    """torchtitan's default parameter mixed precision (bfloat16 all-gathers of float32 shards): the probes run
    in it as training does, and the records say bfloat16 (float32 before: the shards' own dtype)."""
    d, results = cell_results(launch, "llama3_bf16")
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, tc.EVERY, tc.STEPS] and all("error" not in r for r in records)
    assert {r["probe_dtype"] for r in records} == {"bfloat16"}
    assert [r["logged_steps"] for r in results] == [[0, tc.EVERY, tc.STEPS], []]


@pytest.mark.parametrize("cell", ["llama3_tp", "llama3_tp_nosp"])
def test_torchtitan_tensor_parallel_records_equal_a_single_process_probe(launch, cell, tmp_path, torchtitan_here):
    """Tensor parallelism 2 (torchtitan's own plan; with its default sequence parallelism, whose residual stream
    the capture gathers whole, and without) is no longer refused: each rank computes its 8 of the 16 heads, and
    the records at steps 0 and 3 equal a single-process probe of the same weights gathered whole (head by head,
    in global order); training is the stock Trainer's to the bit."""
    d, results = cell_results(launch, cell)
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, tc.EVERY, tc.STEPS]
    per_step = tc.BATCH * tc.T  # one replica's rows: tensor-parallel peers read the same ones
    assert [r["tokens"] for r in records] == [0, tc.EVERY * per_step, tc.STEPS * per_step]
    assert {r["tensor_parallel"] for r in records} == {2} and {r["n_heads"] for r in records} == {16}
    assert [r["same_as_stock"] for r in results] == [True, True]
    first = [torch.load(d / f"first-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(first[0], first[1])
    initial = torch.load(d / "initial.pt", weights_only=True)
    final = torch.load(d / "final.pt", weights_only=True)
    for got, weights, name in ((records[0], initial, "initial"), (records[-1], final, "final")):
        want = single_process_record("llama3", weights, first[0], tmp_path / name)
        got = {k: v for k, v in got.items() if k not in ("tensor_parallel", "probe_split")}
        want = {k: v for k, v in want.items() if k != "probe_split"}
        pm.assert_records_equal(got, want, rtol=RTOL, atol=ATOL)


def test_the_torchtitan_launch_ended_cleanly(launch):
    out, rc, output = launch
    assert rc == 0, output[-6000:]
    assert "Timeout" not in output and "Traceback" not in output, output[-6000:]
