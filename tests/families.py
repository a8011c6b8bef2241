"""The one table of model families sinkwatch is tested on; docs/metrics.md's family list is generated from it.

Every row names the family (transformers ``model_type``), what it brings that the capture must
honour, and the test that compares sinkwatch's record with an independent eager computation on a
tiny random model of it. The first seven are built by ``tiny_models`` (and also trained there); the
others are built here, each with its defining feature switched on and made to matter: learned
sink logits of real size (gpt-oss), soft-capping at 1.0 under sharpened queries (Gemma 2), gated
attention with gates spread over (0, 1) (Qwen3-Next), and softmax blocks among Mamba / linear-
attention blocks (Qwen3-Next, Jamba, Bamba, Zamba2) or beside them in every block (Falcon-H1).

    python tests/families.py           # print the docs/metrics.md block
    python tests/families.py --write   # rewrite it in docs/metrics.md (tests/test_families.py checks it)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

VOCAB = 256  # the byte tokenizer's vocabulary, so `sinkwatch probe --text` can feed natural windows
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)
RECORD_VS_EAGER = "tests/test_record_vs_eager.py"
ATTENTION_FAMILIES = "tests/test_attention_families.py"


@dataclass(frozen=True)
class Family:
    name: str  # transformers model_type
    title: str  # how docs/metrics.md names it
    features: str  # what the capture must honour
    test: str  # the test comparing its record with eager attention
    config: Callable | None = None  # built here (None: tiny_models builds it)
    softmax_layers: tuple[int, ...] | None = None  # blocks with softmax attention (None: all)
    attention: str = "self_attn"  # the softmax attention module inside a softmax block
    matter: Callable | None = None  # makes the feature matter on a random model (in place)
    gated: bool = False
    sinks: bool = False
    extra: dict = field(default_factory=dict)


def _transformers():
    import transformers as T

    return T


def _sharpen(scale: float, names=("q_proj", "k_proj")):
    """Scale the query and key projections: logits far beyond the soft cap (uncapped, the last rows
    of a random Gemma 2 put up to 0.43 on one key; capped at 1.0 no key gets more than 0.04)."""

    def apply(model):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if any(f"{name}.weight" in n for name in names):
                    p.mul_(scale)

    return apply


def _real_sinks(model):
    """gpt-oss sink logits of real size: from -1 to 4 across heads (a trained gpt-oss puts a large
    share of many rows on the sink; the random init of std 0.02 leaves them near 0)."""
    with torch.no_grad():
        for layer in model.model.layers:
            H = layer.self_attn.sinks.numel()
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 4.0, H))


def _spread_gates(model):
    """Qwen3-Next gates that differ by head and by token: per-head gate biases from -3 to 3 (heads
    from nearly shut to nearly open) and the gate half of q_proj scaled up (tokens spread around them)."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                continue
            H, D = attn.config.num_attention_heads, attn.head_dim
            attn.q_proj.weight.view(H, 2, D, -1)[:, 1].mul_(20.0)  # per head: [query dims | gate dims]
            attn.q_proj.bias.view(H, 2, D)[:, 1] = torch.linspace(-3.0, 3.0, H)[:, None]


