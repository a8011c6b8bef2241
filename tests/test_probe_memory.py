"""The live pre-probe memory check (sinkwatch/probe/memory.py): it counts what the caching allocator
holds free, and a refusal names a ``batch_tokens`` that fits. The allocator's numbers are mocked (no
GPU here); what the estimate is measured against: benchmarks/bench_probe_vocab.py."""

import pytest
import torch
from tiny_models import build

from sinkwatch import InductionProbe, Monitor, RepeatedRandomProbe
from sinkwatch.capture import HFTarget
from sinkwatch.distributed import ProbeNotReady
from sinkwatch.probe_memory import WORKSPACE_BYTES, check_probe_memory, estimate

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


# ---- what the probe allocates in its layout: the split, the compute dtype, FSDP's gathers -------------------
def test_under_the_split_each_rank_is_checked_for_its_own_share(allocator):
    """At W = 8 a rank runs ceil(100 / 8) = 13 of the induction probe's 100 sequences, not a whole 64-row
    micro-batch: a probe that fits that share is not refused (before: refused, about 5x over), and a
    refusal names a batch_tokens below the share, which changes what the rank runs."""
    target = _OnCuda(build("llama", seed=1))
    sets = Monitor([InductionProbe(n=100, seq_len=256)]).probe_sets(256)
    alone, tokens1, rows1 = estimate(target, sets, 16384)
    split, tokens8, rows8 = estimate(target, sets, 16384, ranks=8)
    assert (rows1, tokens1) == (64, 64 * 256) and (rows8, tokens8) == (13, 13 * 256)
    allocator.update(free=split.need(tokens8, rows8))
    check_probe_memory(target, sets, 16384, ranks=8)
    with pytest.raises(ProbeNotReady):
        check_probe_memory(target, sets, 16384)
    allocator.update(free=split.need(6 * 256, 6))  # room for 6 of the share's 13 sequences per forward
    with pytest.raises(ProbeNotReady, match="share") as refused:
        check_probe_memory(target, sets, 16384, ranks=8)
    suggested = int(str(refused.value).split("batch_tokens=")[1].split(")")[0])
    assert suggested < 13 * 256  # fewer sequences per forward than the share: the remedy changes what this rank runs
    check_probe_memory(target, sets, suggested, ranks=8)


def test_activations_are_counted_in_the_dtype_the_probe_computes_in():
    """bf16 autocast (or FSDP parameter mixed precision) over float32 weights: activations in bf16, half the bytes."""
    target = HFTarget(build("llama", seed=1))
    f32, *_ = estimate(target, _sets(), 16384)
    bf16, *_ = estimate(target, _sets(), 16384, dtype=torch.bfloat16)
    assert bf16.per_token * 2 == f32.per_token


def test_fsdp_gathers_count_the_root_and_the_two_largest_units(tmp_path):
    """FSDP2 on one rank: what a probe all-gathers is the root's own parameters (embeddings, head, final norm)
    and the two largest blocks', in the gather dtype; nothing without FSDP (DDP: resident already)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from sinkwatch.probe_memory import gathered_bytes

    model = build("llama", seed=1)
    assert gathered_bytes(model, torch.float32) == 0
    blocks = model.model.layers
    block = sum(p.numel() for p in blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - len(blocks) * block
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for b in blocks:
            fully_shard(b, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        assert gathered_bytes(model, torch.bfloat16) == 2 * (root + 2 * block)
    finally:
        dist.destroy_process_group()


def test_megatron_estimate_reads_its_parallel_layers_logits_and_scores(tmp_path):
    """Megatron's VocabParallelEmbedding and Column/RowParallelLinear are no nn.Embedding / nn.Linear: the
    widths come from their own attributes, and its forward's (B, S, V/TP) logits (x3) and the local
    attention's [B·H/TP, S, S] scores (x3) are counted (a real GPTModel, one process)."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron_helpers import SEQ, VOCAB, build_gpt, cpu_megatron

    from sinkwatch.capture.megatron import MegatronTarget
    from sinkwatch.probe_memory import _widths

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cpu_megatron(1)
        target = MegatronTarget(build_gpt())  # width 64, 4 heads in 2 groups, MLP 256
        assert _widths(target) == (64, 256)
        sets = Monitor([InductionProbe(n=8, seq_len=SEQ)]).probe_sets(SEQ)
        model, tokens, rows = estimate(target, sets, 4 * SEQ)
        assert (tokens, rows) == (4 * SEQ, 4)
        assert model.per_token == 4 * (8 * 64 + 3 * 256)
        logits, scores = 3 * rows * SEQ * VOCAB * 4, 3 * rows * 4 * SEQ * SEQ * 4
        assert model.fixed == WORKSPACE_BYTES + logits + scores
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()
