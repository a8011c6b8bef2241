"""Real tiny training setups for the callback tests: a LightningModule around a transformers
model, a nanoGPT-style module that calls sinkwatch.attend, and copy-task data."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import torch
from tiny_models import VOCAB, copy_task_batch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import sinkwatch


class CopyDataset(Dataset):
    """Deterministic [R | R] sequences (item i depends only on i)."""

    def __init__(self, n: int = 512, half: int = 32, seed: int = 0):
        self.data = copy_task_batch(np.random.RandomState(seed), n, half)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def loader(batch_size: int = 8, n: int = 512, half: int = 32) -> DataLoader:
    return DataLoader(CopyDataset(n, half), batch_size=batch_size, shuffle=False)


class LitLM(pl.LightningModule):
    """A LightningModule holding a transformers causal LM; records its loss sequence."""

    def __init__(self, model: nn.Module, lr: float = 3e-3):
        super().__init__()
        self.model = model
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        self.losses.append(float(out.loss.detach()))
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LitTiny(LitLM):
    """LitLM around ``tiny_models.build(family)``, rebuilt from its saved hyperparameters
    (``LitTiny.load_from_checkpoint(path)``: what ``sinkwatch replay DIR --lightning-module`` calls)."""

    def __init__(self, family: str = "llama", lr: float = 3e-3, seed: int = 0):
        from tiny_models import build

        super().__init__(build(family, seed=seed), lr)
        self.save_hyperparameters()


# ---- a nanoGPT-style model, not a transformers model -----------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, S, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(B, S, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        y = sinkwatch.attend(q, k, v)  # instead of F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, S, d))
        return x + self.mlp(self.ln2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 32, layers: int = 2, heads: int = 4, context: int = 128):
        super().__init__()
        self.context = context
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


class LitNanoGPT(pl.LightningModule):
    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.gpt = NanoGPT()
        self.lr = lr

    def sinkwatch_target(self):
        return sinkwatch.CustomTarget(self.gpt, blocks=self.gpt.h, vocab_size=VOCAB, context=self.gpt.context, name="NanoGPT")

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self.gpt(ids)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def trainer(tmp_path, callbacks=(), max_steps: int = 20, **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=list(callbacks), logger=kw.pop("logger", False),
        enable_checkpointing=kw.pop("enable_checkpointing", False), enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), **kw,
    )


def params_of(module: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def finite(x) -> bool:
    return x is not None and math.isfinite(x)
