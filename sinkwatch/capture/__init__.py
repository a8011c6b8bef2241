"""Capture attention statistics from a model during a probe forward (docs/design.md §2).

One module per kind of model, all behind the one ``ProbeTarget`` interface (``target.py``) and the
one probe-time ``CaptureSession`` (``session.py``):

- ``transformers_target``: transformers models, through ``AttentionInterface`` (``HFTarget``);
- ``custom``: other PyTorch models whose attention calls ``sinkwatch.attend`` (``CustomTarget``);
- ``olmo_core``: OLMo-core ``Transformer`` models, at their attention backend (``OLMoCoreTarget``);
- ``litgpt``: LitGPT ``GPT`` models, at ``CausalSelfAttention.scaled_dot_product_attention`` (``LitGPTTarget``);
- ``torchtitan``: torchtitan llama3/qwen3 decoders, at each layer's ``inner_attention`` (``TorchtitanTarget``);
- ``megatron``: Megatron-core ``GPTModel``, at each layer's ``self_attention.core_attention`` (``MegatronTarget``).

Adding a framework means one new module here and one line in ``resolve_target``.
"""

from __future__ import annotations

from .custom import CustomTarget, attend
from .litgpt import LitGPTTarget, find_litgpt_model
from .megatron import MegatronTarget, find_megatron_model
from .olmo_core import OLMoCoreTarget, find_olmo_core_model
from .preserve import preserved_rng, untouched
from .session import CaptureSession, Collector, UnsupportedModelError, activate, active_session, capturing
from .target import ProbeTarget
from .torchtitan import TorchtitanTarget, find_torchtitan_model
from .transformers_target import (
    SINKWATCH_EAGER_IMPL,
    SINKWATCH_IMPL,
    SUPPORTED_FAMILIES,
    HFTarget,
    check_supported,
    decoder_blocks,
    find_transformers_model,
    register_attention,
)


def resolve_target(obj) -> ProbeTarget:
    """A ProbeTarget for ``obj``: itself, ``obj.sinkwatch_target()``, an OLMo-core model (or train
    module), or the transformers model inside it."""
    if isinstance(obj, ProbeTarget):
        return obj
    maker = getattr(obj, "sinkwatch_target", None)
    if callable(maker):
        target = maker()
        if not isinstance(target, ProbeTarget):
            raise TypeError(f"{type(obj).__name__}.sinkwatch_target() must return a sinkwatch.CustomTarget, got {type(target).__name__}")
        return target
    olmo = find_olmo_core_model(obj)
    if olmo is not None:
        return OLMoCoreTarget(olmo)
    lit = find_litgpt_model(obj)
    if lit is not None:
        return LitGPTTarget(lit)
    titan = find_torchtitan_model(obj)
    if titan is not None:
        return TorchtitanTarget(titan)
    megatron = find_megatron_model(obj)
    if megatron is not None:
        return MegatronTarget(megatron)
    return HFTarget(find_transformers_model(obj))


__all__ = [
    "SINKWATCH_EAGER_IMPL",
    "SINKWATCH_IMPL",
    "SUPPORTED_FAMILIES",
    "CaptureSession",
    "Collector",
    "CustomTarget",
    "HFTarget",
    "LitGPTTarget",
    "MegatronTarget",
    "OLMoCoreTarget",
    "ProbeTarget",
    "TorchtitanTarget",
    "UnsupportedModelError",
    "activate",
    "active_session",
    "attend",
    "capturing",
    "check_supported",
    "decoder_blocks",
    "find_transformers_model",
    "preserved_rng",
    "register_attention",
    "resolve_target",
    "untouched",
]
