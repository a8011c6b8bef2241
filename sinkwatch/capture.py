"""Capture attention statistics from a model during a probe forward (SPEC §2).

Transformers models: sinkwatch registers an attention implementation named ``sinkwatch`` (and
``sinkwatch_eager`` for models that were running eager attention) through ``AttentionInterface``.
During a probe it sees every layer's post-RoPE ``query`` and un-repeated ``key``, hands them to a
``Collector``, then delegates the real attention output to the implementation the model had
before, so outputs are unchanged. Forward hooks on the decoder blocks give the residual stream.

Other PyTorch models (a nanoGPT-style module): their attention calls ``sinkwatch.attend(q, k, v)``
instead of ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, and the model is wrapped
in a ``CustomTarget`` naming its blocks and vocabulary (see docs/live.md).

Outside a probe the registered functions and ``attend`` just delegate, so they are harmless.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn

SINKWATCH_IMPL = "sinkwatch"  # delegates to sdpa, uses sdpa's mask function
SINKWATCH_EAGER_IMPL = "sinkwatch_eager"  # delegates to the model's eager attention, eager mask
SUPPORTED_FAMILIES = ("gpt_neox", "llama", "olmo", "olmoe", "qwen2", "qwen3", "gpt2")


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


# ---- the probe-time session (shared by every kind of target) -----------------------------------------
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


def _block_hooks(blocks: nn.ModuleList, collector: Collector) -> list:
    def make_hook(i):
        def hook(_module, _args, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            collector.on_block_output(i, hidden)

        return hook

    return [block.register_forward_hook(make_hook(i)) for i, block in enumerate(blocks)]


@contextlib.contextmanager
def _activate(session: CaptureSession) -> Iterator[None]:
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a sinkwatch capture is already active; probes cannot be nested")
    _ACTIVE = session
    try:
        yield
    finally:
        _ACTIVE = None


# ---- targets: what a probe runs ------------------------------------------------------------------------
class ProbeTarget:
    """A model as the monitor sees it: its blocks, vocabulary, context, and a captured forward."""

    module: nn.Module  # everything the probe must leave as found
    name: str

    @property
    def n_layers(self) -> int:
        return len(self.blocks())

    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def context(self) -> int | None:
        return None

    @property
    def device(self) -> torch.device:
        """Where the target's parameters live: probe tokens are moved there."""
        return next(self.module.parameters()).device

    @contextlib.contextmanager
    def capture(self, collector: Collector) -> Iterator[Callable[..., torch.Tensor]]:
        """Yield ``forward(input_ids, all_logits: bool) -> logits (B, S or 1, V)`` with capture on."""
        raise NotImplementedError
        yield


# -- transformers models ---------------------------------------------------------------------------
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
        if scaling is None:
            scaling = query.shape[-1] ** -0.5  # what sdpa does when no scale is passed
        window = kwargs.get("sliding_window")
        _check_no_padding(attention_mask, query.shape[2], window)
        weights = []

        def run():
            out, w = delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            weights.append(w)
            return out

        out = session.attend(run, module, query, key, scaling, window, kwargs.get("softcap"))
        return out, weights[0]

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
        self.name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._blocks = decoder_blocks(model)
        import inspect

        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def blocks(self) -> nn.ModuleList:
        return self._blocks

    @property
    def vocab_size(self) -> int:
        emb = self.model.get_input_embeddings()
        return int(getattr(emb, "num_embeddings", None) or self.model.config.vocab_size)

    @property
    def context(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @contextlib.contextmanager
    def capture(self, collector: Collector):
        register_attention()
        model = self.model
        previous = model.config._attn_implementation
        impl = SINKWATCH_EAGER_IMPL if previous == "eager" else SINKWATCH_IMPL
        session = CaptureSession(collector, self.n_layers, type(model).__name__)
        handles = []

        def forward(input_ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
            kw = {"use_cache": False}
            if not all_logits and self._keeps_logits:
                kw["logits_to_keep"] = 1
            session.begin()
            out = self.model(input_ids=input_ids, **kw)
            session.end()
            return out.logits

        try:
            with _activate(session):
                handles = _block_hooks(self._blocks, collector)
                model.set_attn_implementation(impl)
                if model.config._attn_implementation != impl:
                    raise UnsupportedModelError(
                        f"{type(model).__name__} refused attn_implementation={impl!r}; it does not use AttentionInterface"
                    )
                yield forward
        finally:
            for h in handles:
                h.remove()
            if model.config._attn_implementation != previous:
                model.set_attn_implementation(previous)


# -- custom models (sinkwatch.attend) ------------------------------------------------------------------
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float | None = None) -> torch.Tensor:
    """Causal attention for custom models: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``.

    q (B, Hq, S, D), k and v (B, Hkv, S, D) (GQA allowed); returns (B, Hq, S, Dv). Call it once per
    block, in block order, in place of your SDPA call; during a sinkwatch probe it also hands q and
    k to the statistics kernel.
    """
    gqa = q.shape[1] != k.shape[1]

    def sdpa() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2)  # (B, S, Hq, Dv): the layout the collectors use

    session = _ACTIVE
    if session is None:
        return sdpa().transpose(1, 2)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    return session.attend(sdpa, None, q, k, scale, None, None).transpose(1, 2)


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
        session = CaptureSession(collector, self.n_layers, self.name)
        handles = []

        def forward(input_ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
            session.begin()
            out = self._forward(input_ids)
            session.end()
            logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out
            return logits if all_logits else logits[:, -1:]

        try:
            with _activate(session):
                handles = _block_hooks(self._blocks, collector)
                yield forward
        finally:
            for h in handles:
                h.remove()


def resolve_target(obj) -> ProbeTarget:
    """A ProbeTarget for ``obj``: itself, ``obj.sinkwatch_target()``, or the transformers model inside it."""
    if isinstance(obj, ProbeTarget):
        return obj
    maker = getattr(obj, "sinkwatch_target", None)
    if callable(maker):
        target = maker()
        if not isinstance(target, ProbeTarget):
            raise TypeError(f"{type(obj).__name__}.sinkwatch_target() must return a sinkwatch.CustomTarget, got {type(target).__name__}")
        return target
    return HFTarget(find_transformers_model(obj))


# ---- leaving the model as we found it ------------------------------------------------------------------
@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore every global RNG afterwards: torch CPU and CUDA, Python's ``random``, numpy's."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py_rng = random.getstate()
    np_rng = np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """eval + no_grad for the probe, then restore every module's training flag and all RNG states."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad(), preserved_rng():
            yield
    finally:
        for m, mode in modes:
            m.training = mode
