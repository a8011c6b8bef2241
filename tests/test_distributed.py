"""DDP and FSDP2 with 2 CPU processes (gloo), through Lightning, and DDP through the HF Trainer
(torchrun): records equal a single-process probe of the final weights; tokens count every rank's
batch; one set of logs and alerts.

DDP: rank 0 alone probes the bare module. FSDP2 (ModelParallelStrategy + ``fully_shard``): every
rank runs the probe forward, whose pre-hooks all-gather each block's shards; rank 0 alone reports.
If only rank 0 probed, its all-gather would wait forever (the scripts dump stacks and exit after
300 s rather than stall).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torchrun import torchrun
from transformers import GPT2LMHeadModel

from sinkwatch import Monitor
from sinkwatch.reporting.jsonl import read_jsonl

HERE = Path(__file__).parent


LAUNCH = {
    "ddp": lambda out: [sys.executable, str(HERE / "ddp_lightning.py"), out],  # Lightning spawns rank 1
    "fsdp2": lambda out: [sys.executable, str(HERE / "fsdp2_lightning.py"), out],
    "ddp_hf": lambda out: torchrun(HERE / "ddp_hf.py", out),
}


@pytest.fixture(scope="module", params=sorted(LAUNCH))
def ddp_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "WANDB_MODE": "offline"}
    res = subprocess.run(LAUNCH[request.param](str(out)), capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def test_ddp_records_equal_a_single_process_probe(ddp_run):
    """Records written once by rank 0 equal a single-process probe of the saved model."""
    from ddp_lightning import PROBES

    records = read_jsonl(ddp_run / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 5, 10]  # written once, by rank 0
    assert [r["tokens"] for r in records] == [0, 5 * 4 * 2 * 32, 10 * 4 * 2 * 32]  # step x batch x ranks x length
    model = GPT2LMHeadModel.from_pretrained(ddp_run / "final")
    single = Monitor(PROBES).probe(model).to_record()
    last = records[-1]
    for key in ("sink_alpha", "pr", "induction_score", "p0_norm_ratio", "sink_profile"):
        np.testing.assert_allclose(np.array(last[key], dtype=float), np.array(single[key], dtype=float), rtol=1e-5, atol=1e-7, err_msg=key)
    for cls in single["selectivity"]:
        np.testing.assert_allclose(
            np.array(last["selectivity"][cls], dtype=float), np.array(single["selectivity"][cls], dtype=float), rtol=1e-5, atol=1e-6
        )
    assert last["probe_hash"] == single["probe_hash"]


def test_ddp_logs_and_alerts_once(ddp_run):
    """One event and one W&B run: only global rank 0 reports."""
    events = read_jsonl(ddp_run / "sw" / "events.jsonl")
    assert [(e["previous"], e["stage"]) for e in events] == [("none", "final")]
    runs = list((ddp_run / "sw" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # one W&B run: only global rank 0 reports


def test_user_hooks_and_reporters_run_on_global_rank_zero_only(ddp_run):
    # FSDP2: every rank probes, so every rank sees the events; only rank 0 may call the user's code
    hooks = sorted(p.name for p in (ddp_run / "hooks").iterdir())
    assert hooks == ["on_event-rank0.jsonl", "reporter-rank0.jsonl"], hooks
    events = [e["step"] for e in read_jsonl(ddp_run / "sw" / "events.jsonl")]
    assert [e["step"] for e in read_jsonl(ddp_run / "hooks" / "on_event-rank0.jsonl")] == events and events
    assert [r["step"] for r in read_jsonl(ddp_run / "hooks" / "reporter-rank0.jsonl")] == [0, 5, 10]


def test_fsdp_v1_probe_gathers_through_the_root_wrapper(tmp_path):
    # real FSDP v1 units on 2 CPU processes: each block a unit inside the root around the LightningModule
    import planted
    from ddp_lightning import PROBES

    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "WANDB_MODE": "disabled"}
    cmd = torchrun(HERE / "fsdp1_probe.py", str(tmp_path))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 1], res.stderr[-3000:]  # written once, by rank 0; no probe failed
    single = Monitor(PROBES).probe(planted.p0_final()).to_record()
    for rec in records:
        for key in ("sink_alpha", "pr", "induction_score", "p0_norm_ratio", "sink_profile"):
            got, want = np.array(rec[key], dtype=float), np.array(single[key], dtype=float)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=key)


def test_tensor_parallel_peers_count_their_shared_batch_once(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "WANDB_MODE": "offline"}
    cmd = [sys.executable, str(HERE / "tp_lightning.py"), str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["tokens"] for r in records] == [0, 5 * 4 * 32, 10 * 4 * 32]  # step x batch x length, data-parallel size 1
