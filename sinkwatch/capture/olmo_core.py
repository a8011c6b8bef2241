"""Capture for OLMo-core models (``olmo_core.nn.transformer.Transformer``, dense or MoE).

Every OLMo-core attention layer hands its queries and keys to an ``AttentionBackend`` child module
(torch SDPA, flash 2/3/4, TransformerEngine) as ``backend((q, k, v), ...)``, with q and k already
projected, QK-normed and rotated (RoPE), k and v not yet repeated for GQA, all (B, S, H, D). sinkwatch
captures *at the backend's call*: a forward hook on each ``backend`` sees that tuple and the
backend's own output, so whichever backend the run uses computes the attention output unchanged,
and the statistics come from the same q/k the backend consumed. Sliding windows come from the
backend's ``window_size`` (flash convention ``(w - 1, 0)``: key j is visible from query i when
``i - j < w``); the scale is the backend's (``head_dim ** -0.5`` when unset). Learnable attention
sinks (``attention_sinks=True``: the torch backend gets ``sinks=`` per-head logits, one more softmax
column) reach the statistics with q and k. Gated attention (``gate=GateConfig(...)``) multiplies the
backend's output by ``sigmoid(w_g(x))`` *after* the backend: what each head writes (PR) and the gate
are read at the input of ``w_out``. Block hooks map each call to its block and give the residual stream.

Refused with ``UnsupportedModelError`` (a clear error at setup, never mid-run): pipeline parallelism
(a rank holds only some blocks), tensor parallelism (a rank holds only some heads), context
parallelism (a rank holds only part of each sequence), expert parallelism (not tested) and
non-attention sequence mixers (OLMo-core's linear attention / recurrent layers need
flash-linear-attention, which cannot run here to be tested).

This module imports ``olmo_core`` only inside functions: the rest of sinkwatch never needs it.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from .head import HeadTap, ProbeForward, captured_forward
from .session import CaptureSession, Collector, UnsupportedModelError, active_session, capturing
from .target import ProbeTarget, model_class_name


def is_olmo_core_model(obj) -> bool:
    """Whether ``obj`` is an OLMo-core ``Transformer`` (without importing olmo_core when it is absent)."""
    if "olmo_core" not in sys.modules or not isinstance(obj, nn.Module):
        return False
    from olmo_core.nn.transformer import Transformer

    return isinstance(obj, Transformer)


def find_olmo_core_model(obj) -> nn.Module | None:
    """The OLMo-core Transformer in ``obj``: itself, or the ``.model`` of a train module."""
    if is_olmo_core_model(obj):
        return obj
    inner = getattr(obj, "model", None)
    return inner if is_olmo_core_model(inner) else None


def check_olmo_core_supported(model: nn.Module) -> None:
    """Raise ``UnsupportedModelError`` for what a probe cannot see whole on one rank."""
    name = type(model).__name__
    if getattr(model, "pp_enabled", False):
        raise UnsupportedModelError(
            f"sinkwatch cannot probe {name} under pipeline parallelism: each rank holds only some blocks, "
            "so no rank can run a probe forward. sinkwatch supports OLMo-core's data parallelism (FSDP2/HSDP, DDP); "
            "probe a pipeline run's checkpoints offline instead (convert them to HF and use `sinkwatch replay`)"
        )
    if getattr(model, "tp_enabled", False):
        raise UnsupportedModelError(
            f"sinkwatch cannot probe {name} under tensor parallelism: each rank sees only some heads. sinkwatch supports OLMo-core's data "
            "parallelism (FSDP2/HSDP, DDP); drop tp_config, or probe the checkpoints offline"
        )
    if getattr(model, "_cp_load_balancer", None) is not None:
        raise UnsupportedModelError(
            f"sinkwatch cannot probe {name} under context parallelism: each rank holds only part of every sequence, so a rank cannot "
            "see a whole attention row. Drop cp_config, or probe the checkpoints offline"
        )
    if any(getattr(m, "ep_enabled", False) for m in model.modules()):
        raise UnsupportedModelError(
            f"sinkwatch cannot probe {name} under expert parallelism, which sinkwatch has not been tested with. Drop ep_config "
            "(FSDP2 shards the experts too), or probe the checkpoints offline"
        )
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict) or len(blocks) == 0:
        raise UnsupportedModelError(f"{name}: no OLMo-core blocks (model.blocks) to probe")
    for key, block in blocks.items():
        attention = getattr(block, "attention", None)
        backend = getattr(attention, "backend", None)
        if not isinstance(backend, nn.Module):
            raise UnsupportedModelError(
                f"{name}: block {key}'s sequence mixer {type(attention).__name__} has no attention backend (a linear-attention "
                "or recurrent layer?); sinkwatch probes OLMo-core models whose every block has softmax attention (hybrid "
                "stacks are supported through transformers)"
            )


class OLMoCoreTarget(ProbeTarget):
    """An OLMo-core ``Transformer`` (possibly ``fully_shard``-ed: every rank must probe together)."""

    def __init__(self, model: nn.Module):
        if not is_olmo_core_model(model):
            raise TypeError(f"OLMoCoreTarget needs an olmo_core.nn.transformer.Transformer, got {type(model).__name__}")
        check_olmo_core_supported(model)
        self.model = self.module = model
        self.name = f"olmo_core.{model_class_name(model)}"
        # a ModuleList view of the ModuleDict (keys "0".."L-1", in forward order); not registered anywhere
        self._blocks = nn.ModuleList([model.blocks[k] for k in sorted(model.blocks.keys(), key=int)])

    def blocks(self) -> nn.ModuleList:
        return self._blocks

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    @property
    def context(self) -> int | None:
        return None  # RoPE has no maximum length; the probe lengths are the user's choice

    def head_tap(self) -> HeadTap | None:
        """OLMo-core's ``LMHead`` normalises, keeps the last position, then applies ``w_out``: the
        final hidden states are the norm's output (the head's input without a norm)."""
        head = getattr(self.model, "lm_head", None)
        w_out = getattr(head, "w_out", None)
        if not isinstance(w_out, nn.Module):
            return None
        norm = getattr(head, "norm", None)
        if isinstance(norm, nn.Module):
            return HeadTap(norm, w_out, lambda logits: logits)
        return HeadTap(head, w_out, lambda logits: logits, from_input=True)

    @contextlib.contextmanager
    def capture(self, collector: Collector):
        session = CaptureSession(collector, self._blocks, self.name)
        handles = []
        tap = self.head_tap()

        def run(input_ids: torch.Tensor, all_logits: bool) -> torch.Tensor:
            return self.model(input_ids, logits_to_keep=0 if all_logits else 1)  # (B, S or 1, V)

        def forward(input_ids: torch.Tensor, all_logits: bool = False, token_losses: bool = False) -> ProbeForward:
            return captured_forward(
                session, tap, run, input_ids, all_logits=all_logits, token_losses=token_losses, vocab_size=self.vocab_size, name=self.name
            )

        try:
            with capturing(session):
                handles = [
                    block.attention.backend.register_forward_hook(_backend_hook(block.attention), with_kwargs=True)
                    for block in self._blocks
                ]
                yield forward
        finally:
            for h in handles:
                h.remove()


def _backend_hook(attention: nn.Module):
    def hook(backend, args, kwargs, output):
        session = active_session()
        if session is None:
            return None
        qkv = args[0] if args else kwargs.get("qkv")
        if not isinstance(qkv, (tuple, list)) or len(qkv) != 3:
            raise UnsupportedModelError(f"{type(backend).__name__} was called without a (q, k, v) tuple; sinkwatch cannot read q and k")
        for name in ("cu_doc_lens", "cu_doc_lens_q", "local_k_slice", "kv_cache_manager"):
            if kwargs.get(name) is not None:
                raise ValueError(f"the probe forward passed {name} to attention; sinkwatch probes use unpadded, fixed-length sequences")
        q, k, _ = qkv  # (B, S, Hq, D), (B, S, Hkv, D): post-RoPE, GQA not repeated
        left, _right = backend.window_size
        window = None if left < 0 else left + 1  # (w - 1, 0) -> w
        scale = backend.scale if backend.scale is not None else q.shape[-1] ** -0.5
        sinks = kwargs.get("sinks")  # (Hq,) learnable sink logits, or None
        # the gate (if any) is applied after the backend: what each head writes is w_out's input
        projection = getattr(attention, "w_out", None)
        return session.attend(lambda: output, attention, q.transpose(1, 2), k.transpose(1, 2), scale, window, None, sinks, projection)

    return hook
