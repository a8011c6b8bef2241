"""A Triton kernel's first launch on each device is checked against the PyTorch path.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by conftest). Their output
is corrupted on purpose, by wrapping the real kernel call: a kernel whose first launch disagrees with
the PyTorch path beyond ``api.CHECK_ATOL``/``CHECK_RTOL`` is given up for the process after one
warning, the call's result is the PyTorch path's, and the record names ``stats_backend: torch``. Under
data parallelism every rank gives it up when one rank's check fails (tests/kernel_agree.py, two
processes over gloo).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import sinkwatch.kernels.api as api  # noqa: E402
from sinkwatch import InductionProbe, Monitor, MonitorConfig, attention_stats  # noqa: E402
from sinkwatch.kernels import attention_output, resolve_backend  # noqa: E402

if not torch.cuda.is_available():
    from sinkwatch.kernels import triton_stats  # noqa: E402

    if not triton_stats._INTERPRET:
        pytest.skip("the Triton kernel module was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)
from sinkwatch.kernels import triton_fused, triton_stats  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STATS_FALLBACK = "Triton attention-statistics kernel failed"
FUSED_FALLBACK = "fused Triton attention-output kernel failed"
HERE = Path(__file__).parent


@pytest.fixture
def fresh(monkeypatch):
    """This process as if no kernel had run: nothing given up, no device checked."""
    for name, value in (("_triton_failure", None), ("_fused_failure", None), ("_checked_devices", set()), ("_checked_fused", set())):
        monkeypatch.setattr(api, name, value)


def corrupt(monkeypatch, module, name, change):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: change(real(*args)))


def inputs(S=40):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, S, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    return q, k, v


def caught_messages(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]


def test_a_statistics_kernel_that_disagrees_is_given_up_once(fresh, monkeypatch):
    """first + 0.01 on every cell: one warning naming the mismatch, the torch path's numbers for that
    call and every later one, and ``resolve_backend`` (the record's stats_backend) says torch."""
    corrupt(monkeypatch, triton_stats, "attention_stats_triton", lambda s: s._replace(first=s.first + 0.01))
    q, k, _ = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = attention_stats(q, k, 0.25, backend="triton")
        second = attention_stats(q, k, 0.25, backend="auto")
    (message,) = caught_messages(caught, STATS_FALLBACK)
    assert "KernelMismatch" in message and "first" in message
    assert resolve_backend("triton", DEVICE) == "torch"
    expected = attention_stats(q, k, 0.25, backend="torch")
    assert all(torch.equal(a, b) and torch.equal(b, c) for a, b, c in zip(first, second, expected))


def test_a_kernel_within_the_tolerance_is_kept(fresh, monkeypatch):
    """A difference of float32 rounding's size (1e-6) passes: the kernel's own numbers come back."""
    corrupt(monkeypatch, triton_stats, "attention_stats_triton", lambda s: s._replace(lse=s.lse + 1e-6))
    q, k, _ = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = attention_stats(q, k, 0.25, backend="triton")
    assert not caught_messages(caught, STATS_FALLBACK) and api.triton_failure() is None
    assert not torch.equal(got.lse, attention_stats(q, k, 0.25, backend="torch").lse)


def test_a_probe_through_a_corrupted_kernel_records_the_torch_path(fresh, monkeypatch):
    """A whole probe with backend="triton" and a corrupted kernel: one warning, the record says
    stats_backend torch and holds the torch path's numbers."""
    from tiny_models import build

    corrupt(monkeypatch, triton_stats, "attention_stats_triton", lambda s: s._replace(gathered=s.gathered * 1.5))
    model, probes = build("llama"), [InductionProbe(n=4, seq_len=64)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = Monitor(probes, config=MonitorConfig(backend="triton")).probe(model).to_record()
    assert len(caught_messages(caught, STATS_FALLBACK)) == 1
    torch_record = Monitor(probes, config=MonitorConfig(backend="torch")).probe(model).to_record()
    assert record["stats_backend"] == torch_record["stats_backend"] == "torch"
    assert record["selectivity"] == torch_record["selectivity"] and record["sink_alpha"] == torch_record["sink_alpha"]


def test_a_fused_kernel_that_disagrees_is_given_up_once(fresh, monkeypatch):
    """The fused-output kernel's output scaled by 1.1: one warning, the PyTorch path's fused pass."""
    corrupt(monkeypatch, triton_fused, "attention_output_triton", lambda o: o._replace(output=o.output * 1.1))
    q, k, v = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = attention_output(q, k, v, 0.25, backend="triton")
        second = attention_output(q, k, v, 0.25, backend="triton")
    (message,) = caught_messages(caught, FUSED_FALLBACK)
    assert "output is off" in message
    expected = attention_output(q, k, v, 0.25, backend="torch")
    assert first.backend == second.backend == "torch"
    assert torch.equal(first.output, expected.output) and torch.equal(second.lse, expected.lse)


def test_data_parallel_ranks_agree_on_the_backend(tmp_path):
    """Rank 0's kernel is corrupted, rank 1's is not: both give it up before the probe's forwards, and
    both records (stats_backend torch) are the same."""
    from torchrun import run_logged, torchrun

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    rc, log = run_logged(torchrun(HERE / "kernel_agree.py", str(tmp_path)), tmp_path, env, timeout_s=300)
    assert rc == 0, log[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert "KernelMismatch" in ranks[0]["failure"] and "another data-parallel rank" in ranks[1]["failure"]
    assert all(len(r["warnings"]) == 1 for r in ranks)
    assert ranks[0]["record"]["stats_backend"] == ranks[1]["record"]["stats_backend"] == "torch"
    assert ranks[0]["record"] == ranks[1]["record"]
