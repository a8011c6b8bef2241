"""``ProbeTarget``: a model as the monitor sees it, the one interface every capture target implements."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .session import Collector


def model_class_name(model: nn.Module) -> str:
    """The model's own class name, whatever wraps its class: ``fully_shard`` (FSDP2) and ``replicate``
    swap in a dynamic subclass (``FSDP<Class>``, ``DDP<Class>``) made in torch.distributed, which a
    record must not report as the model."""
    return next((c.__name__ for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed")), type(model).__name__)


class ProbeTarget:
    """A model as the monitor sees it: its blocks, vocabulary, context, and a captured forward."""

    module: nn.Module  # everything the probe must leave as found
    name: str

    @property
    def n_layers(self) -> int:
        return len(self.blocks())

    @property
    def device(self) -> torch.device:
        """Where the target's parameters live: probe tokens are moved there."""
        return next(self.module.parameters()).device

    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def context(self) -> int | None:
        return None

    @contextlib.contextmanager
    def capture(self, collector: Collector) -> Iterator[Callable[..., torch.Tensor]]:
        """Yield ``forward(input_ids, all_logits=False, token_losses=False) -> ProbeForward`` with capture on.

        ``ProbeForward.logits``: (B, 1, V), the last position (every position's with ``all_logits``);
        ``ProbeForward.token_losses``: (B, S-1) float32 next-token losses when asked, taken from the
        final hidden states through the output head in row chunks (``capture/head.py``), so the
        probe's memory does not grow with the vocabulary."""
        raise NotImplementedError
        yield
