"""Capture attention statistics from a transformers model through ``AttentionInterface`` (SPEC §2).

sinkwatch registers an attention implementation named ``sinkwatch`` (and ``sinkwatch_eager`` for
models that were running eager attention). During a probe forward it sees every layer's
post-RoPE ``query`` and un-repeated ``key``, hands them to a ``Collector``, then delegates the
real attention output to the implementation the model had before, so outputs are unchanged.
Forward hooks on the decoder blocks give the residual stream after each block.

Outside a probe the registered functions just delegate, so registration is harmless.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
from torch import nn

SINKWATCH_IMPL = "sinkwatch"  # delegates to sdpa, uses sdpa's mask function
SINKWATCH_EAGER_IMPL = "sinkwatch_eager"  # delegates to the model's eager attention, eager mask
SUPPORTED_FAMILIES = ("gpt_neox", "llama", "olmo", "olmoe", "qwen2", "qwen3", "gpt2")


class Collector(Protocol):
    """What a probe computes from one forward; every method sees one micro-batch."""

    def on_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float, window: int | None, softcap: float | None) -> None:
        """query (B, Hq, S, D) post-RoPE, key (B, Hkv, S, D) before repeat_kv."""

    def on_attention_output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        """output (B, S, Hq, Dv): the input of the output projection. Return it (possibly ablated)."""

    def on_block_output(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden (B, S, d): the residual stream after block ``layer``."""


class UnsupportedModelError(TypeError):
    """The model cannot be probed through transformers' AttentionInterface."""


# ---- registration ----------------------------------------------------------------------------------
_ACTIVE: "CaptureSession | None" = None


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
        session = _ACTIVE
        if session is None:
            return delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        return session.attend(delegate, module, query, key, value, attention_mask, scaling, dropout, kwargs)

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


# ---- finding the model and its blocks --------------------------------------------------------------------
def find_transformers_model(obj) -> nn.Module:
    """The transformers ``PreTrainedModel`` inside ``obj``.

    Unwraps DDP/FSDP (``.module``), ``torch.compile`` (``._orig_mod``), PEFT (``get_base_model()``)
    and searches a LightningModule's (or any module's) children for the first causal-LM model.
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
        "attention through transformers' AttentionInterface (or see docs for the adapter for custom models)"
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
            "when their attention goes through AttentionInterface."
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(model).__name__} is an encoder-decoder model; sinkwatch probes causal decoders")


# ---- the probe-time session ----------------------------------------------------------------------------
@dataclass
class CaptureSession:
    """One model switched to sinkwatch attention; ``forward`` runs it with the collector attached."""

    model: nn.Module
    collector: Collector
    n_layers: int
    calls: int = 0

    def __post_init__(self) -> None:
        self._modules: list[nn.Module | None] = [None] * self.n_layers

    def forward(self, **inputs):
        """Run the model once; check that every block's attention went through sinkwatch."""
        self.calls = 0
        out = self.model(**inputs)
        if self.calls != self.n_layers:
            raise UnsupportedModelError(
                f"{type(self.model).__name__}: sinkwatch saw attention in {self.calls} of {self.n_layers} blocks; "
                "some attention layers bypass AttentionInterface"
            )
        return out

    def attend(self, delegate, module, query, key, value, attention_mask, scaling, dropout, kwargs):
        layer = self.calls
        self.calls += 1
        if layer >= self.n_layers:
            raise UnsupportedModelError(f"{type(module).__name__}: attention ran {layer + 1} times in one forward for {self.n_layers} blocks")
        # Layers are numbered by call order; the same module must own the same slot every forward.
        if self._modules[layer] is None:
            self._modules[layer] = module
        elif self._modules[layer] is not module:
            raise UnsupportedModelError("attention modules ran in a different order between forwards; cannot assign layers")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5  # what sdpa does when no scale is passed
        window = kwargs.get("sliding_window")
        _check_no_padding(attention_mask, query.shape[2], window)
        self.collector.on_attention(layer, query, key, float(scaling), window, kwargs.get("softcap"))
        out, weights = delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        return self.collector.on_attention_output(layer, out), weights


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
        raise ValueError("the probe batch is padded or carries a custom attention mask; sinkwatch probes use unpadded, fixed-length sequences")


@contextlib.contextmanager
def capture(model: nn.Module, collector: Collector) -> Iterator[CaptureSession]:
    """Route ``model``'s attention through sinkwatch for the duration of the block.

    Switches the attention implementation (restored in ``finally``) and installs block-output
    hooks (removed in ``finally``). Use the yielded session's ``forward`` to run the model.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a sinkwatch capture is already active; probes cannot be nested")
    check_supported(model)
    register_attention()
    blocks = decoder_blocks(model)
    previous = model.config._attn_implementation
    impl = SINKWATCH_EAGER_IMPL if previous == "eager" else SINKWATCH_IMPL
    session = CaptureSession(model, collector, len(blocks))

    def make_hook(i):
        def hook(_module, _args, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            collector.on_block_output(i, hidden)

        return hook

    handles = []
    try:
        handles = [block.register_forward_hook(make_hook(i)) for i, block in enumerate(blocks)]
        model.set_attn_implementation(impl)
        if model.config._attn_implementation != impl:
            raise UnsupportedModelError(f"{type(model).__name__} refused attn_implementation={impl!r}; it does not use AttentionInterface")
        _ACTIVE = session
        yield session
    finally:
        _ACTIVE = None
        for h in handles:
            h.remove()
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)


# ---- leaving the model as we found it ------------------------------------------------------------------
@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """eval + no_grad for the probe, then restore every module's training flag and the RNG states."""
    modes = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes:
            m.training = mode
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
