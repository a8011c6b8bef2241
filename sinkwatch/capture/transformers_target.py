"""Capture for transformers models (docs/design.md §2).

sinkwatch registers an attention implementation named ``sinkwatch`` (and ``sinkwatch_eager``)
through ``AttentionInterface``. During a probe it sees every softmax layer's post-RoPE ``query``,
un-repeated ``key`` and learned sink logits (``s_aux``: gpt-oss and other models with attention
sinks) and hands them to the session's ``Collector``. The attention output comes from sinkwatch's
fused pass where it can honour the call (``FUSABLE_KWARGS``; on CPU by default, see
``CaptureSession.attend``), else from the model's own attention: sdpa, or the model's eager
attention when the model was running eager or its class cannot run sdpa at all (gpt-oss: sinks;
Gemma 2: soft-capping). Block hooks map each call to its decoder block (hybrid stacks: Mamba / linear-attention
blocks see none) and give the residual stream; a pre-hook on the layer's output projection reads
what each head writes after the gate of gated attention (Qwen3-Next). Outside a probe the
registered functions just delegate, so they are harmless.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn

from .head import HeadTap, ProbeForward, captured_forward, hf_logit_post
from .session import CaptureSession, Collector, UnsupportedModelError, active_session, capturing
from .target import ProbeTarget, model_class_name

SINKWATCH_IMPL = "sinkwatch"  # delegates to sdpa, uses sdpa's mask function
SINKWATCH_EAGER_IMPL = "sinkwatch_eager"  # delegates to the model's eager attention, eager mask
# Families probed and compared with eager attention in the tests (tests/families.py is the table;
# tests/test_families.py checks this tuple and the README list against it).
SUPPORTED_FAMILIES = (
    "gpt_neox", "llama", "olmo", "olmoe", "qwen2", "qwen3", "gpt2",
    "gpt_oss", "gemma2", "qwen3_next", "jamba", "bamba", "zamba2", "falcon_h1",
)  # fmt: skip
# Where an attention module hands its (gated) head outputs on: its output projection's usual names.
OUTPUT_PROJECTIONS = ("o_proj", "dense", "c_proj", "out_proj", "wo", "w_out")
# Keyword arguments of an attention call that sinkwatch's fused pass honours (the window, the
# soft-cap and the sinks) or that leave plain causal attention unchanged. Any other one that is set
# (a ``position_bias``, varlen ``cu_seq_lens_*``, ``is_causal=False``, ``output_attentions=True``...)
# sends the call to the model's own attention, as do dropout, keys longer than the queries (a
# cache) and a mask other than the causal (sliding-window) one.
FUSABLE_KWARGS = frozenset({"sliding_window", "softcap", "s_aux", "position_ids", "use_cache", "output_router_logits", "cache_position"})


def _sdpa_delegate(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _eager_delegate(module, query, key, value, attention_mask, **kwargs):
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} ran eager attention but its module defines no eager_attention_forward; "
            "load the model with attn_implementation='sdpa' to probe it"
        )
    return eager(module, query, key, value, attention_mask, **kwargs)


def _make_impl(delegate: Callable) -> Callable:
    def sinkwatch_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        session = active_session()
        if session is None:
            return delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5  # what sdpa does when no scale is passed
        window = kwargs.get("sliding_window")
        _check_no_padding(attention_mask, query.shape[2], window)
        weights = []

        def run():
            out, w = delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            weights.append(w)
            return out

        fusable = dropout == 0 and key.shape[2] == query.shape[2] and _plain_kwargs(kwargs) and _causal_mask(attention_mask, window)
        out = session.attend(
            run, module, query, key, scaling, window, kwargs.get("softcap"), kwargs.get("s_aux"), output_projection(module),
            value=value if fusable else None,
        )  # fmt: skip
        return out, (weights[0] if weights else None)

    sinkwatch_attention.__name__ = f"sinkwatch_attention_via_{delegate.__name__.strip('_')}"
    return sinkwatch_attention


_REGISTERED = False


def register_attention() -> None:
    """Register ``sinkwatch`` and ``sinkwatch_eager`` (functions and masks). Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(SINKWATCH_IMPL, _make_impl(_sdpa_delegate))
    AttentionInterface.register(SINKWATCH_EAGER_IMPL, _make_impl(_eager_delegate))
    # Without a mask function for our names, padding would be silently dropped.
    AttentionMaskInterface.register(SINKWATCH_IMPL, sdpa_mask)
    AttentionMaskInterface.register(SINKWATCH_EAGER_IMPL, eager_mask)
    _REGISTERED = True