def gpt_oss():
    T = _transformers()
    return T.GptOssConfig(
        **_COMMON, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip


def gemma2():
    T = _transformers()
    return T.Gemma2Config(**_COMMON, num_key_value_heads=2, head_dim=8, attn_logit_softcapping=1.0, final_logit_softcapping=30.0,
                          sliding_window=16, query_pre_attn_scalar=16)  # fmt: skip


def qwen3_next():
    T = _transformers()
    return T.Qwen3NextConfig(
        **_COMMON, num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"] * 2, attention_bias=True,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip


def jamba():
    T = _transformers()
    return T.JambaConfig(**_COMMON, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                         expert_layer_offset=1, num_experts=2, mamba_d_state=4, mamba_expand=2, mamba_dt_rank=4)  # fmt: skip


def bamba():
    T = _transformers()
    return T.BambaConfig(**_COMMON, num_key_value_heads=2, attn_layer_indices=[0, 2], mamba_n_heads=4, mamba_d_head=16,
                         mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16)  # fmt: skip


def zamba2():
    T = _transformers()
    return T.Zamba2Config(
        **_COMMON, num_key_value_heads=4, mamba_d_state=8, mamba_headdim=8, mamba_ngroups=1, n_mamba_heads=8, chunk_size=16,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1, use_mem_rope=True,
    )  # fmt: skip


def falcon_h1():
    T = _transformers()
    return T.FalconH1Config(**_COMMON, num_key_value_heads=2, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                            mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16)  # fmt: skip


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("gpt_neox", "GPT-NeoX (Pythia)", "partial rotary, parallel residual", RECORD_VS_EAGER),
        Family("llama", "Llama", "grouped-query attention", RECORD_VS_EAGER),
        Family("olmo", "OLMo", "clip_qkv, non-parametric LayerNorm", RECORD_VS_EAGER),
        Family("olmoe", "OLMoE", "QK-norm over the full width, MoE", RECORD_VS_EAGER),
        Family("qwen2", "Qwen2", "GQA, a sliding-window layer", RECORD_VS_EAGER),
        Family("qwen3", "Qwen3", "GQA, per-head QK-norm", RECORD_VS_EAGER),
        Family("gpt2", "GPT-2", "layer-wise attention scaling", RECORD_VS_EAGER),
        Family("gpt_oss", "gpt-oss", "learned sink logits (`s_aux`), sliding windows, MoE; no sdpa (probed through eager)",
               ATTENTION_FAMILIES, gpt_oss, matter=_real_sinks, sinks=True),
        Family("gemma2", "Gemma 2", "attention soft-capping (1.0 here), sliding windows, `query_pre_attn_scalar`; no sdpa",
               ATTENTION_FAMILIES, gemma2, matter=_sharpen(10.0)),
        Family("qwen3_next", "Qwen3-Next", "Gated DeltaNet blocks (null rows) + gated full attention (PR after the gate)",
               ATTENTION_FAMILIES, qwen3_next, softmax_layers=(1, 3), matter=_spread_gates, gated=True),
        Family("jamba", "Jamba", "Mamba blocks (null rows) + attention blocks, MoE", ATTENTION_FAMILIES, jamba, softmax_layers=(1, 3)),
        Family("bamba", "Bamba", "Mamba-2 blocks (null rows) + attention blocks, block 0 attention", ATTENTION_FAMILIES, bamba,
               softmax_layers=(0, 2)),
        Family("zamba2", "Zamba2", "Mamba-2 blocks (null rows) + one shared attention block run in several blocks",
               ATTENTION_FAMILIES, zamba2, softmax_layers=(1, 3), attention="shared_transformer.self_attn"),
        Family("falcon_h1", "Falcon-H1", "Mamba-2 and attention side by side in every block", ATTENTION_FAMILIES, falcon_h1),
    )
}  # fmt: skip
BUILT_HERE = tuple(name for name, f in FAMILIES.items() if f.config is not None)


def build(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random model of a family built here, its feature made to matter, in eval mode.
    ``overrides``: config attributes to change (``max_position_embeddings=64``)."""
    T = _transformers()
    family = FAMILIES[name]
    config = family.config()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config)
    if family.matter is not None:
        family.matter(model)
    return model.eval()


README_START = "<!-- families:start (generated by tests/families.py from its table; tests/test_families.py checks it) -->"
README_END = "<!-- families:end -->"


def readme_block() -> str:
    """docs/metrics.md's family list, one line per family of the table."""
    lines = [README_START, "| family (`model_type`) | what the capture honours | tested against eager attention in |", "|---|---|---|"]
    for f in FAMILIES.values():
        lines.append(f"| {f.title} (`{f.name}`) | {f.features} | `{f.test}` |")
    lines.append(README_END)
    return "\n".join(lines)


def readme_path() -> Path:
    return Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def readme_with_block(text: str) -> str:
    """docs/metrics.md's text with its generated block replaced by the table's (ValueError without the markers)."""
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"docs/metrics.md has no generated family block ({README_START!r} ... {README_END!r})")
    return text[:start] + readme_block() + text[end + len(README_END) :]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        path = readme_path()
        path.write_text(readme_with_block(path.read_text()))
        print(f"wrote the family list into {path}")
    else:
        print(readme_block())
