"""Tensor parallelism as one mechanism for every adapter (docs/design.md §9, "Tensor parallelism").

Under tensor parallelism a rank holds a block of every layer's query heads and computes only those.
sinkwatch follows the same split: each rank's capture hands the statistics its own heads' q and k (the
attention input after RoPE), with the same kernels as everywhere; the residual stream (P0 statistics)
is whole on every rank of the group; the losses come from the vocabulary-parallel head. One all-reduce
over every rank (``probe_share.combine``) then places each rank's heads at their global positions and
sums the data-parallel shares, so every rank holds the record one process would have computed.

``TensorParallel`` is what an adapter tells the live core about this rank's place: its tensor-parallel
group, rank and size, and its data-parallel rank and size (the replicas the probe's sequences are split
over). Every rank of the job probes together; the ranks of one tensor-parallel group run the same
sequences, in step, because their forwards are collectives (the row-parallel all-reduces).

``hand_sliced_params`` finds Megatron-style tensor parallelism (plain tensors marked
``tensor_model_parallel``), which ``check_layout`` refuses when no adapter described it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place under tensor parallelism: ``rank`` of ``size`` in its tensor-parallel ``group``
    (a ``torch.distributed`` process group; heads [rank·H/size, (rank+1)·H/size) are its own), and
    ``dp_rank`` of ``dp_size`` data-parallel replicas (the probe's sequences are split over those)."""

    group: Any
    rank: int
    size: int
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        for name, lo in (("size", 1), ("dp_size", 1), ("rank", 0), ("dp_rank", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"TensorParallel({name}=...) must be an int >= {lo}, got {v!r}")
        if self.rank >= self.size or self.dp_rank >= self.dp_size:
            raise ValueError(f"TensorParallel: rank {self.rank} of {self.size}, dp_rank {self.dp_rank} of {self.dp_size} is out of range")

    @classmethod
    def of_group(cls, group, *, dp_rank: int = 0, dp_size: int = 1) -> TensorParallel:
        """From a tensor-parallel process group (this rank's rank and size in it)."""
        import torch.distributed as dist

        return cls(group, dist.get_rank(group), dist.get_world_size(group), dp_rank, dp_size)


def hand_sliced_params(module) -> list[str]:
    """Names of parameters marked tensor-parallel by Megatron-core (``tensor_model_parallel`` True: a
    slice of a weight split over the tensor-parallel ranks), when there are several such ranks."""
    if module is None:
        return []
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return []
    marked = [n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)]
    if not marked:
        return []
    # a one-rank tensor-parallel group marks its parameters too, and they hold the whole weight
    state = sys.modules.get("megatron.core.parallel_state")  # never imported here: only where Megatron built the model
    if state is not None and state.model_parallel_is_initialized() and state.get_tensor_model_parallel_world_size() == 1:
        return []
    return marked
