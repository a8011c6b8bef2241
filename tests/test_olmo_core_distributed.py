"""OLMo-core with FSDP2 (``dp_config=fsdp``: ``fully_shard`` on every block) on 2 CPU processes
(gloo, torchrun): training bit-identical with and without the callback, every rank probes together
(one that skipped the probe's all-gather would stall; the script dumps stacks and exits after 300 s),
rank 0 alone writes the records, and the parallelisms sinkwatch cannot probe are refused with
``UnsupportedModelError`` when applied for real on the 2-rank mesh."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("olmo_core")

from torchrun import torchrun  # noqa: E402

from sinkwatch.reporting.jsonl import read_jsonl  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("olmo_fsdp")
    cmd = torchrun(HERE / "olmo_core_dist.py", str(out), "fsdp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, torch.load(out / "result.pt", weights_only=False)


def test_fsdp2_training_bit_identical_and_every_rank_probes(fsdp_run):
    out, result = fsdp_run
    assert "FSDPTransformer" in result["sharded"] and len(result["sharded"]) >= 3  # the root and each block
    for name, value in result["plain"].items():
        assert torch.equal(value, result["watched"][name]), name
    records = read_jsonl(out / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4]  # once each: rank 0 alone reports
    assert [r["tokens"] for r in records] == [0, 2 * 4 * 64, 4 * 4 * 64]  # the global batch, both ranks
    assert {s: m["sinkwatch/step"] for s, m in result["logged"].items()} == {1: 0, 2: 2, 4: 4}


@pytest.mark.parametrize("kind", ["tensor", "context", "pipeline", "expert"])
def test_parallelisms_that_split_attention_are_refused(fsdp_run, kind):
    message = fsdp_run[1]["refused"][kind]
    assert f"{kind} parallelism" in message and "sinkwatch" in message
