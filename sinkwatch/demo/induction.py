"""``sinkwatch demo``: pretrain a small byte-level decoder on the Python standard library's own source,
on a laptop CPU, with the Lightning callback attached, and end with a report.

Data: random 128-byte windows of every ``*.py`` file of the running Python's standard library (text
every machine has). Half of the windows repeat a stretch of themselves — a period of 8–63 bytes
tiled over the window, the way code repeats a name — which is what lets an induction circuit form
within a CPU-sized budget; the other half are plain text. The model and data are tuned for that;
the detector is not: the tracker runs with sinkwatch's default thresholds.
"""

from __future__ import annotations

import glob
import os
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

DEMO_CONTEXT = 128
PRINTABLE = (32, 127)  # probe ids: printable ASCII, what a byte-level model trained on code has seen


def stdlib_sources() -> list[str]:
    """The standard library's top-level ``*.py`` files, sorted: the text both demos train on."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise FileNotFoundError(f"no Python source found under {root}; the demos train on the standard library's source")
    return files


def stdlib_bytes(limit: int | None = None) -> np.ndarray:
    """The UTF-8 bytes of the standard library's top-level ``*.py`` files, concatenated (int64)."""
    chunks, total = [], 0
    for f in stdlib_sources():
        data = Path(f).read_bytes()
        chunks.append(data)
        total += len(data)
        if limit and total >= limit:
            break
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.int64)


class DemoWindows(torch.utils.data.Dataset):
    """Window i is drawn with RandomState((seed, i)): the data is the same whatever the order or resume."""

    def __init__(self, corpus: np.ndarray, n: int, seq_len: int = DEMO_CONTEXT, seed: int = 0, periodic: float = 0.5):
        self.corpus, self.n, self.T, self.seed, self.periodic = corpus, n, seq_len, seed, periodic

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        rng = np.random.RandomState([self.seed, i])
        start = rng.randint(0, len(self.corpus) - self.T - 1)
        w = self.corpus[start : start + self.T].copy()
        if rng.rand() < self.periodic:
            period = rng.randint(8, 64)
            w = np.tile(w[:period], self.T // period + 1)[: self.T]
        return torch.from_numpy(w)


def add_pretrain_arguments(ap) -> None:
    """Flags shared by the pretraining recipes (recipes/*.py): tiny CPU defaults, real sizes by flag."""
    ap.add_argument("--text", default=None, help="a UTF-8 text file (default: the standard library's source, byte-level)")
    ap.add_argument("--tokenizer", default="EleutherAI/pythia-160m", help="with --text")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=DEMO_CONTEXT)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=2e-3)
    # auto: the callback's rule (the trainer's run, else offline or as WANDB_MODE says)
    ap.add_argument("--wandb", default="auto", choices=("auto", "offline", "online", "disabled"))


def pretrain_corpus(text: str | None, tokenizer: str) -> tuple[np.ndarray, int, tuple[int, int] | None]:
    """(token ids, vocabulary size, probe id range): the standard library's bytes (printable-ASCII
    probes) by default, else ``text`` through ``tokenizer`` (the paper's probe range)."""
    if text is None:
        return stdlib_bytes(), 256, PRINTABLE
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids = tok(Path(text).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    return np.asarray(ids, dtype=np.int64), len(tok), None


def build_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=DEMO_CONTEXT,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def run_demo(
    *,
    steps: int = 2000,
    out: str = "sinkwatch-demo",
    seed: int = 0,
    wandb: str | None = None,  # None: as WANDB_MODE says, else offline
    device: str = "cpu",
    every: int = 100,
    batch_size: int = 16,
    lr: float = 2e-3,
    threads: int | None = None,
) -> dict:
    """Train, watch, report. Returns a summary (paths, time, stages, events)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import TQDMProgressBar
    from tqdm.auto import tqdm

    from ..adapters.lightning import SinkWatchCallback
    from ..probes import default_probes
    from ..report import build_report
    from ..reporters.console import ConsoleReporter
    from ..reporters.wandb_run import wandb_mode_from_env

    t0 = time.perf_counter()
    wandb = wandb_mode_from_env(wandb)
    os.environ.setdefault("WANDB_SILENT", "true")  # the demo's own output: progress bar, events, summary
    if threads:
        torch.set_num_threads(threads)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)  # an earlier demo's records move to out/earlier-runs/ (one store per run)
    pl.seed_everything(seed, verbose=False)
    corpus = stdlib_bytes()
    model = build_model(seed)
    model.config._name_or_path = "sinkwatch-demo (byte-level Llama, 3 x 128)"  # the name records carry

    class DemoLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log("loss", loss, prog_bar=True, on_step=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    events: list[dict] = []
    probes = default_probes(DEMO_CONTEXT, vocab_range=PRINTABLE, natural=corpus)  # the live defaults, natural windows of its text
    watch = SinkWatchCallback(
        every_n_steps=every,
        out_dir=str(out_dir),
        probes=probes,
        wandb="disabled" if wandb == "disabled" else "auto",
        console=False,
        reporters=[ConsoleReporter(write=tqdm.write)],
        on_event=events.append,
    )

    class StageBar(TQDMProgressBar):
        """Loss, tokens and the tracked stages beside the step counter."""

        def get_metrics(self, trainer, pl_module):
            m = super().get_metrics(trainer, pl_module)
            m.pop("v_num", None)
            live = watch.live
            m["tokens"] = f"{live.tokens_seen / 1e6:.2f}M"
            if live.n_probes:
                m["P0"] = live.tracker.p0_stage
                m["induction"] = live.tracker.induction_state
            return m

    logger = False
    if wandb != "disabled":
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(project="sinkwatch-demo", save_dir=str(out_dir), offline=wandb == "offline", log_model=False)
    trainer = pl.Trainer(
        accelerator="gpu" if device.startswith("cuda") else "cpu",
        devices=1,
        max_steps=steps,
        logger=logger,
        callbacks=[watch, StageBar(refresh_rate=10)],
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=10,
        default_root_dir=str(out_dir),
    )
    data = torch.utils.data.DataLoader(
        DemoWindows(corpus, steps * batch_size + batch_size, seed=seed), batch_size=batch_size, shuffle=False
    )
    trainer.fit(DemoLM(), data)
    train_s = time.perf_counter() - t0
    if logger:
        import wandb as _wandb

        _wandb.finish()
    report = build_report([out_dir])
    total_s = time.perf_counter() - t0
    tracker = watch.live.tracker
    return {
        "out": str(out_dir),
        "records": str(out_dir / "records.jsonl"),
        "report": str(report),
        "seconds": total_s,
        "train_seconds": train_s,
        "steps": steps,
        "p0_stage": tracker.p0_stage,
        "induction_state": tracker.induction_state,
        "events": events,
    }
