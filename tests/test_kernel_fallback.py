"""When the Triton kernel cannot launch, probes fall back to the torch path once.

The failure is real, not simulated: a child process imports the kernel without the interpreter
(TRITON_INTERPRET=0) and hands it CPU tensors, which Triton's own launcher refuses (no GPU driver
here; a CPU pointer where a GPU exists), as it would refuse a GPU or dtype the kernel lacks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent

CHILD = r"""
import json, warnings
import torch
from tiny_models import build
from sinkwatch import InductionProbe, Monitor, MonitorConfig, attention_stats
import sinkwatch.kernels.api as api

probes = [InductionProbe(n=4, seq_len=64)]
model = build("llama")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    triton_monitor = Monitor(probes, config=MonitorConfig(backend="triton"))
    first = triton_monitor.probe(model).to_record()
    second = triton_monitor.probe(model).to_record()
    q, k = torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    direct = attention_stats(q, k, 0.25, backend="triton")
torch_record = Monitor(probes, config=MonitorConfig(backend="torch")).probe(model).to_record()
expected = attention_stats(q, k, 0.25, backend="torch")
messages = [str(w.message) for w in caught if "Triton attention-statistics kernel failed" in str(w.message)]
print(json.dumps({
    "failure": api.triton_failure(), "messages": messages,
    "backends": [first["stats_backend"], second["stats_backend"]],
    "same_alpha": first["sink_alpha"] == torch_record["sink_alpha"] and second["sink_alpha"] == torch_record["sink_alpha"],
    "same_selectivity": first["selectivity"] == torch_record["selectivity"],
    "same_direct": all(torch.equal(a, b) for a, b in zip(direct, expected)),
}))
"""


def test_kernel_that_cannot_launch_falls_back_to_torch_once():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["failure"], "the Triton launch should have failed for real on CPU tensors"
    assert len(out["messages"]) == 1, out["messages"]  # warned once, for two probes and a direct call
    assert out["backends"] == ["torch", "torch"]  # the record names the kernel that computed it
    assert out["same_alpha"] and out["same_selectivity"] and out["same_direct"]
