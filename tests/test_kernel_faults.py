"""Which Triton faults give up the kernel.

Faults are injected at named points of the real call path, on CPU through the Triton interpreter
(on a GPU, the same tests run on CUDA tensors):

- ``outputs``: the kernel's output allocation (``triton_stats.empty_outputs``) fails for want of
  memory — a real allocator failure (an impossible allocation on the tensors' device first), or the
  ``torch.OutOfMemoryError`` CUDA's caching allocator raises. Transient: that call raises, the
  process keeps the kernel.
- ``first-launch sync`` (``api._synchronize``, once per device after the kernel's first launch):
  raises what ``torch.cuda.synchronize`` raises after a kernel's illegal memory access. The fault
  is attributed to the kernel there: one warning, the torch path from then on.

A compile/launch failure that is real on CPU (no interpreter) is tests/test_kernel_fallback.py; a
real asynchronous fault on a GPU is ``test_a_real_async_fault_is_attributed_to_the_kernel`` (GPU
only, run by benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import sinkwatch.kernels.api as api  # noqa: E402
from sinkwatch import attention_stats  # noqa: E402
from sinkwatch.kernels import resolve_backend  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA:
    from sinkwatch.kernels import triton_stats  # noqa: E402

    if not triton_stats._INTERPRET:
        pytest.skip("the Triton kernel module was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)
else:
    from sinkwatch.kernels import triton_stats  # noqa: E402

FALLBACK = "Triton attention-statistics kernel failed"
ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"  # what the next synchronizing call raises


@pytest.fixture
def fresh(monkeypatch):
    """This process as if the kernel had never run: no failure recorded, no device checked."""
    monkeypatch.setattr(api, "_triton_failure", None)
    monkeypatch.setattr(api, "_checked_devices", set(), raising=False)


def inputs():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 16, 16, generator=g), torch.randn(1, 2, 16, 16, generator=g)
    return q.to(DEVICE), k.to(DEVICE)


def fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if FALLBACK in str(w.message)]


def allocator_failure(problem):
    torch.empty(1 << 60, dtype=torch.uint8, device=problem.q.device)  # 1 EiB: the real allocator refuses


def caching_allocator_oom(problem):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB")


@pytest.mark.parametrize("fault", [allocator_failure, caching_allocator_oom], ids=["allocator", "torch.OutOfMemoryError"])
def test_out_of_memory_fails_that_call_and_the_process_keeps_the_kernel(fresh, monkeypatch, fault):
    real_outputs = triton_stats.empty_outputs

    def outputs_on_a_full_device(problem):
        fault(problem)
        return real_outputs(problem)

    q, k = inputs()
    monkeypatch.setattr(triton_stats, "empty_outputs", outputs_on_a_full_device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises((torch.OutOfMemoryError, RuntimeError)) as raised:
            attention_stats(q, k, 0.25, backend="triton")
        assert api.is_out_of_memory(raised.value)
        assert not fallback_warnings(caught) and api.triton_failure() is None
        assert resolve_backend("triton", DEVICE) == "triton"
        monkeypatch.setattr(triton_stats, "empty_outputs", real_outputs)  # the memory is back
        again = attention_stats(q, k, 0.25, backend="triton")
    assert not fallback_warnings(caught) and api.triton_failure() is None
    direct = triton_stats.attention_stats_triton(api.validate(q, k, 0.25, None, None, 8, None, None))
    assert all(torch.equal(a, b) for a, b in zip(again, direct))  # the kernel's own numbers, not the torch path's


def test_an_async_fault_surfaces_at_the_first_launch_sync_and_falls_back_once(fresh, monkeypatch):
    synced = []

    def faulting_sync(device):
        synced.append(str(torch.device(device)))
        raise RuntimeError(ILLEGAL_ACCESS)

    q, k = inputs()
    monkeypatch.setattr(api, "_synchronize", faulting_sync, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = attention_stats(q, k, 0.25, backend="triton")
        second = attention_stats(q, k, 0.25, backend="auto")
    assert synced == [str(torch.device(DEVICE))]  # once, after the first launch; never again on the torch path
    (message,) = fallback_warnings(caught)
    assert ILLEGAL_ACCESS in message and api.triton_failure() == f"RuntimeError: {ILLEGAL_ACCESS}"
    assert resolve_backend("triton", DEVICE) == resolve_backend("auto", DEVICE) == "torch"
    expected = attention_stats(q, k, 0.25, backend="torch")
    assert all(torch.equal(a, b) and torch.equal(b, c) for a, b, c in zip(first, second, expected))


def test_each_device_is_synchronized_once_after_its_first_launch(fresh, monkeypatch):
    synced = []
    monkeypatch.setattr(api, "_synchronize", lambda device: synced.append(str(torch.device(device))), raising=False)
    q, k = inputs()
    for _ in range(3):
        attention_stats(q, k, 0.25, backend="triton")
    assert synced == [str(torch.device(DEVICE))] and api.triton_failure() is None


ASYNC_FAULT_CHILD = r"""
import json, warnings
import torch
import sinkwatch.kernels.api as api
from sinkwatch import attention_stats
q, k = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))  # 16-bit: q is read before the key loop
rows = torch.arange(64, device="cuda")[None]
attention_stats(q, k, 0.125, rows=rows, backend="triton")  # autotunes (synchronizes) and checks the device: clean
api._checked_devices.clear()  # the next launch is a "first" one again
problem = api.validate(q, k, 0.125, rows, None, 8, None, None)
bad = problem._replace(rows=torch.full_like(rows, 2**40))  # past validation: an out-of-bounds read
out = {"raised": None}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        api._triton_or_none(bad)
    except Exception as exc:
        out["raised"] = f"{type(exc).__name__}: {exc}"
out["warnings"] = [str(w.message) for w in caught]
out["failure"] = api.triton_failure()
print(json.dumps(out))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_a_real_async_fault_is_attributed_to_the_kernel():
    """An out-of-bounds read in a launch that does not autotune (no synchronization of its own)
    faults asynchronously; the first-launch sync attributes it to the kernel (the CUDA context is
    lost after such a fault, so this runs in a child process)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    res = subprocess.run([sys.executable, "-c", ASYNC_FAULT_CHILD], capture_output=True, text=True, env=env, timeout=300)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["raised"] is None, out  # caught where it surfaced: inside the kernel call, not at some later sync
    assert out["failure"] and "illegal memory access" in out["failure"].lower(), out
    assert any(FALLBACK in w and "illegal memory access" in w.lower() for w in out["warnings"]), out
