"""DDP with 2 CPU processes (gloo): records equal a single-process probe; one set of logs and alerts."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import GPT2LMHeadModel

from sinkwatch import Monitor
from sinkwatch.reporting.jsonl import read_jsonl

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "WANDB_MODE": "offline"}
    res = subprocess.run([sys.executable, str(HERE / "ddp_lightning.py"), str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def test_ddp_records_equal_a_single_process_probe(ddp_run):
    from ddp_lightning import PROBES

    records = read_jsonl(ddp_run / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 5, 10]  # written once, by rank 0
    model = GPT2LMHeadModel.from_pretrained(ddp_run / "final")
    single = Monitor(PROBES).probe(model).to_record()
    last = records[-1]
    for key in ("sink_alpha", "pr", "induction_score", "p0_norm_ratio", "sink_profile"):
        np.testing.assert_allclose(np.array(last[key], dtype=float), np.array(single[key], dtype=float), rtol=1e-5, atol=1e-7, err_msg=key)
    for cls in single["selectivity"]:
        np.testing.assert_allclose(np.array(last["selectivity"][cls], dtype=float), np.array(single["selectivity"][cls], dtype=float), rtol=1e-5, atol=1e-6)
    assert last["probe_hash"] == single["probe_hash"]


def test_ddp_logs_and_alerts_once(ddp_run):
    events = read_jsonl(ddp_run / "sw" / "events.jsonl")
    assert [(e["previous"], e["stage"]) for e in events] == [("none", "final")]
    runs = list((ddp_run / "sw" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # one W&B run: only global rank 0 reports
