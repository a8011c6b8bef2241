"""What a probe allocates on its device, estimated before it starts (the live pre-probe check).

A probe forward runs under ``torch.no_grad()``, so its memory is the activations of the blocks that
are alive at once, the final hidden states the loss chunks read (``capture/head.py``), one loss
chunk, and the last position's logits — no all-position logits and no S x S matrix for the models whose
head and attention sinkwatch drives itself (docs/design.md §9) — plus what the layout gathers for it.
Megatron-core is the exception: its output layer computes every position's logits on this rank's
vocabulary shard and its local attention an S x S score buffer (``MegatronTarget.probe_forward_bytes``).
Per token that is a few rows of the model's widest
activations, in the dtype the probe computes in (bf16 under bf16 autocast or FSDP parameter mixed
precision: half of float32)::

    per_token = act_bytes * (8 * d + 3 * widest)      # residual, norms, q/k/v, the MLP's widest layers
    fixed     = rows * V * 4 * 2                       # last-position logits and their float copy
              + 3 * LOSS_CHUNK_BYTES                   # one loss chunk and cross-entropy's temporaries
              + WORKSPACE_BYTES                        # the statistics kernels' row blocks, allocator slack
              + gathered                               # FSDP: the root's parameters, the two largest units'
              + rows * T * V * act_bytes               # only a model that cannot return the last position alone
              + target.probe_forward_bytes(rows, T, act_bytes)   # a target's own extra (Megatron: below)

``d`` is the embedding width, ``widest`` the largest width a linear layer of block 0 writes on this rank
(a fused gate-up or qkv projection counts whole; Megatron's column-parallel linears their shard).
``rows`` is the largest micro-batch a rank runs:
under the probe split each rank runs only its share, ``ceil(N / W)`` sequences of each set, so a
probe that fits on a rank whose share is small is not refused for the whole set's rows. ``gathered``
is what the probe's forwards all-gather beyond the rank's own shards, in the dtype they are gathered
in: the root unit's parameters (embeddings, head, final norm: held for the whole probe) and the two
largest other units' (the one computing and the one being gathered next). Under DDP the parameters
are resident already (nothing gathered). It is an estimate with headroom, not a measurement
(benchmarks/bench_probe_vocab.py prints it beside the measured CPU peak). What the device can give is
its free memory plus what PyTorch's caching allocator holds reserved but unused (``mem_get_info``
alone counts that as used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..capture.head import LOSS_CHUNK_BYTES

WORKSPACE_BYTES = 64 * 2**20
GIB = 2**30



class ProbeNotReady(RuntimeError):
    """This rank cannot start a probe: not memory enough (``check_probe_memory``). Under the rank protocol
    every rank learns it before any collective of the probe (``sinkwatch.distributed``)."""


@dataclass(frozen=True)
class ProbeMemory:
    per_token: int  # bytes per probe token in one forward
    fixed: int  # bytes independent of the tokens per forward (one loss chunk, the gathered parameters)
    per_row: int  # bytes per sequence of last-position logits (V * 4 * 2)
    gathered: int = 0  # of ``fixed``: the parameters the layout gathers for the probe (FSDP)

    def need(self, tokens: int, rows: int) -> int:
        """Bytes for one forward of ``tokens`` tokens in ``rows`` sequences."""
        return self.per_token * tokens + self.fixed + self.per_row * rows

    def tokens_that_fit(self, available: int, rows: int) -> int:
        return max(0, (available - self.fixed - self.per_row * rows) // max(1, self.per_token))


def micro_batch_rows(seq_len: int, batch_tokens: int) -> int:
    """Sequences per probe forward of ``seq_len``-token sequences, as ``Monitor`` batches them (at least one)."""
    return max(1, batch_tokens // seq_len)


def _out_width(m: nn.Module) -> int | None:
    """The width a linear layer writes on this rank: ``nn.Linear`` / Transformer Engine's ``out_features``,
    Megatron's ``ColumnParallelLinear`` ``output_size_per_partition`` (its shard), ``RowParallelLinear``
    ``output_size`` (whole after its all-reduce). None: not a linear layer."""
    if isinstance(m, nn.Linear):
        return m.out_features
    for name in ("output_size_per_partition", "out_features", "output_size"):
        width = getattr(m, name, None)
        if isinstance(width, int) and isinstance(getattr(m, "weight", None), torch.Tensor):
            return width
    return None


def _in_width(m: nn.Module) -> int | None:
    for name in ("in_features", "input_size"):
        width = getattr(m, name, None)
        if isinstance(width, int):
            return width
    return None


def _is_embedding(m: nn.Module) -> bool:
    return isinstance(getattr(m, "embedding_dim", None), int) and isinstance(getattr(m, "weight", None), torch.Tensor)


def _widths(target) -> tuple[int, int]:
    """(d, widest) read off the target's modules: embeddings (``nn.Embedding``, Megatron's
    ``VocabParallelEmbedding``: anything with an ``embedding_dim`` and a weight) and the linear layers of
    block 0 (``nn.Linear``, Megatron's tensor-parallel linears, Transformer Engine's: ``_out_width``)."""
    module: nn.Module = target.module
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding) or _is_embedding(m)]
    d = max((m.embedding_dim for m in embeddings), default=0)
    blocks = target.blocks()
    linears = [m for m in blocks[0].modules() if _out_width(m) is not None] if len(blocks) else []
    widest = max((_out_width(m) for m in linears), default=4 * d)
    d = d or max((_in_width(m) or 0 for m in linears), default=1) or 1
    return d, widest


def estimate(
    target, sets, batch_tokens: int, *, ranks: int = 1, dtype: torch.dtype | None = None, outer=None
) -> tuple[ProbeMemory, int, int]:
    """The estimate for the largest micro-batch one rank runs: (model, tokens per forward, rows).

    ``ranks``: how many ranks share each probe's sequences (1: no split); ``dtype``: what the probe
    computes in (None: the parameters' own); ``outer``: the model as the strategy wraps it (FSDP's
    gathers are counted from it)."""
    d, widest = _widths(target)
    if dtype is None:
        param = next((p for p in target.module.parameters() if p.is_floating_point()), None)
        dtype = param.dtype if param is not None else torch.float32
    act_bytes = torch.empty((), dtype=dtype).element_size()
    losses = any(s.kind == "repeated" for s in sets)
    per_token = act_bytes * (8 * d + 3 * widest)
    gathered = gathered_bytes(outer, dtype)
    fixed = WORKSPACE_BYTES + (3 * LOSS_CHUNK_BYTES if losses else 0) + gathered
    V = int(target.vocab_size)
    # (rows, seq_len) of each set's largest micro-batch on one rank: its share of the set, in micro-batches
    largest = [(min(-(-s.n // max(1, ranks)), micro_batch_rows(s.seq_len, batch_tokens)), s.seq_len) for s in sets]
    rows = max(r for r, _ in largest)
    tokens = max(r * seq_len for r, seq_len in largest)
    if not _keeps_last_position(target):  # every position's logits come back from each forward
        fixed += max(r * seq_len for r, seq_len in largest) * V * act_bytes
    extra = getattr(target, "probe_forward_bytes", None)  # what the target's own forward allocates besides
    if extra is not None:
        fixed += max(extra(r, seq_len, act_bytes) for r, seq_len in largest)
    return ProbeMemory(per_token=per_token, fixed=fixed, per_row=V * 4 * 2, gathered=gathered), tokens, rows


def gathered_bytes(outer, dtype: torch.dtype) -> int:
    """Bytes a probe's forwards all-gather beyond this rank's shards: the root unit's own parameters (held
    for the whole probe) and the two largest other units' (one computing, one gathered next), as FSDP (v1)
    flat parameters or FSDP2 modules hold them, in ``dtype`` (parameter mixed precision gathers in it). 0
    without FSDP (DDP: every parameter is resident already)."""
    if outer is None:
        return 0
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    size = torch.empty((), dtype=dtype).element_size()
    units = []  # (is the outermost unit, elements it gathers)
    for m in outer.modules():
        if isinstance(m, FSDP):
            handle = getattr(m, "_handle", None)
            flat = getattr(handle, "flat_param", None)
            numel = int(sum(getattr(flat, "_numels", ()) or ())) if flat is not None else 0
            units.append((m, numel))
        elif isinstance(m, FSDPModule):
            inner = [sub for sub in m.modules() if sub is not m and isinstance(sub, FSDPModule)]
            nested = {id(p) for sub in inner for p in sub.parameters()}
            units.append((m, sum(p.numel() for p in m.parameters() if id(p) not in nested)))  # a DTensor's numel: the whole
    if not units:
        return 0
    root = units[0][1]  # modules() lists the outermost unit first
    rest = sorted((n for _, n in units[1:]), reverse=True)[:2]
    return size * (root + sum(rest))


def _keeps_last_position(target) -> bool:
    """Whether a probe forward returns the last position's logits only (transformers' ``logits_to_keep``,
    read off the target's head tap: None for a model that cannot)."""
    tap = getattr(target, "head_tap", None)
    return tap is None or tap() is not None


