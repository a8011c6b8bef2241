"""Capture for Megatron-core GPT models (``megatron.core.models.gpt.GPTModel``), at each layer's
``self_attention.core_attention``, on every tensor-parallel rank (docs/design.md §9, "Tensor parallelism").

In Megatron's ``Attention`` the queries and keys are projected (``linear_qkv``, column-parallel: this
rank's query heads and key/value groups), QK-normed where configured and rotated (RoPE) before they reach
``core_attention(query, key, value, attention_mask, attn_mask_type=...)``, all [s, b, heads, d], keys not
repeated for GQA. With fewer key/value groups than tensor-parallel ranks Megatron gathers the projection
and each rank keeps its query heads and their one group: core attention always sees this rank's block of
H/TP query heads, in global order. During a probe a forward hook on each ``core_attention`` (the local
``DotProductAttention`` or Transformer Engine's ``TEDotProductAttention``, the same signature) hands q and
k to the statistics and the module's own output on unchanged; the scale is the module's own (with
``apply_query_key_layer_scaling``'s coefficient, which cancels). What each head writes is the core
attention output (the input of ``linear_proj``: no gate in the models supported here).

Megatron computes in [s, b, h] (sequence first): the residual stream after each layer (the layer's first
output), block 0's input and what each sublayer writes (its output plus the bias it hands back separately,
``skip_bias_add``) reach the collector as (b, s, h). Without sequence parallelism the residual stream is
whole on every tensor-parallel rank. The probe forward runs ``GPTModel.forward(ids, positions, mask)``
with the causal mask Megatron's GPT pretraining builds, the output layer's logits left vocabulary-parallel: the last
position's logits are gathered over the tensor-parallel group, and every position's next-token loss is
Megatron's own ``vocab_parallel_cross_entropy`` of the local logits (the loss training computes).

Refused by name (``UnsupportedModelError``): a pipeline stage (no embedding or no output layer), context
and sequence parallelism, attention other than plain causal softmax (sliding windows, softmax offsets,
gated output, multi-latent attention, packed sequences). This module imports Megatron only inside functions.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from .head import ProbeForward
from .session import CaptureSession, Collector, UnsupportedModelError, active_session, capturing
from .target import ProbeTarget, model_class_name
from .tensor_parallel import gather_last_dim


def is_megatron_model(obj) -> bool:
    gpt = sys.modules.get("megatron.core.models.gpt.gpt_model")  # loaded by whoever built a GPTModel; never imported here
    return gpt is not None and isinstance(obj, nn.Module) and isinstance(obj, gpt.GPTModel)


def find_megatron_model(obj) -> nn.Module | None:
    """The ``GPTModel`` in ``obj``: itself, or inside Megatron's ``DistributedDataParallel`` / ``Float16Module``
    (``.module``) or a compile wrapper."""
    seen = 0
    while isinstance(obj, nn.Module) and seen < 4:
        if is_megatron_model(obj):
            return obj
        obj = getattr(obj, "module", None) or getattr(obj, "_orig_mod", None)
        seen += 1
    return None


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() else 1


class MegatronTarget(ProbeTarget):
    """A Megatron-core ``GPTModel`` (its tensor-parallel rank's slice; every rank of the group probes together)."""

    def __init__(self, model: nn.Module):
        if not is_megatron_model(model):
            raise TypeError(f"MegatronTarget needs a megatron.core GPTModel, got {type(model).__name__}")
        name = model_class_name(model)
        cfg = model.config
        self.model = self.module = model
        self.name = f"megatron.{name}"
        if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
            raise UnsupportedModelError(
                f"{name} is a pipeline stage (pre_process={model.pre_process}, post_process={model.post_process}): no rank holds "
                "every layer, so no rank can run a probe forward; pipeline parallelism is not supported live (docs/design.md §9)"
            )
        pg = getattr(model, "pg_collection", None)
        self.tp_group = getattr(pg, "tp", None)
        refusals = {
            "context_parallel_size > 1 (each rank holds a slice of the positions; a head's attention row spans them all)": _group_size(
                getattr(pg, "cp", None)
            )
            > 1
            or int(getattr(cfg, "context_parallel_size", 1) or 1) > 1,
            "sequence_parallel (the residual stream is split over the positions between the tensor-parallel ranks)": bool(
                getattr(cfg, "sequence_parallel", False)
            ),
            "multi_latent_attention (MLA)": bool(getattr(cfg, "multi_latent_attention", False)),
            "attention_output_gate (gated attention)": bool(getattr(cfg, "attention_output_gate", False)),
            "window_size (sliding-window attention)": getattr(cfg, "window_size", None) is not None,
            f"softmax_type={getattr(cfg, 'softmax_type', 'vanilla')!r} (a softmax offset)": getattr(cfg, "softmax_type", "vanilla")
            != "vanilla",
        }
        refused = [what for what, bad in refusals.items() if bad]
        if refused:
            raise UnsupportedModelError(
                f"sinkwatch cannot probe this {name} live: {'; '.join(refused)}. Supported: causal softmax attention (local "
                "DotProductAttention or TEDotProductAttention) under tensor and data parallelism; probe checkpoints afterwards "
                "with a TP-only layout instead"
            )
        self._blocks = model.decoder.layers
        for i, layer in enumerate(self._blocks):
            core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
            if not isinstance(core, nn.Module):
                raise UnsupportedModelError(f"{name}: layer {i} has no self_attention.core_attention for sinkwatch to read q and k at")

    def blocks(self) -> nn.ModuleList:
        return self._blocks

    @property
    def vocab_size(self) -> int:
        """The model's (padded) vocabulary: ``GPTModel(vocab_size=...)``, every id the embedding holds."""
        return int(self.model.vocab_size)

    @property
    def context(self) -> int | None:
        try:
            return int(self.model.max_sequence_length)
        except (AttributeError, TypeError, ValueError):
            return None

    @property
    def tp_size(self) -> int:
        return _group_size(self.tp_group)

    def probe_forward_bytes(self, rows: int, seq_len: int, act_bytes: int) -> int:
        """What one probe forward of ``rows`` x ``seq_len`` allocates beyond the per-token activations
        (``sinkwatch.probe.memory``): every position's logits on this rank's vocabulary shard (B, S, V/TP), their
        float copy and the vocabulary-parallel cross-entropy's temporaries (3 x float32); with the local
        ``DotProductAttention``, its [b·heads/TP, s, s] score buffer, the masked scores and the probabilities
        (3 x; Transformer Engine's fused attention has none)."""
        shard = -(-self.vocab_size // self.tp_size)
        need = 3 * rows * seq_len * shard * 4
        core = self._blocks[0].self_attention.core_attention if len(self._blocks) else None
        if type(core).__name__ == "DotProductAttention":
            heads = int(getattr(core, "num_attention_heads_per_partition", 0) or 0)
            need += 3 * rows * heads * seq_len * seq_len * act_bytes
        return need

    @contextlib.contextmanager
    def capture(self, collector: Collector):
        session = _MegatronSession(_SequenceFirst(collector), self._blocks, self.name)
        group = self.tp_group if self.tp_size > 1 else None

        def forward(input_ids: torch.Tensor, all_logits: bool = False, token_losses: bool = False) -> ProbeForward:
            B, S = input_ids.shape
            positions = torch.arange(S, device=input_ids.device).expand(B, S)
            # Megatron's causal mask as its GPT pretraining builds it (True: masked); a None mask would make the
            # local attention build its own on CUDA
            mask = torch.ones(S, S, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]
            session.begin()
            # (B, S, V/TP): the output layer's own shard of the vocabulary (no gather of every position's logits)
            local = self.model(input_ids, positions, mask, runtime_gather_output=False)
            session.end()
            losses = None
            if token_losses:
                from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

                labels = input_ids[:, 1:].transpose(0, 1).contiguous()  # (S-1, B)
                # Megatron's own vocabulary-parallel loss (its all-reduces over the tensor-parallel group). It writes its
                # input in place (subtracts the max, exponentiates): a copy, since .float().contiguous() of float32
                # logits with B = 1 is a view of ``local``, whose logits are handed back below
                shifted = local[:, :-1].transpose(0, 1).float().clone(memory_format=torch.contiguous_format)
                losses = vocab_parallel_cross_entropy(shifted, labels).transpose(0, 1)
            logits = local if all_logits else local[:, -1:]
            return ProbeForward(gather_last_dim(logits.contiguous(), group), losses)

        handles = []
        try:
            with capturing(session):
                handles = [
                    layer.self_attention.core_attention.register_forward_hook(_core_hook, with_kwargs=True) for layer in self._blocks
                ]
                yield forward
        finally:
            for h in handles:
                h.remove()


def _core_hook(module, args, kwargs, output):
    session = active_session()
    if session is None:
        return None
    q, k = args[0], args[1]  # [s, b, Hq/TP, d], [s, b, Hkv/TP (or 1), d]: post-RoPE, GQA not repeated
    if kwargs.get("packed_seq_params") is not None or q.dim() != 4:
        raise UnsupportedModelError("sinkwatch's Megatron capture reads [s, b, heads, d] attention inputs; packed sequences are not probed")
    S, B, H, D = q.shape
    scale = getattr(module, "softmax_scale", None)
    scale = D**-0.5 if scale is None else float(scale)
    coeff = getattr(getattr(module, "scale_mask_softmax", None), "scale", None)  # apply_query_key_layer_scaling: undone there
    if coeff is not None:
        scale *= float(coeff)
    out = session.attend(
        lambda: output.view(S, B, H, -1).transpose(0, 1), module, q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), scale, None, None
    )  # (B, S, Hq, Dv), possibly ablated
    return out.transpose(0, 1).reshape(output.shape)


class _MegatronSession(CaptureSession):
    """What a Megatron sublayer writes is its output plus the bias it hands back separately. Without a bias the
    output is copied: in eval mode under no_grad Megatron's bias-dropout-add adds the residual into the sublayer's
    output in place (``_bias_dropout_add_func``'s ``inplace``), which would turn the tensor held here into the next
    residual stream (and hand it to ``pre_mlp_layernorm`` as if it were a post-norm's input)."""

    def _sublayer_out(self, i: int, kind: str):
        def hook(_module, _args, output):
            if self._muted:
                return
            out, bias = (output[0], output[1] if len(output) > 1 else None) if isinstance(output, (tuple, list)) else (output, None)
            if isinstance(out, torch.Tensor):
                self._written[kind] = (i, out.clone() if not isinstance(bias, torch.Tensor) else out + bias)

        return hook


class _SequenceFirst:
    """The collector, handed Megatron's [s, b, h] hidden states as (b, s, h)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def on_block_output(self, layer, hidden):
        self.inner.on_block_output(layer, hidden.transpose(0, 1))

    def on_block_input(self, layer, hidden):
        self.inner.on_block_input(layer, hidden.transpose(0, 1))

    def on_sublayer_output(self, layer, kind, output):
        self.inner.on_sublayer_output(layer, kind, output.transpose(0, 1))
