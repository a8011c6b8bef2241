"""The probe-time capture session, shared by every kind of target (SPEC §2).

A ``CaptureSession`` numbers attention calls by order within one forward and fans each call out to
the ``Collector``; ``activate`` makes it the one session the attention entry points see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn


class Collector(Protocol):
    """What a probe computes from one forward; every method sees one micro-batch."""

    def on_attention(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float, window: int | None, softcap: float | None
    ) -> None:
        """query (B, Hq, S, D) post-RoPE, key (B, Hkv, S, D) before repeat_kv."""

    def on_attention_output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        """output (B, S, Hq, Dv): the input of the output projection. Return it (possibly ablated)."""

    def on_block_output(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden (B, S, d): the residual stream after block ``layer``."""


class UnsupportedModelError(TypeError):
    """The model cannot be probed: it does not expose its attention to sinkwatch."""


_ACTIVE: CaptureSession | None = None


def active_session() -> CaptureSession | None:
    """The session of the probe running now, or None outside a probe."""
    return _ACTIVE


@dataclass
class CaptureSession:
    """Numbers attention calls by order within one forward and fans them out to the collector."""

    collector: Collector
    n_layers: int
    model_name: str
    calls: int = 0
    _modules: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self._modules = [None] * self.n_layers

    def begin(self) -> None:
        self.calls = 0

    def end(self) -> None:
        if self.calls != self.n_layers:
            raise UnsupportedModelError(
                f"{self.model_name}: sinkwatch saw attention in {self.calls} of {self.n_layers} blocks; "
                "some attention layers bypass sinkwatch (transformers' AttentionInterface or sinkwatch.attend)"
            )

    def attend(self, delegate: Callable[[], torch.Tensor], module, query, key, scaling: float, window, softcap) -> torch.Tensor:
        """Statistics from query/key, then ``delegate()`` -> (B, S, Hq, Dv), returned possibly ablated."""
        layer = self.calls
        self.calls += 1
        if layer >= self.n_layers:
            raise UnsupportedModelError(f"{self.model_name}: attention ran {layer + 1} times in one forward for {self.n_layers} blocks")
        # Layers are numbered by call order; the same module must own the same slot every forward.
        if module is not None:
            if self._modules[layer] is None:
                self._modules[layer] = module
            elif self._modules[layer] is not module:
                raise UnsupportedModelError("attention modules ran in a different order between forwards; cannot assign layers")
        self.collector.on_attention(layer, query, key, float(scaling), window, softcap)
        return self.collector.on_attention_output(layer, delegate())


def block_hooks(blocks: nn.ModuleList, collector: Collector) -> list:
    """Forward hooks handing each block's output (the residual stream) to the collector."""

    def make_hook(i):
        def hook(_module, _args, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            collector.on_block_output(i, hidden)

        return hook

    return [block.register_forward_hook(make_hook(i)) for i, block in enumerate(blocks)]


@contextlib.contextmanager
def activate(session: CaptureSession) -> Iterator[None]:
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a sinkwatch capture is already active; probes cannot be nested")
    _ACTIVE = session
    try:
        yield
    finally:
        _ACTIVE = None
