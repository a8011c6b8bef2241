"""What the torchtitan tests share (tests/test_torchtitan.py, tests/torchtitan_cells.py): FlexAttention run
eagerly (with a dense attention where CPU has no Flex backward), the small probe sets, and the stand-in
trainer of torchtitan's own unit tests, built from the real parts."""

from __future__ import annotations

import torch


def eager_flex(*, trainable: bool = False) -> None:
    """FlexAttention uncompiled (its ``torch.compile``d kernel takes ~45 s per shape to build on this CPU).
    ``trainable``: where gradients are needed (a training forward), the same attention as a dense masked
    SDPA, since FlexAttention has no backward on CPU; forwards without gradients (every probe) still go
    through ``flex_attention`` itself."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, create_mask, flex_attention
    from torchtitan.models.common.attention import FlexAttention

    if not trainable:
        FlexAttention._compiled_flex_attn = staticmethod(flex_attention)
        return

    def flex_or_dense(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None, kernel_options=None):
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
            return flex_attention(
                q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_aux=return_aux,
                kernel_options=kernel_options,
            )  # fmt: skip
        if score_mod is not None or (return_aux is not None and any(return_aux)):
            raise NotImplementedError("the dense stand-in covers a mask_mod alone (llama3, qwen3)")
        B, _, L, _ = q.shape
        mask = create_mask(block_mask.mask_mod, B, 1, L, k.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out, AuxOutput()

    FlexAttention._compiled_flex_attn = staticmethod(flex_or_dense)


def small_probes(vocab_size: int) -> list:
    """The default probe sets' kinds, smaller (eager FlexAttention on CPU is slow); natural windows come from
    the training batches."""
    from sinkwatch import InductionProbe, RepeatedRandomProbe

    V = vocab_size
    return [InductionProbe(n=6, seq_len=64, vocab_range=(2, V)), RepeatedRandomProbe(n=4, seq_len=32, vocab_range=(2, V))]


def use_small_probes(live) -> None:
    """``live`` (a LiveMonitor built with ``probes=None``) probes with ``small_probes`` plus its natural windows."""
    from sinkwatch import Monitor

    small = small_probes(live.target.vocab_size)
    live._build_monitor = lambda: Monitor([*small, live.natural], config=live.config.monitor)