def output_projection(module: nn.Module) -> nn.Module | None:
    """The attention module's output projection (its input: every head's output side by side)."""
    for name in OUTPUT_PROJECTIONS:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def delegate_impl(model: nn.Module, previous: str) -> str:
    """Which sinkwatch implementation probes ``model``: eager's delegate when the model was running
    eager attention or its class cannot run sdpa (gpt-oss's sinks, Gemma 2's soft-capping: sdpa would
    compute another softmax), else sdpa's."""
    if previous == "eager" or not getattr(type(model), "_supports_sdpa", False):
        return SINKWATCH_EAGER_IMPL
    return SINKWATCH_IMPL


def _check_no_padding(mask, seq_len: int, window: int | None) -> None:
    """Statistics assume unpadded causal rows; the last query row reveals any padded key cheaply."""
    if mask is None or not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return
    last = mask[:, :, -1, :]  # (B, 1, S_k)
    allowed = last if last.dtype == torch.bool else last == 0
    keys = torch.arange(allowed.shape[-1], device=allowed.device)
    expected = keys <= seq_len - 1
    if window is not None:
        expected &= (seq_len - 1 - keys) < window
    if not torch.equal(allowed, expected.expand_as(allowed)):
        raise ValueError(
            "the probe batch is padded or carries a custom attention mask; sinkwatch probes use unpadded, fixed-length sequences"
        )


def _plain_kwargs(kwargs: dict) -> bool:
    """No keyword argument asks for more than causal attention with a window, soft-cap or sinks."""
    for name, value in kwargs.items():
        if name in FUSABLE_KWARGS or value is None or value is False:
            continue
        if name == "is_causal" and value is True:
            continue
        return False
    return True


def _causal_mask(mask, window: int | None, rows_per_check: int = 256) -> bool:
    """Whether ``mask`` (None, or (B, 1, S, S) bool or additive) allows exactly the causal keys (within
    ``window``): any other mask (a prefix-LM's, packed documents') keeps the model's own attention.
    Compared ``rows_per_check`` rows at a time, so the check never builds an S x S mask of its own."""
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        return False
    S = mask.shape[-1]
    keys = torch.arange(S, device=mask.device)
    for r0 in range(0, S, rows_per_check):
        block = mask[:, :, r0 : r0 + rows_per_check]  # (B, 1 or H, r, S)
        allowed = block if block.dtype == torch.bool else block == 0
        rows = keys[r0 : r0 + rows_per_check, None]
        expected = keys[None, :] <= rows
        if window is not None:
            expected &= (rows - keys[None, :]) < window
        if not torch.equal(allowed, expected.expand_as(allowed)):
            return False
    return True


