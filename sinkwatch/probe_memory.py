"""What a probe allocates on its device, estimated before it starts (the live pre-probe check).

A probe forward runs under ``torch.no_grad()``, so its memory is the activations of the blocks that
are alive at once, the final hidden states the loss chunks read (``capture/head.py``), one loss
chunk, and the last position's logits — never all-position logits, never an S x S matrix
(SPEC §9). Per token that is a few rows of the model's widest activations::

    per_token = act_bytes * (8 * d + 3 * widest)      # residual, norms, q/k/v, the MLP's widest layers
    fixed     = rows * V * 4 * 2                       # last-position logits and their float copy
              + 3 * LOSS_CHUNK_BYTES                   # one loss chunk and cross-entropy's temporaries
              + WORKSPACE_BYTES                        # the statistics kernels' row blocks, allocator slack

``d`` is the embedding width, ``widest`` the largest ``out_features`` of a linear layer in block 0
(a fused gate-up or qkv projection counts whole). It is an estimate with headroom, not a
measurement (benchmarks/bench_probe_vocab.py prints it beside the measured CPU peak). What the
device can give is its free memory plus what PyTorch's caching allocator holds reserved but unused
(``mem_get_info`` alone counts that as used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .capture.head import LOSS_CHUNK_BYTES

WORKSPACE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ProbeMemory:
    per_token: int  # bytes per probe token in one forward
    fixed: int  # bytes independent of the tokens per forward (one loss chunk)
    per_row: int  # bytes per sequence of last-position logits (V * 4 * 2)

    def need(self, tokens: int, rows: int) -> int:
        """Bytes for one forward of ``tokens`` tokens in ``rows`` sequences."""
        return self.per_token * tokens + self.fixed + self.per_row * rows

    def tokens_that_fit(self, available: int, rows: int) -> int:
        return max(0, (available - self.fixed - self.per_row * rows) // max(1, self.per_token))


def micro_batch_rows(seq_len: int, batch_tokens: int) -> int:
    """Sequences per probe forward of ``seq_len``-token sequences, as ``Monitor`` batches them (at least one)."""
    return max(1, batch_tokens // seq_len)


def _widths(target) -> tuple[int, int, int]:
    """(d, widest, bytes per activation element) read off the target's modules."""
    module: nn.Module = target.module
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    d = max((m.embedding_dim for m in embeddings), default=0)
    blocks = target.blocks()
    linears = [m for m in blocks[0].modules() if isinstance(m, nn.Linear)] if len(blocks) else []
    widest = max((m.out_features for m in linears), default=4 * d)
    d = d or max((m.in_features for m in linears), default=1)
    param = next(module.parameters(), None)
    act_bytes = param.element_size() if param is not None and param.is_floating_point() else 4
    return d, widest, act_bytes


def estimate(target, sets, batch_tokens: int) -> tuple[ProbeMemory, int, int]:
    """The estimate for the largest micro-batch of ``sets``: (model, tokens per forward, rows)."""
    d, widest, act_bytes = _widths(target)
    losses = any(s.kind == "repeated" for s in sets)
    per_token = act_bytes * (8 * d + 3 * widest)
    fixed = WORKSPACE_BYTES + (3 * LOSS_CHUNK_BYTES if losses else 0)
    model = ProbeMemory(per_token=per_token, fixed=fixed, per_row=int(target.vocab_size) * 4 * 2)
    largest = [(min(s.n, micro_batch_rows(s.seq_len, batch_tokens)), s.seq_len) for s in sets]  # (rows, seq_len) per set
    rows = max(r for r, _ in largest)
    tokens = max(r * seq_len for r, seq_len in largest)
    return model, tokens, rows


def available_bytes(device: torch.device) -> int:
    """Free device memory plus what the caching allocator holds reserved but unallocated."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def memory_verdict(target, sets, batch_tokens: int, available: int) -> str | None:
    """None when the probe fits in ``available`` bytes, else what to do (names a batch_tokens that fits)."""
    model, tokens, rows = estimate(target, sets, batch_tokens)
    need = model.need(tokens, rows)
    if need <= available:
        return None
    longest = max(s.seq_len for s in sets)
    fit = model.tokens_that_fit(available, max(1, rows))
    gib = 2**30
    if fit < longest:
        return (
            f"{available / gib:.2f} GiB available on {target.device}, the probe needs about {need / gib:.2f} GiB and even one "
            f"{longest}-token sequence per forward would need {model.need(longest, 1) / gib:.2f} GiB; probe less often or on "
            "a device with more free memory"
        )
    suggest = max(longest, (fit // longest) * longest)
    return (
        f"{available / gib:.2f} GiB available on {target.device}, the probe's largest micro-batch ({tokens} tokens) needs about "
        f"{need / gib:.2f} GiB; MonitorConfig(batch_tokens={suggest}) fits (tokens per probe forward: same numbers, more forwards)"
    )
