"""The live pre-probe memory check (sinkwatch/probe_memory.py): it counts what the caching allocator
holds free, and a refusal names a ``batch_tokens`` that fits. The allocator's numbers are mocked (no
GPU here); what the estimate is measured against: benchmarks/bench_probe_vocab.py."""

import pytest
import torch
from tiny_models import build

from sinkwatch import InductionProbe, Monitor, RepeatedRandomProbe
from sinkwatch.capture import HFTarget
from sinkwatch.distributed import ProbeNotReady
from sinkwatch.probe_memory import check_probe_memory, estimate

MIB = 2**20


class _OnCuda(HFTarget):
    @property
    def device(self) -> torch.device:
        return torch.device("cuda:0")


@pytest.fixture
def allocator(monkeypatch):
    """Mocked device numbers: ``free`` (mem_get_info) and the allocator's reserved / allocated."""
    state = {"free": 0, "reserved": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    return state


def _sets():
    return Monitor([InductionProbe(n=64, seq_len=256), RepeatedRandomProbe(n=64)]).probe_sets(256)


def test_the_allocators_unused_reserve_counts_as_available(allocator):
    target = _OnCuda(build("llama", seed=1))
    sets = _sets()
    model, tokens, rows = estimate(target, sets, 16384)
    need = model.need(tokens, rows)
    allocator.update(free=need // 4, reserved=need, allocated=need // 4)  # 3/4 of need cached but unused
    check_probe_memory(target, sets, 16384)  # mem_get_info alone (need/4 free) would refuse
    allocator.update(free=need // 4, reserved=need // 4, allocated=need // 4)
    with pytest.raises(ProbeNotReady, match="GiB available on cuda:0"):
        check_probe_memory(target, sets, 16384)


def test_a_refusal_names_a_batch_tokens_that_fits(allocator):
    target = _OnCuda(build("llama", seed=1))
    sets = _sets()
    model, tokens, rows = estimate(target, sets, 16384)
    allocator.update(free=model.need(tokens, rows) - model.per_token * tokens // 2)  # half the activations fit
    with pytest.raises(ProbeNotReady) as refused:
        check_probe_memory(target, sets, 16384)
    suggested = int(str(refused.value).split("batch_tokens=")[1].split(")")[0])
    assert 256 <= suggested < 16384 and suggested % 256 == 0  # whole sequences of the longest probe
    check_probe_memory(target, sets, suggested)  # the named value passes the same check


def test_too_little_for_one_sequence_says_so(allocator):
    target = _OnCuda(build("llama", seed=1))
    allocator.update(free=MIB)
    with pytest.raises(ProbeNotReady, match="even one 256-token sequence"):
        check_probe_memory(target, _sets(), 16384)


def test_the_estimate_does_not_grow_with_the_vocabulary_beyond_the_last_logits():
    small = HFTarget(build("llama", seed=1))
    sets = _sets()
    a, tokens, rows = estimate(small, sets, 16384)
    big = build("llama", seed=1)
    big.resize_token_embeddings(262_144)
    b, _, _ = estimate(HFTarget(big), sets, 16384)
    assert b.per_token == a.per_token  # activations: no V x T term
    assert b.need(tokens, rows) - a.need(tokens, rows) == rows * (262_144 - 256) * 8  # the last position's logits only
