"""What each block's sublayers write into the residual stream, read with forward hooks.

The P0-sink circuit is a division of labour inside the first blocks (block 0's attention can tell
position 0 apart, an early MLP amplifies it: docs/stages.md), so a record says position 0's norm
ratio of each block's *attention output* and *MLP output* as well as of the residual stream after
the block. Those are sublayer outputs, not residual differences, so they are defined for every
block layout: sequential (pre-norm), parallel-residual (GPT-NeoX, GPT-J) and hybrid stacks, whose
token mixer (Mamba, linear attention) stands where attention stands.

Sublayers are found by the attribute names the model families use (transformers, OLMo-core, LitGPT,
torchtitan). A block that normalises a sublayer's output before adding it to the residual stream
(Gemma 2/3 and OLMo 2's post-attention / post-feedforward norms) writes the norm's output, not the
sublayer's: a norm that takes the sublayer's very output tensor as its input is that post-norm,
and its output is what is read. A block without a sublayer of a kind reads NaN for it.
"""

from __future__ import annotations

from torch import nn

SUBLAYER_KINDS = ("attention", "mlp")

# attribute names, first match wins; "attention" is the block's token mixer
_NAMES = {
    "attention": ("self_attn", "attention", "attn", "self_attention", "mixer", "mamba", "linear_attn"),
    "mlp": ("mlp", "feed_forward", "feed_forward_moe", "block_sparse_moe", "moe", "ffn"),
}


def find_sublayers(block: nn.Module) -> dict[str, nn.Module]:
    """kind -> the block's sublayer module of that kind (``SUBLAYER_KINDS``), for the kinds it has."""
    found = {}
    for kind, names in _NAMES.items():
        for name in names:
            module = getattr(block, name, None)
            if isinstance(module, nn.Module):
                found[kind] = module
                break
    return found


def norm_children(block: nn.Module) -> list[nn.Module]:
    """The block's own normalisation layers (direct children): the candidates for a post-norm."""
    return [m for m in block.children() if "norm" in type(m).__name__.lower()]