def available_bytes(device: torch.device) -> int:
    """Free device memory plus what the caching allocator holds reserved but unallocated."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def memory_verdict(target, sets, batch_tokens: int, available: int, *, ranks: int = 1, dtype=None, outer=None) -> str | None:
    """None when the probe fits in ``available`` bytes, else what to do in this layout (a
    ``batch_tokens`` that fits: fewer sequences per forward of this rank's share)."""
    model, tokens, rows = estimate(target, sets, batch_tokens, ranks=ranks, dtype=dtype, outer=outer)
    need = model.need(tokens, rows)
    if need <= available:
        return None
    longest = max(s.seq_len for s in sets)
    fit = model.tokens_that_fit(available, 1)
    where = f"{available / GIB:.2f} GiB available on {target.device}"
    if fit < longest:
        held = f", {model.gathered / GIB:.2f} GiB of it the parameters FSDP gathers for the probe" if model.gathered else ""
        return (
            f"{where}, the probe needs about {need / GIB:.2f} GiB and even one {longest}-token sequence per forward would "
            f"need {model.need(longest, 1) / GIB:.2f} GiB{held}; probe less often (every_n_steps) or when more memory is free"
        )
    suggest = max(longest, (model.tokens_that_fit(available, max(1, rows)) // longest) * longest)
    split = f" of this rank's share ({ranks} ranks share each probe)" if ranks > 1 else ""
    return (
        f"{where}, the largest micro-batch{split} ({tokens} tokens) needs about {need / GIB:.2f} GiB; "
        f"MonitorConfig(batch_tokens={suggest}) fits (tokens per probe forward: same numbers, more forwards)"
    )


def check_probe_memory(target, sets, batch_tokens: int, *, ranks: int = 1, dtype=None, outer=None) -> None:
    """The pre-probe check of this rank: on a CUDA device, what the probe's largest micro-batch on this rank
    allocates (``estimate``) against free memory plus the caching allocator's unused reserve, else
    ``ProbeNotReady`` naming a ``batch_tokens`` that fits."""
    if target.device.type != "cuda":
        return
    verdict = memory_verdict(target, sets, batch_tokens, available_bytes(target.device), ranks=ranks, dtype=dtype, outer=outer)
    if verdict is not None:
        raise ProbeNotReady(verdict)
