"""Wall-time overhead of SinkWatchCallback at its default interval on a tiny CPU pretraining run.

Each run is its own process (a fresh interpreter, the same seed), with and without the callback,
alternating, ``--repeat`` times; the ratio of medians is reported, side by side in one run.
The model is the demo's shape: a 4-block Llama (d=128, 4 heads) on byte-level text, batch 16 x 128.

Usage: python benchmarks/bench_callback_overhead.py [--steps 1000] [--repeat 2] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_csv  # noqa: E402


def worker(with_callback: bool, steps: int, threads: int) -> dict:
    import lightning.pytorch as pl
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    pl.seed_everything(0, verbose=False)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (steps * 16 + 16, 128), generator=g)

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, i):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    callbacks = []
    out = tempfile.mkdtemp()
    if with_callback:
        from sinkwatch.lightning import SinkWatchCallback

        callbacks.append(SinkWatchCallback(out_dir=out, wandb="offline", console=False))  # the defaults
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    t0 = time.perf_counter()
    trainer.fit(Lit(), loader)
    wall = time.perf_counter() - t0
    n_probes = 0
    if with_callback:
        n_probes = sum(1 for _ in open(Path(out) / "records.jsonl"))
    return {"with_callback": with_callback, "wall_s": wall, "steps": steps, "probes": n_probes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--csv", default="benchmarks/results/bench_callback_overhead.csv")
    ap.add_argument("--worker", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker == "on", args.steps, args.threads)))
        return
    runs = []
    for _ in range(args.repeat):
        for mode in ("off", "on"):
            res = subprocess.run(
                [sys.executable, __file__, "--worker", mode, "--steps", str(args.steps), "--threads", str(args.threads)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"  {mode:3s}: {runs[-1]['wall_s']:.1f} s ({runs[-1]['probes']} probes)", file=sys.stderr)
    off = statistics.median(r["wall_s"] for r in runs if not r["with_callback"])
    on = statistics.median(r["wall_s"] for r in runs if r["with_callback"])
    probes = max(r["probes"] for r in runs)
    print(f"\n{args.steps} steps, batch 16 x 128, 4-block Llama d=128, {args.threads} threads")
    print(f"without callback: {off:.1f} s   with callback (defaults, {probes} probes): {on:.1f} s   overhead: {100 * (on / off - 1):+.1f}%")
    row = {"steps": args.steps, "without_s": off, "with_s": on, "probes": probes, "overhead_pct": 100 * (on / off - 1)}
    print(f"CSV: {write_csv([row], args.csv)}")


if __name__ == "__main__":
    main()