def find_transformers_model(obj) -> nn.Module:
    """The transformers ``PreTrainedModel`` inside ``obj``.

    Unwraps DDP/FSDP (``.module``), ``torch.compile`` (``._orig_mod``), PEFT (``get_base_model()``)
    and searches a LightningModule's (or any module's) children for the first model.
    """
    from transformers import PreTrainedModel

    seen = set()
    todo = [obj]
    while todo:
        m = todo.pop(0)
        if id(m) in seen or m is None:
            continue
        seen.add(id(m))
        if isinstance(m, PreTrainedModel):
            return m
        for attr in ("_orig_mod", "module", "base_model", "model"):
            inner = getattr(m, attr, None)
            if isinstance(inner, nn.Module):
                todo.append(inner)
        if hasattr(m, "get_base_model") and callable(m.get_base_model):
            with contextlib.suppress(Exception):
                todo.append(m.get_base_model())
        if isinstance(m, nn.Module):
            todo.extend(m.children())
    raise UnsupportedModelError(
        f"no transformers PreTrainedModel found inside {type(obj).__name__}; sinkwatch probes models that route "
        "attention through transformers' AttentionInterface, or custom models wrapped in sinkwatch.CustomTarget "
        "whose attention calls sinkwatch.attend (see docs/live.md)"
    )


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks (``model.layers``, ``gpt_neox.layers``, ``transformer.h``...)."""
    n = getattr(model.config, "num_hidden_layers", None)
    base = getattr(model, "base_model", model)
    candidates = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not candidates:
        raise UnsupportedModelError(
            f"{type(model).__name__}: could not find its {n} decoder blocks (a ModuleList of length config.num_hidden_layers)"
        )
    return candidates[0]


def check_supported(model: nn.Module) -> None:
    """Raise ``UnsupportedModelError`` naming the class when the model bypasses AttentionInterface."""
    if not hasattr(type(model), "_can_set_attn_implementation") or not type(model)._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface "
            "(its attention module never calls ALL_ATTENTION_FUNCTIONS.get_interface), so sinkwatch cannot see "
            "its queries and keys. Supported and tested: " + ", ".join(SUPPORTED_FAMILIES) + "; other decoders work "
            "when their attention goes through AttentionInterface; custom models can call sinkwatch.attend."
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(model).__name__} is an encoder-decoder model; sinkwatch probes causal decoders")


class HFTarget(ProbeTarget):
    """A transformers causal LM."""

    def __init__(self, model: nn.Module):
        check_supported(model)
        self.model = self.module = model
        self.name = getattr(model.config, "_name_or_path", "") or model_class_name(model)
        self._blocks = decoder_blocks(model)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def blocks(self) -> nn.ModuleList:
        return self._blocks

    @property
    def vocab_size(self) -> int:
        emb = self.model.get_input_embeddings()
        return int(getattr(emb, "num_embeddings", None) or self.model.config.vocab_size)

    @property
    def context(self) -> int | None:
        n = getattr(self.model.config, "max_position_embeddings", None)
        return n if isinstance(n, int) and n > 0 else None  # OLMo-core's HF converter writes -1: unknown

    def head_tap(self) -> HeadTap | None:
        """The hooks that take the per-token losses from the final hidden states (``capture/head.py``):
        the base model's output feeds ``get_output_embeddings()``; None when the model has neither."""
        head = self.model.get_output_embeddings()
        base = getattr(self.model, "base_model", None)
        if not isinstance(head, nn.Module) or not isinstance(base, nn.Module) or base is self.model or not self._keeps_logits:
            return None
        return HeadTap(base, head, hf_logit_post(self.model))

    @contextlib.contextmanager
    def capture(self, collector: Collector):
        register_attention()
        model = self.model
        previous = model.config._attn_implementation
        impl = delegate_impl(model, previous)
        session = CaptureSession(collector, self._blocks, type(model).__name__)
        tap = self.head_tap()

        def run(input_ids: torch.Tensor, all_logits: bool) -> torch.Tensor:
            kw = {"use_cache": False}
            if not all_logits and self._keeps_logits:
                kw["logits_to_keep"] = 1
            return self.model(input_ids=input_ids, **kw).logits

        def forward(input_ids: torch.Tensor, all_logits: bool = False, token_losses: bool = False) -> ProbeForward:
            return captured_forward(
                session, tap, run, input_ids, all_logits=all_logits, token_losses=token_losses, vocab_size=self.vocab_size, name=self.name
            )

        try:
            with capturing(session):
                model.set_attn_implementation(impl)
                if model.config._attn_implementation != impl:
                    raise UnsupportedModelError(
                        f"{type(model).__name__} refused attn_implementation={impl!r}; it does not use AttentionInterface"
                    )
                yield forward
        finally:
            if model.config._attn_implementation != previous:
                model.set_attn_implementation(previous)
