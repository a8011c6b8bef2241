"""Capture for LitGPT models (``litgpt.model.GPT``), at ``CausalSelfAttention.scaled_dot_product_attention``.

LitGPT's attention computes q, k, v, QK-norm and RoPE in ``CausalSelfAttention.forward`` and hands
them to its own ``scaled_dot_product_attention(q, k, v, mask)`` method, all (B, H, T, hs), k and v
already repeated for GQA (``repeat_interleave`` over ``n_head // n_query_groups``: query head h reads
key group h // (n_head // n_query_groups)). During a probe sinkwatch puts a wrapper in each attention
module's instance dict (removed afterwards), which hands q and k, the key groups taken back out
(``k[:, ::q_per_kv]``), to the statistics; the output is sinkwatch's fused pass where it computes
one (on CPU by default, ``CaptureSession.attend``), else LitGPT's own method, called unchanged. The scale is LitGPT's:
``1 / sqrt(attention_scores_scalar or head_size) * mscale**2`` (mscale: YaRN's, else 1); soft-capping is
``attention_logit_softcapping`` (``thresh * tanh(s / thresh)``, as ``do_softcapping``); a sliding-window
layer arrives as the ``mask`` argument (a float (1, 1, T, T) mask, 0 where visible), read back as a
window and checked to be exactly the banded causal mask. What each head writes is read at the input
of ``attn.proj``; block outputs are the residual stream.

Refused with ``UnsupportedModelError``: ``MultiheadLatentAttention`` (its own method, scaled by
``qk_head_dim``, not tested here), a KV-cache call (``input_pos``: a probe is one full-sequence
forward), a mask that is neither None nor a banded causal mask.

This module imports ``litgpt`` only inside functions: the rest of sinkwatch never needs it.
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch
from torch import nn

from .head import ProbeForward, losses_from_logits
from .session import CaptureSession, Collector, UnsupportedModelError, active_session, capturing
from .target import ProbeTarget


def is_litgpt_model(obj) -> bool:
    """Whether ``obj`` is a ``litgpt.model.GPT`` (without importing litgpt when it is absent)."""
    if "litgpt" not in sys.modules or not isinstance(obj, nn.Module):
        return False
    from litgpt.model import GPT

    return isinstance(obj, GPT)


def find_litgpt_model(obj) -> nn.Module | None:
    """The LitGPT ``GPT`` in ``obj``: itself, or the model inside a Fabric/compile/DDP wrapper."""
    seen = 0
    while isinstance(obj, nn.Module) and seen < 6:
        if is_litgpt_model(obj):
            return obj
        obj = getattr(obj, "_original_module", None) or getattr(obj, "_orig_mod", None) or getattr(obj, "module", None)
        seen += 1
    return None


def attention_scale(attention: nn.Module) -> float:
    """LitGPT's scale of ``CausalSelfAttention.scaled_dot_product_attention``."""
    config = attention.config
    scale = 1.0 / math.sqrt(config.attention_scores_scalar or config.head_size)
    mscale = float(getattr(attention, "mscale", 1.0))
    return scale * mscale * mscale


def window_of(mask: torch.Tensor | None, T: int) -> int | None:
    """The sliding window a LitGPT float mask (0: visible, -inf or finfo.min: masked) expresses; None
    for None (plain causal). Raises ``UnsupportedModelError`` unless it is exactly the banded causal mask."""
    if mask is None:
        return None
    m = mask.detach()
    while m.dim() > 2:
        if m.shape[0] != 1:
            raise UnsupportedModelError(f"LitGPT attention got a per-sample or per-head mask {tuple(mask.shape)}; sinkwatch cannot read it")
        m = m[0]
    if m.shape != (T, T):
        raise UnsupportedModelError(f"LitGPT attention got a mask of shape {tuple(mask.shape)} for {T} tokens; sinkwatch cannot read it")
    visible = (m == 0).cpu()
    w = int(visible[-1].sum())
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    band = (j <= i) & (i - j < w)
    if w < 1 or not torch.equal(visible, band):
        raise UnsupportedModelError("LitGPT attention got a mask that is not a (sliding-window) causal mask; sinkwatch cannot read it")
    return None if w >= T else w


