"""Tiny models of every supported family, built and trained by the tests themselves.

Shapes are small enough that training a few hundred steps takes about a second on a CPU core,
but each family keeps its defining quirk: GPT-NeoX partial rotary + parallel residual, Llama and
Qwen2/3 GQA, Qwen2 a sliding-window layer, OLMo clip_qkv, OLMoE MoE + QK-norm, GPT-2 layer-wise
attention scaling.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers as T

VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=1,
)


def config_for(family: str, **overrides) -> T.PretrainedConfig:
    c = {**_COMMON, **overrides}
    if family == "gpt_neox":
        return T.GPTNeoXConfig(**c, rotary_pct=0.25, use_parallel_residual=True)
    if family == "llama":
        return T.LlamaConfig(**c, num_key_value_heads=2)
    if family == "olmo":
        return T.OlmoConfig(**c, clip_qkv=2.0)
    if family == "olmoe":
        return T.OlmoeConfig(**c, num_experts=4, num_experts_per_tok=2)
    if family == "qwen2":  # layer 1 is a sliding-window layer (window 16)
        return T.Qwen2Config(**c, num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    if family == "qwen3":
        return T.Qwen3Config(**c, num_key_value_heads=1, head_dim=8)
    if family == "gpt2":
        return T.GPT2Config(
            vocab_size=c["vocab_size"], n_embd=c["hidden_size"], n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"],
            n_positions=c["max_position_embeddings"], bos_token_id=0, eos_token_id=1, scale_attn_by_inverse_layer_idx=True,
        )
    raise KeyError(family)


FAMILIES = ("gpt_neox", "llama", "olmo", "olmoe", "qwen2", "qwen3", "gpt2")

# the input of each family's attention output projection: "the per-head attention output"
OUTPUT_PROJECTION = {
    "gpt_neox": "attention.dense",
    "llama": "self_attn.o_proj",
    "olmo": "self_attn.o_proj",
    "olmoe": "self_attn.o_proj",
    "qwen2": "self_attn.o_proj",
    "qwen3": "self_attn.o_proj",
    "gpt2": "attn.c_proj",
}


def build(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config_for(family, **overrides))
    return model.eval()


def copy_task_batch(rng: np.random.RandomState, batch: int, half: int, lo: int = 2, hi: int = VOCAB) -> torch.Tensor:
    """[R | R] with R random: a task only an induction circuit solves (after the first copy)."""
    r = rng.randint(lo, hi, size=(batch, half))
    return torch.from_numpy(np.concatenate([r, r], axis=1)).long()


def train(model: torch.nn.Module, steps: int = 600, *, seed: int = 0, batch: int = 16, half: int = 32, lr: float = 3e-3) -> list[float]:
    """Plain AdamW on the copy task; returns the loss curve. The model is left in eval mode."""
    torch.manual_seed(seed)
    rng = np.random.RandomState(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        ids = copy_task_batch(rng, batch, half)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
