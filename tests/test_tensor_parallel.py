"""The tensor-parallel half of ``probe_share.combine`` in one process (the real launches are
tests/test_megatron.py and tests/test_torchtitan_fsdp.py): 2 data-parallel shares x 2 tensor-parallel ranks,
each rank holding its block of heads of its share's sequences, give back exactly the whole arrays; what every
tensor-parallel rank computes alike counts once. And ``TensorParallel`` refuses a place that does not exist."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sinkwatch.distributed import TensorParallel
from sinkwatch.probe_share import ProbeShare, combine

N, L, H, K, D = 5, 2, 4, 3, 2  # sequences, layers, heads, sink profile, head dim
SUMS = ("gram", "count")
HEADS = {"alpha": 2, "gram": 1}


def whole_arrays(rng) -> dict:
    return {
        "alpha": rng.random((N, L, H, K)).astype(np.float32),  # per sequence, a head axis
        "ratio": rng.random((N, L)).astype(np.float32),  # per sequence, the same on every tensor-parallel rank
        "gram": rng.random((L, H, D, D)),  # a sum, a head axis
        "count": np.asarray(N),  # a sum, the same on every tensor-parallel rank
    }


def rank_state(whole: dict, share: ProbeShare) -> dict:
    """What one rank computes: its share's sequences, its block of heads."""
    start, stop = share.bounds(N)
    t, tp = share.heads
    h = slice(t * H // tp, (t + 1) * H // tp)
    return {
        "alpha": whole["alpha"][start:stop, :, h],
        "ratio": whole["ratio"][start:stop],
        "gram": whole["gram"][:, h] * (stop - start) / N,  # this share's part of the sum
        "count": np.asarray(stop - start),
    }


def test_heads_and_shares_combine_to_the_whole_arrays():
    whole = whole_arrays(np.random.default_rng(0))
    ranks = [(dp, t) for dp in range(2) for t in range(2)]
    sent = []

    def run(all_reduce):
        out = []
        for dp, t in ranks:
            share = ProbeShare(rank=dp, size=2, all_reduce=all_reduce, heads=(t, 2))
            start, stop = share.bounds(N)
            out.append(combine([(rank_state(whole, share), SUMS, N, (start, stop), stop > start, HEADS)], share)[0])
        return out

    run(lambda flat: sent.append(flat.clone()))  # each rank's contribution, as the all-reduce would receive it
    total = torch.stack(sent).sum(0)
    for got in run(lambda flat: flat.copy_(total)):  # every rank then holds the sum
        np.testing.assert_allclose(got["alpha"], whole["alpha"], rtol=0, atol=0)
        np.testing.assert_allclose(got["ratio"], whole["ratio"], rtol=0, atol=0)  # tensor-parallel rank 0's alone
        np.testing.assert_allclose(got["gram"], whole["gram"], rtol=1e-15)
        assert int(got["count"]) == N
        assert got["alpha"].dtype == np.float32


def test_a_tensor_parallel_place_must_exist():
    with pytest.raises(ValueError, match="out of range"):
        TensorParallel(None, 2, 2)
    with pytest.raises(ValueError, match="size"):
        TensorParallel(None, 0, 0)
    with pytest.raises(ValueError, match="heads"):
        ProbeShare(rank=0, size=1, all_reduce=lambda t: None, heads=(2, 2))


def test_vocab_parallel_losses_of_uneven_shards(monkeypatch):
    """A vocabulary DTensor Shard(-1) cannot split evenly (V = 7 over 2 ranks: ids 0-3 and 4-6): with each
    shard's offset (``shard_offset``), the losses assembled over the group equal cross-entropy of the whole
    logits. Two threads stand in for the two ranks; the all-reduce is emulated between them."""
    import threading

    import torch.distributed as dist

    from sinkwatch.capture.tensor_parallel import vocab_parallel_token_losses

    barrier, slots = threading.Barrier(2), {}

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        slots[threading.current_thread().name] = t.clone()
        barrier.wait()
        parts = torch.stack(list(slots.values()))
        result = parts.amax(0) if op == dist.ReduceOp.MAX else parts.sum(0)
        barrier.wait()
        t.copy_(result)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    ids[0, 1:] = torch.tensor([3, 4, 6, 0])  # targets on both sides of the shard boundary
    out = {}

    def rank(r, lo, hi):
        out[r] = vocab_parallel_token_losses(logits[..., lo:hi], ids, group=None, offset=lo)

    threads = [threading.Thread(target=rank, args=a, name=str(a[0])) for a in ((0, 0, 4), (1, 4, 7))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), ids[:, 1:].reshape(-1), reduction="none").view(2, 4)
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], expected)