def check_litgpt_supported(model: nn.Module) -> None:
    from litgpt.model import CausalSelfAttention

    for i, block in enumerate(model.transformer.h):
        attention = getattr(block, "attn", None)
        if type(attention).__name__ == "MultiheadLatentAttention":
            raise UnsupportedModelError(
                f"LitGPT {model.config.name}: block {i} uses MultiheadLatentAttention, which sinkwatch has not been tested with; "
                "sinkwatch probes LitGPT models with CausalSelfAttention"
            )
        if not isinstance(attention, CausalSelfAttention):
            raise UnsupportedModelError(
                f"LitGPT {model.config.name}: block {i}'s attention is {type(attention).__name__}, not CausalSelfAttention"
            )


class LitGPTTarget(ProbeTarget):
    """A LitGPT ``GPT`` (possibly ``fully_shard``-ed: every rank must probe together)."""

    def __init__(self, model: nn.Module):
        if not is_litgpt_model(model):
            raise TypeError(f"LitGPTTarget needs a litgpt.model.GPT, got {type(model).__name__}")
        check_litgpt_supported(model)
        self.model = self.module = model
        self.name = f"litgpt.{model.config.name or 'GPT'}"
        self._blocks = model.transformer.h

    def blocks(self) -> nn.ModuleList:
        return self._blocks

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)  # the real vocabulary (the logits are padded_vocab_size wide)

    @property
    def context(self) -> int | None:
        return int(self.model.max_seq_length)  # GPT.forward refuses longer sequences

    @contextlib.contextmanager
    def capture(self, collector: Collector):
        session = CaptureSession(collector, self._blocks, self.name)

        def forward(input_ids: torch.Tensor, all_logits: bool = False, token_losses: bool = False) -> ProbeForward:
            session.begin()
            logits = self.model(input_ids)  # (B, S, padded_vocab_size): GPT.forward has no last-position-only mode
            session.end()
            losses = losses_from_logits(logits, input_ids) if token_losses else None  # a chunk beside the model's own logits
            return ProbeForward(logits if all_logits else logits[:, -1:], losses)

        wrapped = []
        try:
            with capturing(session):
                for block in self._blocks:
                    attention = block.attn
                    attention.scaled_dot_product_attention = _captured_sdpa(attention)  # instance attribute: this probe only
                    wrapped.append(attention)
                yield forward
        finally:
            for attention in wrapped:
                attention.__dict__.pop("scaled_dot_product_attention", None)


def _captured_sdpa(attention: nn.Module):
    original = type(attention).scaled_dot_product_attention.__get__(attention)
    config = attention.config

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        session = active_session()
        if session is None:
            return original(q, k, v, mask)
        T = q.shape[2]
        if k.shape[2] != T:
            raise UnsupportedModelError("LitGPT attention ran with a KV cache (keys longer than queries); sinkwatch probes full sequences")
        q_per_kv = q.shape[1] // config.n_query_groups
        repeated = k.shape[1] == q.shape[1] and q_per_kv > 1
        key = k[:, ::q_per_kv] if repeated else k  # (B, n_query_groups, T, hs)
        value = v[:, ::q_per_kv] if repeated else v
        softcap = config.attention_logit_softcapping
        return session.attend(
            lambda: original(q, k, v, mask),  # (B, T, nh, hs)
            attention,
            q,
            key,
            attention_scale(attention),
            window_of(mask, T),  # a mask that is not exactly the (banded) causal one was refused here
            float(softcap) if softcap is not None else None,
            None,
            attention.proj,
            value=value,  # causal, no dropout: sinkwatch's fused pass may compute the output
        )

    return sdpa
