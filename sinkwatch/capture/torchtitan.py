"""Capture for torchtitan 0.3.0 decoders (``Llama3Model``, ``Qwen3Model``), at each layer's
``attention.inner_attention``.

In torchtitan's ``GQAttention`` the queries and keys are projected, QK-normed (Qwen3) and rotated
before they reach ``inner_attention(q, k, v, attention_masks=..., scale=..., enable_gqa=...)``, all
(B, L, N, H), k and v not repeated for GQA. During a probe a forward hook on each ``inner_attention``
(removed afterwards) hands that q and k to the statistics and the module's own output on unchanged;
the scale is the one the layer passes (``head_dim ** -0.5`` when it passes None, as FlexAttention
does); what each head writes is read at the input of ``attention.wo``. The probe forward builds its
masks the way training does (``model.get_attention_masks(positions)`` with one document per row:
plain causal), since FlexAttention needs them, and always ends at the logits (``_skip_lm_head``, which the
Trainer sets when the loss applies the output layer itself, is off for the probe).

Under tensor parallelism (torchtitan's own plan) q, k and the output arrive as DTensors sharded on the heads:
their local tensors are this rank's block of heads in global order, handed on as they are
(``probe_share.combine`` gathers them); the residual stream is a replicated DTensor (its local copy is read) or,
under sequence parallelism, one sharded over the positions (gathered whole: ``capture.tensor_parallel.whole``),
and the loss-parallel output's last position is gathered and its losses computed on the vocabulary
shards (``capture/tensor_parallel.py``).

Models other than llama3 and qwen3 (deepseek_v3's MLA, qwen3_5's gated attention and GatedDeltaNet,
gpt_oss's sinks and windows) are refused by name, as is a pipeline stage (a rank without every layer).
This module imports ``torchtitan`` only inside functions.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from .head import ProbeForward, losses_from_logits
from .session import CaptureSession, Collector, UnsupportedModelError, active_session, capturing
from .target import ProbeTarget, model_class_name
from .tensor_parallel import is_dtensor, shard_offset, vocab_parallel_token_losses, whole

SUPPORTED = ("Llama3Model", "Qwen3Model")


def is_torchtitan_model(obj) -> bool:
    if "torchtitan" not in sys.modules or not isinstance(obj, nn.Module):
        return False
    from torchtitan.models.common.decoder import Decoder

    return isinstance(obj, Decoder)


def find_torchtitan_model(obj) -> nn.Module | None:
    for candidate in (obj, getattr(obj, "_orig_mod", None), getattr(obj, "module", None)):
        if is_torchtitan_model(candidate):
            return candidate
    return None


class TorchtitanTarget(ProbeTarget):
    """A torchtitan llama3 or qwen3 decoder (possibly ``fully_shard``-ed: every rank must probe together)."""

    def __init__(self, model: nn.Module):
        if not is_torchtitan_model(model):
            raise TypeError(f"TorchtitanTarget needs a torchtitan Decoder, got {type(model).__name__}")
        name = model_class_name(model)
        if name not in SUPPORTED:
            raise UnsupportedModelError(
                f"sinkwatch probes torchtitan's llama3 and qwen3 models ({', '.join(SUPPORTED)}); {name} is not supported "
                "(its attention differs: MLA, gated attention, linear attention or learned sinks)"
            )
        if getattr(model, "tok_embeddings", None) is None or getattr(model, "lm_head", None) is None:
            raise UnsupportedModelError(f"{name} is a pipeline stage (no embeddings or no output layer): no rank can run a probe forward")
        self.model = self.module = model
        self.name = f"torchtitan.{name}"
        self._blocks = nn.ModuleList([model.layers[k] for k in sorted(model.layers.keys(), key=int)])
        for i, block in enumerate(self._blocks):
            inner = getattr(getattr(block, "attention", None), "inner_attention", None)
            if not isinstance(inner, nn.Module):
                raise UnsupportedModelError(f"{name}: layer {i} has no attention.inner_attention for sinkwatch to read q and k at")

    def blocks(self) -> nn.ModuleList:
        return self._blocks

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def context(self) -> int | None:
        """The RoPE cache's length: ``Trainer`` sizes it to ``training.seq_len`` (``update_from_config``), and a
        longer probe would fail inside the rotary embedding with a reshape error."""
        try:
            return int(self.model.config.max_seq_len)
        except (AttributeError, TypeError, ValueError):
            return None

    @contextlib.contextmanager
    def capture(self, collector: Collector):
        session = CaptureSession(collector, self._blocks, self.name)

        def forward(input_ids: torch.Tensor, all_logits: bool = False, token_losses: bool = False) -> ProbeForward:
            B, S = input_ids.shape
            positions = torch.arange(S, device=input_ids.device).expand(B, S)  # one document per row: causal
            masks = self.model.get_attention_masks(positions)
            session.begin()
            with _with_lm_head(self.model):
                logits = self.model(input_ids, attention_masks=masks)  # (B, S, V): torchtitan returns every position's
            session.end()
            if is_dtensor(logits) and not all(p.is_replicate() for p in logits.placements):
                # tensor parallelism's loss-parallel output: each rank holds a shard of the vocabulary; the losses are
                # computed on the shards (vocabulary-parallel), and only the last position's logits gathered
                local = logits.to_local()
                group = logits.device_mesh.get_group()
                losses = vocab_parallel_token_losses(local, input_ids, group, shard_offset(logits)) if token_losses else None
                return ProbeForward(whole(logits if all_logits else logits[:, -1:]), losses)
            logits = whole(logits)
            losses = losses_from_logits(logits, input_ids) if token_losses else None
            return ProbeForward(logits if all_logits else logits[:, -1:], losses)

        handles = []
        try:
            with capturing(session):
                handles = [
                    b.attention.inner_attention.register_forward_hook(_inner_hook(b.attention), with_kwargs=True) for b in self._blocks
                ]
                yield forward
        finally:
            for h in handles:
                h.remove()


@contextlib.contextmanager
def _with_lm_head(model: nn.Module):
    """The probe forward ends at the logits even where training skips the output layer: with
    ``ChunkedLossWrapper`` (the stock llama3/qwen3 configs' loss) the Trainer sets ``model._skip_lm_head``
    and the loss applies ``lm_head`` chunk by chunk, so the forward alone returns hidden states."""
    skip = getattr(model, "_skip_lm_head", False)
    model._skip_lm_head = False
    try:
        yield
    finally:
        model._skip_lm_head = skip


def _local(x):
    return x.to_local() if is_dtensor(x) else x


def _inner_hook(attention: nn.Module):
    def hook(inner, args, kwargs, output):
        session = active_session()
        if session is None:
            return None
        # (B, L, Nq, H), (B, L, Nkv, H): post-RoPE, GQA not repeated; under tensor parallelism DTensors sharded on the
        # heads, whose local tensors are this rank's block of heads (``probe_share.combine`` puts them in global order)
        q, k = _local(args[0]), _local(args[1])
        scale = kwargs.get("scale")
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        own = _local(output)
        out = session.attend(lambda: own, attention, q.transpose(1, 2), k.transpose(1, 2), scale, None, None, None, attention.wo)
        if out is own:
            return None  # the model's own output, unchanged
        if is_dtensor(output):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(out, output.device_mesh, output.placements, shape=output.shape, stride=output.stride())
        return out

    return hook
