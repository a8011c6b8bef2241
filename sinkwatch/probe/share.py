"""Each data-parallel rank's share of a probe's sequences, and how the shares combine (docs/design.md §9).

Under data parallelism every rank holds the whole model (DDP, DeepSpeed ZeRO-1/2) or gathers it
in each forward (FSDP, FSDP2): a probe replicated on every rank, or run by rank 0 while the others
wait, costs every rank the whole probe. Split instead, each rank runs a contiguous block of every
probe set's sequences:

- rank r of W takes sequences ``[r·c, min(N, (r+1)·c))`` with ``c = ceil(N / W)``, and every rank
  runs the same number of forwards, ``ceil(c / micro)``: a rank whose block is shorter (or empty,
  when N < W) pads with one-sequence forwards whose results count for nothing. Under FSDP each
  forward is a collective (its all-gathers), so equal counts are what keeps the ranks in step;
- what a probe keeps per sequence (sink α, the gathered probabilities, P0 norms and vectors, the
  target's loss, the copy losses) is placed at its sequences' rows of an array of the whole
  probe's shape, zero elsewhere; what it keeps as a sum (PR's per-head Gram matrices, their column
  sums, the row count) is kept as is. Every array of every probe set goes into one float64 tensor
  of a layout every rank derives alike, and one all-reduce (sum) combines them: adding zeros is
  exact, so each rank then holds exactly the arrays one process would have computed (medians,
  spectra and thresholds are then taken from the values themselves, never from per-rank results);
- the metrics are then computed from those arrays on every rank, as in one process.

Under tensor parallelism (docs/design.md §9, "Tensor parallelism") the ranks of one tensor-parallel group
run the same sequences (their data-parallel replica's share) and each holds only its block of every layer's
query heads (``heads``: rank t of T holds heads [t·H/T, (t+1)·H/T) in global order). Each rank computes its
own heads' statistics with the same kernels; an array with a head axis (a run's ``HEADS``) is placed at this
rank's block of that axis, zero elsewhere, and what every tensor-parallel rank computes alike (the residual
stream's P0 statistics, the losses of the vocab-parallel head, the row count) only by tensor-parallel rank 0.
The same one all-reduce, over every rank, then assembles the whole record: one gather of the heads over
the tensor-parallel group and the sum over the data-parallel shares at once, exact for the same reason.

``ProbeShare`` is framework-free: the live layer hands it the all-reduce of its process group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ProbeShare:
    """This rank's share: ``rank`` of ``size`` data-parallel shares; ``all_reduce`` sums a tensor in place
    over every rank that probes (all shares, and every tensor-parallel rank of each). ``heads``: this
    rank's (tensor-parallel rank, size): the block of query heads it holds (``(0, 1)``: every head)."""

    rank: int
    size: int
    all_reduce: Callable[[torch.Tensor], None]
    heads: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise ValueError(f"a probe share needs 0 <= rank < size, got rank {self.rank!r} of {self.size!r}")
        t, tp = self.heads
        if not (isinstance(tp, int) and tp >= 1 and isinstance(t, int) and 0 <= t < tp):
            raise ValueError(f"a probe share's heads need 0 <= tensor-parallel rank < size, got {self.heads!r}")

    def bounds(self, n: int) -> tuple[int, int]:
        """The [start, stop) of this rank's sequences among ``n``."""
        per = _ceil_div(n, self.size)
        start = min(n, self.rank * per)
        return start, min(n, start + per)

    def forwards(self, n: int, micro: int) -> int:
        """The forwards every rank runs for ``n`` sequences at ``micro`` per forward (the same on each)."""
        return _ceil_div(_ceil_div(n, self.size), micro)


def _head_axes(entry: tuple) -> dict[str, int]:
    return entry[5] if len(entry) > 5 and entry[5] else {}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def micro_batches(n: int, micro: int, share: ProbeShare | None) -> Iterator[tuple[slice, bool]]:
    """(sequences, real) per forward: this rank's micro-batches of ``micro`` sequences, then the
    one-sequence padding forwards (``real`` False) that give every rank the same count."""
    start, stop = share.bounds(n) if share is not None else (0, n)
    count = 0
    for b0 in range(start, stop, micro):
        count += 1
        yield slice(b0, min(stop, b0 + micro)), True
    for _ in range(count, share.forwards(n, micro) if share is not None else count):
        yield slice(0, min(1, n)), False


# A run's state: name -> array. Names in a run's ``SUMS`` are sums over sequences (any shape);
# every other array is per sequence, its first axis this rank's sequences. None: not produced.
State = dict[str, "np.ndarray | None"]


def combine(states: list[tuple], share: ProbeShare) -> list[State]:
    """The whole probe's arrays on every rank from each rank's share, with one all-reduce.

    ``states``: per run, (its state, its sum names, the probe set's N, this rank's [start, stop), whether
    the state holds real sequences — False: a template from padding forwards, giving the layout only —
    and optionally its head axes, name -> axis of the query heads). Every rank must pass the same runs
    in the same order, arrays of the same trailing shapes and dtypes (the same model and probe sets);
    the layout is derived from them alone (a head axis holds this rank's heads: the whole is ``heads[1]``
    times as long)."""
    t, tp = share.heads
    layout = []  # (run, name, full shape, dtype, offset)
    offset = 0
    for i, (state, sums, n, *_rest) in enumerate(states):
        axes = _head_axes(states[i])
        for name in sorted(state):
            arr = state[name]
            if arr is None:
                continue
            arr = np.asarray(arr)
            shape = list(arr.shape if name in sums else (n, *arr.shape[1:]))
            if name in axes:
                shape[axes[name]] *= tp
            layout.append((i, name, tuple(shape), arr.dtype, offset))
            offset += int(np.prod(shape))
    flat = np.zeros(offset, dtype=np.float64)
    for i, name, shape, _, at in layout:
        state, sums, _, (start, stop), real, *_rest = states[i]
        axes = _head_axes(states[i])
        if not real or (t > 0 and name not in axes):
            continue  # replicated over the tensor-parallel group: tensor-parallel rank 0's alone
        arr = np.asarray(state[name], dtype=np.float64)
        full = flat[at : at + int(np.prod(shape))].reshape(shape)
        if name in axes:  # this rank's block of heads
            axis = axes[name]
            h = arr.shape[axis]
            full = full[(slice(None),) * axis + (slice(t * h, (t + 1) * h),)]
        if name in sums:
            full[...] = arr
        else:
            assert arr.shape[0] == stop - start, (name, arr.shape, start, stop)  # internal: one row per own sequence
            full[start:stop] = arr
    tensor = torch.from_numpy(flat)
    share.all_reduce(tensor)
    flat = tensor.numpy()
    out: list[State] = [{name: None for name in state} for state, *_ in states]
    for i, name, shape, dtype, at in layout:
        out[i][name] = flat[at : at + int(np.prod(shape))].reshape(shape).astype(dtype)
    return out
