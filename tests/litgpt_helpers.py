"""Tiny LitGPT models and an independent float64 eager run of them (tests/independent.py's inputs).

``eager_run`` shares nothing with sinkwatch's LitGPT capture: it replaces LitGPT's attention method
on the class with an explicit float64 softmax (scale, soft-capping and mask re-derived from the
config), keeps the probabilities, and reads block outputs and ``attn.proj`` inputs through its own hooks.
"""

from __future__ import annotations

import math

import torch

VOCAB = 256


def tiny_config(kind: str = "llama", **overrides):
    from litgpt.config import Config

    base = dict(
        name=f"tiny-{kind}",
        block_size=128,
        vocab_size=VOCAB,
        padding_multiple=64,
        n_layer=3,
        n_embd=64,
        n_head=4,
        n_query_groups=2,  # GQA
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=128,
    )
    if kind == "gemma":  # soft-capped attention, a sliding-window layer, a scores scalar, MQA
        base.update(
            n_query_groups=1,
            attention_logit_softcapping=20.0,
            attention_scores_scalar=24,
            sliding_window_size=12,
            sliding_window_indices=[1, 0, 1],
            post_attention_norm=True,
            post_mlp_norm=True,
            mlp_class_name="GemmaMLP",
            scale_embeddings=True,
        )
    base.update(overrides)
    return Config(**base)


def build(kind: str = "llama", seed: int = 0, **overrides):
    from litgpt.model import GPT

    torch.manual_seed(seed)
    model = GPT(tiny_config(kind, **overrides))
    model.apply(model._init_weights)
    with torch.no_grad():  # larger q/k than the 0.02 init: attention far from uniform, so the checks bite
        for block in model.transformer.h:
            if hasattr(block.attn, "qkv"):  # CausalSelfAttention (not MultiheadLatentAttention)
                block.attn.qkv.weight.mul_(12.0)
    return model.eval()


def eager_run(model, tokens: torch.Tensor) -> dict:
    """Attention (N, L, H, S, S) float64, block outputs (N, L, S, d), proj inputs (N, L, S, H*D), logits;
    block 0's input and what each block's attention and MLP write (N, L, S, d)."""
    from litgpt.model import CausalSelfAttention

    cfg = model.config
    attn, resid, oproj = {}, {}, {}
    original = CausalSelfAttention.scaled_dot_product_attention

    def explicit(self, q, k, v, mask=None):
        T = q.shape[2]
        scale = 1.0 / math.sqrt(cfg.attention_scores_scalar or cfg.head_size)
        s = (q.double() @ k.double().transpose(-1, -2)) * scale
        if cfg.attention_logit_softcapping is not None:
            s = cfg.attention_logit_softcapping * torch.tanh(s / cfg.attention_logit_softcapping)
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        allowed = j <= i
        if cfg.sliding_window_indices is not None and cfg.sliding_window_indices[self.block_idx]:
            allowed = allowed & (i - j < cfg.sliding_window_size)
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        attn[self.block_idx] = p
        return (p @ v.double()).to(q.dtype).transpose(1, 2)

    written, emb = {"attention": {}, "mlp": {}}, {}
    handles = []
    for i, block in enumerate(model.transformer.h):
        handles.append(block.register_forward_hook(lambda m, a, o, i=i: resid.__setitem__(i, o.double())))
        handles.append(block.attn.proj.register_forward_pre_hook(lambda m, a, i=i: oproj.__setitem__(i, a[0].double())))
        # what the block adds to the residual stream: each sublayer through its post-norm (Identity when unset)
        for kind, post in (("attention", block.post_attention_norm), ("mlp", block.post_mlp_norm)):
            handles.append(post.register_forward_hook(lambda m, a, o, i=i, kind=kind: written[kind].__setitem__(i, o.double())))
    handles.append(model.transformer.h[0].register_forward_pre_hook(lambda m, a: emb.__setitem__(0, a[0].double())))
    CausalSelfAttention.scaled_dot_product_attention = explicit
    try:
        with torch.no_grad():
            logits = model(tokens)
    finally:
        CausalSelfAttention.scaled_dot_product_attention = original
        for h in handles:
            h.remove()
    L = len(model.transformer.h)
    return {
        "attn": torch.stack([attn[i] for i in range(L)], dim=1).numpy(),
        "resid": torch.stack([resid[i] for i in range(L)], dim=1).numpy(),
        "oproj": torch.stack([oproj[i] for i in range(L)], dim=1).numpy(),
        "logits": logits.double().numpy(),
        "emb": emb[0].numpy(),
        "written": {kind: torch.stack([w[i] for i in range(L)], dim=1).numpy() for kind, w in written.items()},
    }
