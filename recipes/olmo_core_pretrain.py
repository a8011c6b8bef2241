"""Pretraining with OLMo-core, watched by sinkwatch: the lines that matter are marked (1)-(4).

Tiny defaults run on a laptop CPU (a byte-level OLMo-2-style model on the Python standard library's
source); real sizes by flag; several processes with torchrun (FSDP2 by default, every rank probes):

    python recipes/olmo_core_pretrain.py                                   # tiny, CPU
    python recipes/olmo_core_pretrain.py --no-sinkwatch                    # the same run, unwatched
    torchrun --nproc_per_node 8 recipes/olmo_core_pretrain.py --text corpus.txt \\
        --tokenizer EleutherAI/pythia-160m --d-model 2048 --layers 16 --heads 16 --seq-len 4096 \\
        --batch-size 8 --steps 50000 --device cuda --dp fsdp

Needs ``pip install 'sinkwatch[olmo-core]'``. Prints the wall time of ``Trainer.fit`` at the end
(compare with ``--no-sinkwatch`` for the callback's overhead).
"""

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.distributed.utils import get_rank, is_distributed
from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig, prepare_training_environment, teardown_training_environment
from olmo_core.train.callbacks import CheckpointerCallback
from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

from sinkwatch.demo import add_pretrain_arguments, pretrain_corpus
from sinkwatch.olmo_core import SinkWatchCallback  # (1) import
from sinkwatch.probes import default_probes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pretrain_arguments(ap)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dp", default="fsdp", choices=("fsdp", "hsdp", "ddp"), help="data parallelism under torchrun")
    ap.add_argument("--every", type=int, default=None, help="probe every N steps (default: sinkwatch's, 250)")
    ap.add_argument("--save-interval", type=int, default=1000)
    ap.add_argument("--out", default="runs/olmo_core_pretrain")
    ap.add_argument("--no-sinkwatch", action="store_true", help="train without the callback (overhead baseline)")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:  # under torchrun: the process group (gloo on CPU, NCCL on GPUs)
        prepare_training_environment(seed=0, backend="gloo" if args.device == "cpu" else "cpu:gloo,cuda:nccl")
    torch.manual_seed(0)
    out = Path(args.out)

    corpus, vocab, vocab_range = pretrain_corpus(args.text, args.tokenizer)
    data_dir = out / "data"
    if get_rank() == 0:
        data_dir.mkdir(parents=True, exist_ok=True)
        corpus.astype(np.uint16 if vocab <= 2**16 else np.uint32).tofile(data_dir / "tokens.npy")
    if is_distributed():
        torch.distributed.barrier()
    tokenizer = TokenizerConfig(vocab_size=vocab, eos_token_id=0, pad_token_id=0)
    dataset = NumpyFSLDatasetConfig(
        tokenizer=tokenizer,
        paths=[str(data_dir / "tokens.npy")],
        sequence_length=args.seq_len,
        work_dir=str(data_dir / "work"),
        dtype="uint16" if vocab <= 2**16 else "uint32",
    ).build()
    model = TransformerConfig.llama_like(
        d_model=args.d_model,
        vocab_size=vocab,
        n_layers=args.layers,
        n_heads=args.heads,
        block_name=TransformerBlockType.reordered_norm,
        qk_norm=True,
        hidden_size_multiple_of=64,
        layer_norm_eps=1e-6,
    ).build(init_device="meta" if args.device != "cpu" else "cpu")
    device = torch.device(args.device)
    dp = TransformerDataParallelConfig(name=DataParallelType(args.dp)) if is_distributed() else None
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=args.batch_size * args.seq_len,
        max_sequence_length=args.seq_len,
        optim=AdamWConfig(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95)),
        dp_config=dp,
    ).build(model, device=device)
    world = torch.distributed.get_world_size() if is_distributed() else 1
    loader = NumpyDataLoaderConfig(
        global_batch_size=args.batch_size * args.seq_len * world, seed=0, work_dir=str(data_dir / "work"), num_workers=0
    ).build(dataset)

    callbacks = {"checkpointer": CheckpointerCallback(save_interval=args.save_interval, save_async=False)}
    if not args.no_sinkwatch:
        # (2) probes fitted to the data: byte-level text lives in printable ASCII; tokenizer vocabularies use the paper's range
        probes = default_probes(args.seq_len, vocab_range=vocab_range)
        every = {} if args.every is None else {"every_n_steps": args.every}
        callbacks["sinkwatch"] = SinkWatchCallback(
            out_dir=str(out / "sinkwatch"), probes=probes, wandb=args.wandb, **every
        )  # (3) the callback
    trainer = TrainerConfig(
        save_folder=str(out / "checkpoints"),
        work_dir=str(out / "work"),
        max_duration=Duration.steps(args.steps),
        device=args.device,
        metrics_collect_interval=50,
        callbacks=callbacks,  # (4) attach it: a named callback like OLMo-core's own
    ).build(train_module, loader)
    t0 = time.perf_counter()
    trainer.fit()
    if get_rank() == 0:
        print(
            f"fit: {time.perf_counter() - t0:.1f} s for {args.steps} steps"
            + ("" if args.no_sinkwatch else f"; records: {out}/sinkwatch/records.jsonl; report: sinkwatch report {out}/sinkwatch")
        )
    if is_distributed():
        teardown_training_environment()


if __name__ == "__main__":
    main()
