"""Lightning Fabric under DDP and FSDP2 (``ModelParallelStrategy``) on 2 gloo processes, as the
parallel matrix checks the other adapters: one launch of tests/fabric_cells.py under a timeout (each
cell under a watchdog), the callback at its defaults, first batches that differ by rank. Each cell's
records are written once (rank 0), count both ranks' tokens, hold whole heads, and the last equals a
single-process run of the same core on rank 0's first batch and the final weights. Every rank probes
its share of the sequences (the bare module under DDP, the sharded root under FSDP2), with rank 0's
natural windows."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("litgpt")

from torchrun import run_logged, torchrun  # noqa: E402

from sinkwatch.live import LiveConfig  # noqa: E402
from sinkwatch.probes import natural_windows  # noqa: E402
from sinkwatch.reporting.jsonl import read_jsonl  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import fabric_cells as fc  # noqa: E402
import parallel_matrix as pm  # noqa: E402

LAUNCH_TIMEOUT_S = 300
CELLS = ["fabric_ddp", "fabric_fsdp2"]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric-cells")
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "WANDB_MODE": "offline",
        "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)  # DETAIL's checker crashes torch 2.13's DDP constructor on CPU (see test_parallel_matrix)
    env.pop("SINKWATCH_FABRIC", None)
    rc, log = run_logged(torchrun(HERE / "fabric_cells.py", str(out), *CELLS), out, env, LAUNCH_TIMEOUT_S)
    return out, rc, log


def cell_dir(launch, cell: str) -> Path:
    out, rc, output = launch
    d = out / cell
    missing = [r for r in range(2) if not (d / f"result-rank{r}.json").exists()]
    assert not missing, f"{cell}: ranks {missing} never finished (launch rc {rc})\n{output[-6000:]}"
    for r in range(2):
        result = json.loads((d / f"result-rank{r}.json").read_text())
        assert result["status"] == "ok", result.get("traceback")
    return d


def own_windows(d: Path, rank: int) -> torch.Tensor:
    ids = torch.load(d / f"first-rank{rank}.pt", weights_only=True)["input_ids"]
    T = min(LiveConfig().natural_seq_len, ids.shape[1], fc.T)
    return natural_windows(ids, T, LiveConfig().natural_n)


@pytest.mark.parametrize("cell", CELLS)
def test_fabric_cell_equals_a_single_process_run(launch, cell, tmp_path):
    d = cell_dir(launch, cell)
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, fc.EVERY, fc.STEPS]  # once each: rank 0 alone writes
    per_step = fc.MICRO * fc.T * 2  # both ranks' batches
    assert [r["tokens"] for r in records] == [0, fc.EVERY * per_step, fc.STEPS * per_step]
    assert {r["n_heads"] for r in records} == {4} and {r["model"] for r in records} == {"litgpt.tiny-llama"}
    windows = own_windows(d, 0)
    assert torch.equal(torch.load(d / "natural-rank0.pt"), windows)
    # every rank probed its share of the sequences, with rank 0's windows (its own batch differs)
    assert torch.equal(torch.load(d / "natural-rank1.pt"), windows)
    assert not torch.equal(own_windows(d, 1), windows)
    assert {r["probe_split"]["ranks"] for r in records} == {2}
    if cell == "fabric_fsdp2":
        assert "FSDPGPT" in json.loads((d / "sharded.json").read_text())
        # the step-0 probe (before the first forward) left training bit-identical to an unmonitored run (before: after
        # the first backward, before optimizer.step(), with FSDP2's root left unsharded: step 2 ran on stale weights)
        same = json.loads((d / "identical.json").read_text())
        assert same["losses"] == same["plain_losses"] and all(same["weights_identical"].values()), same
    assert len(list((d / "sw" / "wandb").glob("offline-run-*"))) == 1  # one W&B run, rank 0's
    model = fc.tiny_gpt()
    model.load_state_dict(torch.load(d / "final.pt", weights_only=True))
    first = torch.load(d / "first-rank0.pt", weights_only=True)
    pm.assert_records_equal(records[-1], pm.single_process_record(model.eval(), first, tmp_path))


def test_the_launch_ended_cleanly(launch):
    out, rc, output = launch
    assert rc == 0, output[-6000:]
    assert "Timeout" not in output and "Traceback" not in output, output[-6000:]
