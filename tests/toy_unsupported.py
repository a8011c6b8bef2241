"""A transformers PreTrainedModel whose attention is hand-written (it bypasses the attention interface).

Kept in its own module: transformers decides support by reading the module's source.
"""

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class ToyConfig(PretrainedConfig):
    model_type = "toy_handwritten"

    def __init__(self, vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, **kw):
        super().__init__(**kw)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads


class ToyAttention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class ToyLM(PreTrainedModel):
    config_class = ToyConfig

    def __init__(self, config):
        super().__init__(config)
        self.emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ToyAttention(config.hidden_size) for _ in range(config.num_hidden_layers)])
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, **kw):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return CausalLMOutput(logits=self.head(x))
