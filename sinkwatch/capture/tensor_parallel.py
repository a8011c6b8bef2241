"""What a capture target needs on a tensor-parallel rank (docs/design.md §9, "Tensor parallelism").

A tensor-parallel rank's attention sees its own block of query heads: the statistics take them as they
are (``probe_share.combine`` places them in global order). Everything else a probe reads must be whole on
the rank: the residual stream (a replicated DTensor's local tensor; under sequence parallelism its position
shards gathered, one all-gather per block output), the
last position's logits (the vocabulary shards of a column-parallel output layer, gathered), and every
position's next-token loss (computed on the vocabulary shards, as a vocabulary-parallel loss does: three
all-reduces over the group, never every position's whole logits). Each helper is a collective of the
tensor-parallel group that every rank runs at the same point of the same probe forward.
"""

from __future__ import annotations

import torch


def is_dtensor(x) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(x, DTensor)


def whole(x):
    """``x`` as a plain tensor holding the whole value: a replicated DTensor's local tensor, any other DTensor
    gathered (a collective of its mesh), a plain tensor as it is."""
    if not is_dtensor(x):
        return x
    if all(p.is_replicate() for p in x.placements):
        return x.to_local()
    return x.full_tensor()


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` concatenated along its last axis over ``group``'s ranks in rank order (the vocabulary shards of a
    column-parallel output layer); ``x`` itself when ``group`` is None."""
    if group is None:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def shard_offset(x) -> int:
    """The first vocabulary id of this rank's shard of a DTensor's last axis: from the DTensor's own layout,
    so an indivisible vocabulary (``Shard(-1)`` of V = 7 over 2 ranks: 4 and 3 ids) is placed right."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _shape, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    return int(offset[-1])


def vocab_parallel_token_losses(local: torch.Tensor, ids: torch.Tensor, group, offset: int | None = None) -> torch.Tensor:
    """Next-token losses (B, S-1) float32 from this rank's vocabulary shard of every position's logits
    ``local`` (B, S, width; it holds ids [offset, offset + width): ``offset`` from the DTensor,
    ``shard_offset``; None: rank r of equal shards, r·width): the log-sum-exp and the target's logit
    each assembled with an all-reduce over ``group``, as a vocabulary-parallel cross-entropy does."""
    import torch.distributed as dist

    x = local[:, :-1].float()  # (B, S-1, width)
    targets = ids[:, 1:].to(x.device)
    width = x.shape[-1]
    start = dist.get_rank(group) * width if offset is None else offset
    top = x.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    x = x - top[..., None]
    total = x.exp().sum(dim=-1)
    dist.all_reduce(total, group=group)
    own = (targets >= start) & (targets < start + width)
    picked = x.gather(-1, (targets - start).clamp(0, width - 1)[..., None])[..., 0]
    target = torch.where(own, picked, torch.zeros_like(picked))
    dist.all_reduce(target, group=group)
    return torch.log(total) - target
