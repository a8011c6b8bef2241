"""Pretraining with Lightning, watched by sinkwatch: the five lines that matter are marked.

Tiny defaults run on a laptop CPU in minutes (a byte-level Llama on the Python standard library's
source); real sizes by flag:

    python recipes/lightning_pretrain.py                          # tiny, CPU
    python recipes/lightning_pretrain.py --text corpus.txt --tokenizer EleutherAI/pythia-160m \\
        --d-model 768 --layers 12 --heads 12 --seq-len 1024 --batch-size 32 --steps 50000 --device cuda
"""

import argparse

import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sinkwatch.demo import DemoWindows, add_pretrain_arguments, pretrain_corpus
from sinkwatch.lightning import SinkWatchCallback
from sinkwatch.probes import default_probes  # (1) import


class LM(pl.LightningModule):
    def __init__(self, model, lr):
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, betas=(0.9, 0.95))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pretrain_arguments(ap)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="runs/lightning_pretrain")
    args = ap.parse_args()

    corpus, vocab, vocab_range = pretrain_corpus(args.text, args.tokenizer)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(cfg)
    data = torch.utils.data.DataLoader(
        DemoWindows(corpus, args.steps * args.batch_size, seq_len=args.seq_len, periodic=0.5 if args.text is None else 0.0),
        batch_size=args.batch_size,
    )

    # (2) probes fitted to the data: byte-level text lives in printable ASCII; tokenizer vocabularies use the paper's range
    probes = default_probes(args.seq_len, vocab_range=vocab_range)
    watch = SinkWatchCallback(every_n_steps=max(1, args.steps // 20), out_dir=args.out, probes=probes, wandb=args.wandb)  # (3) the callback

    trainer = pl.Trainer(accelerator="gpu" if args.device.startswith("cuda") else "cpu", devices=1, max_steps=args.steps,
                         callbacks=[watch], logger=False, enable_checkpointing=False, default_root_dir=args.out)  # (4) attach it
    trainer.fit(LM(model, args.lr), data)
    print(f"records: {args.out}/records.jsonl; report: sinkwatch report {args.out}")  # (5) read the results


if __name__ == "__main__":
    main()
