"""Two-process DDP (gloo, CPU) fit with SinkWatchCallback; run by tests/test_distributed.py.

    python tests/ddp_lightning.py OUT_DIR

Lightning's "ddp" strategy relaunches this script for rank 1. Rank 0 saves the final weights to
OUT_DIR/final so the test can probe them in a single process and compare.
"""

import faulthandler
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import lightning.pytorch as pl  # noqa: E402
import planted  # noqa: E402
import torch  # noqa: E402
from train_helpers import LitLM  # noqa: E402

from sinkwatch import InductionProbe, RepeatedRandomProbe  # noqa: E402
from sinkwatch.lightning import SinkWatchCallback  # noqa: E402
from sinkwatch.reporting.base import Reporter  # noqa: E402

PROBES = [InductionProbe(n=16, seq_len=64), RepeatedRandomProbe(n=8, seq_len=32)]


class SlowLit(LitLM):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def dataset() -> list[dict]:
    """256 random sequences of 32 tokens, the same on every rank (and in every launcher)."""
    tokens = torch.randint(0, 64, (256, 32), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": t, "labels": t} for t in tokens]


class RankFiles(Reporter):
    """A user reporter and ``on_event`` hook that append what they receive to OUT/hooks/<what>-rank<R>.jsonl,
    so the test sees which ranks called them."""

    def __init__(self, out: str):
        self.dir = os.path.join(out, "hooks")

    def _append(self, what: str, item: dict) -> None:
        import json

        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, f"{what}-rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": item.get("step")}) + "\n")

    def log_record(self, record: dict) -> None:
        self._append("reporter", record)

    def on_event(self, event: dict) -> None:
        self._append("on_event", event)


def user_hooks(out: str) -> dict:
    files = RankFiles(out)
    return {"on_event": files.on_event, "reporters": [files]}


def fit(out: str, make_lit, strategy, accelerator: str = "cpu") -> tuple[pl.Trainer, pl.LightningModule]:
    """Two CPU processes train ``make_lit()`` for 10 steps (batch 4 per rank) under ``strategy``,
    with the callback probing every 5 steps."""
    faulthandler.dump_traceback_later(300, exit=True)  # a hung collective fails with stacks, not a stalled CI
    torch.set_num_threads(1)
    pl.seed_everything(0)
    lit = make_lit()
    cb = SinkWatchCallback(
        every_n_steps=5, out_dir=os.path.join(out, "sw"), probes=PROBES, wandb="offline", console=False, **user_hooks(out)
    )
    trainer = pl.Trainer(
        accelerator=accelerator, devices=2, strategy=strategy, max_steps=10, callbacks=[cb], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )
    trainer.fit(lit, torch.utils.data.DataLoader(dataset(), batch_size=4))
    return trainer, lit


def main(out: str) -> None:
    trainer, lit = fit(out, lambda: SlowLit(planted.p0_final()), "ddp")
    if trainer.is_global_zero:
        lit.model.save_pretrained(os.path.join(out, "final"))


if __name__ == "__main__":
    main(sys.argv[1])
