"""benchmarks/gpu_check.sh's torchtitan stage: a real torchtitan 0.3.0 ``Trainer`` on one GPU,
built the way ``python -m torchtitan.train`` builds it, from the command line sinkwatch documents
(``--module sinkwatch.torchtitan --config llama3_debugmodel`` and ``--sinkwatch.*`` options, parsed by
torchtitan's own ConfigManager), then ``config.build()``, ``trainer.train()``, ``trainer.close()``, with
torchtitan's defaults otherwise: FSDP2 with bfloat16 parameter mixed precision, the spmd_types backend,
selective activation checkpointing, CUDA graphs around forward-backward, compiled FlexAttention. Checked:
the trainer is a SinkWatchTrainer, records at steps 0, 2 and 4 with no error, whole heads, probe_dtype
bfloat16, the ``sinkwatch/...`` scalars logged through torchtitan's metrics logger.

Three things differ from a stock run, each because the device has no network and a 90 s budget: the
tokenizer and the data (no Hugging Face assets or datasets travel: a byte tokenizer and seeded random
tokens, both torchtitan ``Configurable``s set on the parsed config), and FlexAttention compiled without
torchtitan's ``max_autotune`` (its autotuning alone would take minutes).

    python3 benchmarks/gpu_torchtitan_check.py --requirements    # exit 0, or 3 and why the stage cannot run
    python3 -m torch.distributed.run --nproc_per_node 1 benchmarks/gpu_torchtitan_check.py --out DIR
    python3 benchmarks/gpu_torchtitan_check.py --parse-only --out DIR   # no GPU: the config, one batch
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

STEPS, EVERY = 4, 2
TESTED_TORCH = "2.13"


def requirement_problem() -> str | None:
    """Why this machine cannot run torchtitan 0.3.0 with sinkwatch, or None."""
    if sys.version_info < (3, 11):
        return f"python {sys.version.split()[0]}: torchtitan 0.3.0 needs python >= 3.11"
    try:
        import torch
        import torch.distributed.fsdp as fsdp
    except ImportError as exc:
        return f"torch is not importable ({exc})"

    if not hasattr(fsdp, "DataParallelMeshDims"):  # torchtitan/distributed/fsdp.py imports it (torch >= 2.12)
        return f"torch {torch.__version__} has no torch.distributed.fsdp.DataParallelMeshDims, which torchtitan 0.3.0 imports " \
            f"(it is built against torch 2.14 nightlies; sinkwatch tested it on {TESTED_TORCH})"  # fmt: skip
    try:
        import torchtitan
    except ImportError as exc:
        needs = "tyro, spmd_types, torchdata, torch_checkpointing"
        return f"torchtitan is not importable ({exc}); carry torchtitan 0.3.0 and its needs ({needs})"
    if torchtitan.__version__ != "0.3.0":
        return f"torchtitan {torchtitan.__version__}: sinkwatch.torchtitan is tested with 0.3.0"
    return None


def _install_datasets_stand_in() -> None:
    import torchtitan_helpers

    for name, module in torchtitan_helpers.datasets_stand_in().items():
        sys.modules.setdefault(name, module)


def components():
    """The byte tokenizer and the random-token loader, as torchtitan Configurables (defined here, after the
    requirement check: they subclass torchtitan's bases)."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class ByteTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 2048

        def __init__(self, config: Config, *, tokenizer_path: str | None = None):
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, text: str, *args, **kwargs) -> list[int]:
            return list(text.encode())

        def decode(self, ids, *args, **kwargs) -> str:
            return bytes(int(i) % 256 for i in ids).decode(errors="replace")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class RandomTokens(BaseDataLoader):
        """(B, L) seeded random tokens per rank, each row a repeated random half (so induction can form), as
        torchtitan's loaders yield them: ({"input", "positions"}, labels)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 2048
            seed: int = 0

        def __init__(self, config: Config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size, **kwargs):
            self.config, self.rank, self.seq_len, self.batch = config, dp_rank, seq_len, local_batch_size
            self.batches = 0

        def __iter__(self):
            g = torch.Generator().manual_seed(self.config.seed + 1000 * self.rank)
            B, L = self.batch, self.seq_len
            while True:
                half = torch.randint(0, self.config.vocab_size, (B, (L + 2) // 2), generator=g)
                ids = torch.cat([half, half], dim=1)[:, : L + 1]
                self.batches += 1
                yield {"input": ids[:, :-1], "positions": torch.arange(L).expand(B, L).clone()}, ids[:, 1:]

        def state_dict(self):
            return {"batches": self.batches}

        def load_state_dict(self, state_dict):
            self.batches = state_dict.get("batches", 0)

    return ByteTokenizer, RandomTokens


def command_line(out: Path) -> list[str]:
    """The documented command line (docs/live.md), shortened to a few steps."""
    return [
        "--module", "sinkwatch.torchtitan", "--config", "llama3_debugmodel",
        "--training.steps", str(STEPS), "--training.local_batch_size", "4", "--training.seq_len", "512",
        "--dump_folder", str(out / "dump"), "--metrics.log_freq", "1",
        "--sinkwatch.every_n_steps", str(EVERY), "--sinkwatch.out_dir", str(out / "sw"), "--sinkwatch.wandb", "disabled",
    ]  # fmt: skip


def parsed_config(out: Path):
    from torchtitan.config import ConfigManager

    ByteTokenizer, RandomTokens = components()
    config = ConfigManager().parse_args(command_line(out))
    vocab = config.model_spec.model.vocab_size
    config.tokenizer = ByteTokenizer.Config(vocab_size=vocab)
    config.dataloader = RandomTokens.Config(vocab_size=vocab)
    return config


def check(out: Path, logged: list) -> dict:
    from sinkwatch.reporters.jsonl import read_jsonl

    records = read_jsonl(out / "sw" / "records.jsonl")
    summary = {
        "steps": [r.get("step") for r in records], "errors": [r["error"] for r in records if "error" in r],
        "probe_dtype": sorted({r.get("probe_dtype") for r in records}), "n_layers": sorted({r.get("n_layers") for r in records}),
        "n_heads": sorted({r.get("n_heads") for r in records}), "model": sorted({r.get("model") for r in records}),
        "sink_rate": [r.get("sink_rate") for r in records], "probe_seconds": [r.get("probe_seconds") for r in records],
        "logged_steps": logged,
    }  # fmt: skip
    problems = []
    if summary["steps"] != [0, EVERY, STEPS]:
        problems.append(f"records at steps {summary['steps']}, expected {[0, EVERY, STEPS]}")
    if summary["errors"]:
        problems.append(f"probe errors: {summary['errors']}")
    if summary["probe_dtype"] != ["bfloat16"] or summary["n_layers"] != [6] or summary["n_heads"] != [16]:
        problems.append("records: probe_dtype bfloat16, 6 layers and 16 heads expected")
    if logged != [0, EVERY, STEPS]:
        problems.append(f"sinkwatch/ scalars logged through metrics_processor.logger at {logged}, expected {[0, EVERY, STEPS]}")
    summary["problems"] = problems
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="a scratch directory (records, torchtitan's dump folder)")
    p.add_argument("--requirements", action="store_true", help="only say whether this machine can run the stage")
    p.add_argument("--parse-only", action="store_true", help="parse the config and read one batch; no Trainer (no GPU needed)")
    args = p.parse_args(argv)
    problem = requirement_problem()
    if args.requirements or problem is not None:
        print(f"torchtitan stage cannot run here: {problem}" if problem else "torchtitan stage requirements met")
        return 3 if problem else 0
    if args.out is None:
        p.error("--out is required")
    _install_datasets_stand_in()
    import torch

    from sinkwatch.torchtitan import SinkWatchTrainer

    config = parsed_config(args.out)
    if not isinstance(config, SinkWatchTrainer.Config):
        print(f"FAIL: --module sinkwatch.torchtitan parsed to {type(config).__qualname__}")
        return 1
    if args.parse_only:
        loader = config.dataloader.build(
            dp_world_size=1, dp_rank=0, tokenizer=config.tokenizer.build(tokenizer_path=None), seq_len=config.training.seq_len,
            local_batch_size=config.training.local_batch_size,
        )  # fmt: skip
        batch, labels = next(iter(loader))
        print(json.dumps({"config": type(config).__qualname__, "sinkwatch": str(config.sinkwatch), "input": list(batch["input"].shape)}))
        return 0
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device (torchtitan's Trainer falls back to CUDA)")
        return 1

    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.observability import structured_logger as sl

    FlexAttention._compiled_flex_attn = torch.compile(flex_attention)  # no max_autotune: minutes of autotuning
    sl.init_structured_logger(source="training", output_dir=config.dump_folder, enable=config.debug.enable_structured_logging)
    t0 = time.monotonic()
    trainer = config.build()
    logged: list = []
    try:
        if not isinstance(trainer, SinkWatchTrainer):
            print(f"FAIL: config.build() made a {type(trainer).__qualname__}")
            return 1
        log = trainer.metrics_processor.logger.log

        def spy(metrics, step, *a, **kw):  # the real logger still logs; which steps carried sinkwatch's scalars
            if any(str(k).startswith("sinkwatch/") for k in metrics):
                logged.append(step)
            return log(metrics, step, *a, **kw)

        trainer.metrics_processor.logger.log = spy
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    summary = check(args.out, logged)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(summary))
    print("FAIL: " + "; ".join(summary["problems"]) if summary["problems"] else "torchtitan Trainer with sinkwatch: ok")
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
