"""LitGPT pretraining (``litgpt.pretrain.setup``, unmodified), watched by sinkwatch through Fabric's
callback entry point: no sinkwatch code in the training loop, only an environment variable.

    pip install -e .                       # sinkwatch, with its lightning.fabric.callbacks_factory entry point
    pip install --no-deps litgpt==0.5.13 'jsonargparse[signatures]>=4.37,<=4.41'
    python recipes/litgpt/pretrain.py      # tiny, CPU: a byte-level Llama on the Python standard library's source

The same variable monitors the LitGPT CLI itself (any model, any data module):

    SINKWATCH_FABRIC='{"every_n_steps": 100, "out_dir": "out/pretrain/sinkwatch"}' litgpt pretrain ...

Runs from any directory; everything goes under --out (checkpoints step-NNNNNNNN/, logs/, sinkwatch/).
Afterwards: ``sinkwatch report OUT/sinkwatch``, and ``sinkwatch replay OUT --live-store OUT/sinkwatch
--tokens-per-step B*T`` re-measures the checkpoints with the live run's probe sets (the same records).
"""

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from unittest import mock

import torch

from sinkwatch.demo import DemoWindows, add_pretrain_arguments, pretrain_corpus


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pretrain_arguments(ap)
    ap.add_argument("--out", default="runs/litgpt_pretrain")
    ap.add_argument("--every", type=int, default=None, help="probe every N optimizer steps (default: steps // 20)")
    args = ap.parse_args()
    out = Path(args.out).resolve()

    # (1) the switch: SINKWATCH_FABRIC (a JSON object of the callback's scalar options, or 1 for its defaults)
    if not any(ep.value.startswith("sinkwatch.") for ep in metadata.entry_points(group="lightning.fabric.callbacks_factory")):
        sys.exit("sinkwatch's Fabric entry point is not installed: run `pip install -e .` in the sinkwatch checkout")
    every = args.every or max(1, args.steps // 20)
    os.environ.setdefault(
        "SINKWATCH_FABRIC",
        json.dumps({"every_n_steps": every, "out_dir": str(out / "sinkwatch"), "wandb": args.wandb, "max_steps": args.steps}),
    )

    from litgpt import pretrain
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.config import Config
    from litgpt.data import DataModule

    corpus, vocab, _ = pretrain_corpus(args.text, args.tokenizer)

    class Windows(DataModule):  # (2) your data: LitGPT batches are (B, T + 1) token rows
        def connect(self, tokenizer=None, batch_size=1, max_seq_length=None, **kwargs):
            self.batch_size, self.T = batch_size, max_seq_length

        def train_dataloader(self):
            windows = DemoWindows(corpus, args.steps * self.batch_size, seq_len=self.T + 1, periodic=0.5 if args.text is None else 0.0)
            return torch.utils.data.DataLoader(windows, batch_size=self.batch_size)

        def val_dataloader(self):
            windows = DemoWindows(corpus, 2 * self.batch_size, seq_len=self.T + 1, seed=1)
            return torch.utils.data.DataLoader(windows, batch_size=self.batch_size)

    config = Config(
        name="recipe-llama", block_size=args.seq_len, vocab_size=vocab, padding_multiple=64, n_layer=args.layers, n_head=args.heads,
        n_embd=args.d_model, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP", intermediate_size=4 * args.d_model,
    )  # fmt: skip
    train = TrainArgs(
        global_batch_size=args.batch_size, micro_batch_size=args.batch_size, max_tokens=args.steps * args.batch_size * args.seq_len,
        save_interval=every, log_interval=max(1, every // 2), lr_warmup_steps=min(100, args.steps // 10), max_norm=1.0, min_lr=args.lr / 10,
    )  # fmt: skip
    # (3) LitGPT's own entry point, unmodified. save_hyperparameters re-parses sys.argv as litgpt's CLI would;
    # called as a function from this script, there is no such command line (LitGPT's tests stand it in the same way)
    with mock.patch.object(pretrain, "save_hyperparameters"):
        pretrain.setup(
            "recipe-llama", model_config=config, out_dir=out, precision="32-true", devices=1, data=Windows(), train=train,
            eval=EvalArgs(interval=10**9, max_iters=1, final_validation=False), logger_name="csv",
            optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": args.lr, "weight_decay": 0.1, "betas": [0.9, 0.95]}},
        )  # fmt: skip
    print(f"records: {out}/sinkwatch/records.jsonl; report: sinkwatch report {out}/sinkwatch")  # (4) read the results


if __name__ == "__main__":
    main()
