"""Capture for custom PyTorch models (a nanoGPT-style module).

Their attention calls ``sinkwatch.attend(q, k, v)`` instead of
``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, and the model is wrapped in a
``CustomTarget`` naming its blocks and vocabulary (see docs/live.md). Outside a probe ``attend``
just delegates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from .head import ProbeForward, losses_from_logits
from .session import CaptureSession, Collector, active_session, capturing
from .target import ProbeTarget


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float | None = None) -> torch.Tensor:
    """Causal attention for custom models: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``.

    q (B, Hq, S, D), k and v (B, Hkv, S, D) (GQA allowed); returns (B, Hq, S, Dv). Call it once per
    block, in block order, in place of your SDPA call; during a sinkwatch probe it also hands q and
    k to the statistics kernel (on CPU one pass computes both the output and the statistics).
    """
    gqa = q.shape[1] != k.shape[1]

    def sdpa() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2)  # (B, S, Hq, Dv): the layout the collectors use

    session = active_session()
    if session is None:
        return sdpa().transpose(1, 2)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    return session.attend(sdpa, None, q, k, scale, None, None, value=v).transpose(1, 2)  # causal SDPA: fusable


class CustomTarget(ProbeTarget):
    """A non-transformers causal LM whose attention calls ``sinkwatch.attend``.

    module: the model (left as found); blocks: its ModuleList of blocks (block outputs are the
    residual stream); vocab_size; context (max sequence length, optional); forward: ``ids ->
    logits (B, S, V)``, default ``module(ids)`` (a tensor, a tuple whose first item is the logits,
    or an object with ``.logits``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        blocks: nn.ModuleList,
        vocab_size: int,
        context: int | None = None,
        forward: Callable | None = None,
        name: str | None = None,
    ):
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise TypeError("CustomTarget(blocks=...) must be the model's nn.ModuleList of blocks")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"CustomTarget(vocab_size=...) must be a positive int, got {vocab_size!r}")
        self.module = module
        self._blocks = blocks
        self._vocab = vocab_size
        self._context = context
        self._forward = forward or module
        self.name = name or type(module).__name__

    def blocks(self) -> nn.ModuleList:
        return self._blocks

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def context(self) -> int | None:
        return self._context

    @contextlib.contextmanager
    def capture(self, collector: Collector):
        session = CaptureSession(collector, self._blocks, self.name)

        def forward(input_ids: torch.Tensor, all_logits: bool = False, token_losses: bool = False) -> ProbeForward:
            session.begin()
            out = self._forward(input_ids)
            session.end()
            logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out  # (B, S, V)
            # a custom forward returns every position's logits: its own memory; the losses add one chunk to it
            losses = losses_from_logits(logits, input_ids) if token_losses else None
            return ProbeForward(logits if all_logits else logits[:, -1:], losses)

        with capturing(session):
            yield forward
