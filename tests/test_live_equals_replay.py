"""SPEC §1, proved on the real paths: the live record at step N equals the record ``sinkwatch replay``
computes on the checkpoint saved at step N (issue 11). A Lightning run and an HF Trainer run each
train with the callback and save checkpoints at the probe steps; the checkpoints become revisions
of a local Hugging Face cache (``models--org--name/refs/<rev>`` + ``snapshots/<id>/``), and the
replay CLI probes them with the same probe set. Every numeric key and every stage must agree."""

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
from tiny_models import build
from train_helpers import LitLM, loader, trainer
from trajectory import hf_cache_from_checkpoints
from transformers import Trainer, TrainingArguments

from sinkwatch import InductionProbe, RepeatedRandomProbe
from sinkwatch.cli import main
from sinkwatch.hf import SinkWatchTrainerCallback
from sinkwatch.lightning import SinkWatchCallback
from sinkwatch.replay import record_files
from sinkwatch.reporting.jsonl import read_jsonl

N, SEQ = 16, 64
PROBES = [InductionProbe(n=N, seq_len=SEQ), RepeatedRandomProbe(n=N, seq_len=SEQ)]
EVERY, STEPS, BATCH, LENGTH = 5, 10, 8, 64  # loader(): 8 rows of 64 tokens per step
LIVE_ONLY = {"probe_seconds", "config_hash", "tracker_since_step"}


class SaveAtProbeSteps(pl.Callback):
    """save_pretrained of the inner model at step 0 and every EVERY steps: the weights each probe saw."""

    def __init__(self, root: Path):
        self.root, self.saved = root, set()

    def _save(self, pl_module, step: int) -> None:
        if step % EVERY == 0 and step not in self.saved:
            self.saved.add(step)
            pl_module.model.save_pretrained(self.root / f"step{step}")

    def on_train_start(self, trainer, pl_module):
        self._save(pl_module, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._save(pl_module, trainer.global_step)


def _replay(checkpoints: dict, tmp_path: Path, repo: str) -> list[dict]:
    cache = tmp_path / "hf_cache"
    hf_cache_from_checkpoints(checkpoints, cache, repo=repo)
    out = tmp_path / "replay"
    argv = ["replay", repo, "--revisions", ",".join(checkpoints), "--out", str(out), "--cache-dir", str(cache)]
    argv += ["--probe", "induction,repeated", "--n", str(N), "--seq-len", str(SEQ), "--batch-tokens", "16384"]
    argv += ["--tokens-per-step", str(BATCH * LENGTH), "--wandb", "disabled", "--no-progress"]
    assert main(argv) == 0
    return [r for p in record_files(out) for r in read_jsonl(p)]  # each replay worker writes its own records file


def _assert_equal(live: list[dict], replayed: list[dict]) -> None:
    assert [r["step"] for r in live] == [r["step"] for r in replayed] == list(range(0, STEPS + 1, EVERY))
    for a, b in zip(live, replayed):
        assert a["probe_hash"] == b["probe_hash"]
        shared = sorted((set(a) & set(b)) - LIVE_ONLY - {"model", "revision"})
        numeric = [k for k in shared if _numeric(a[k])]
        assert {"sink_rate", "selectivity", "pr", "induction_score", "icl_score", "p0_norm_ratio", "tokens"} <= set(numeric)
        for key in shared:
            assert _same(a[key], b[key]), f"step {a['step']}: {key}: live {a[key]!r} != replay {b[key]!r}"
        for key in ("p0_stage", "induction_state", "p0_stage_now", "induction_state_now"):
            assert a[key] == b[key], key


def _numeric(x) -> bool:
    if isinstance(x, dict):
        return any(_numeric(v) for v in x.values())
    if isinstance(x, list):
        return any(_numeric(v) for v in x)
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _same(x, y) -> bool:
    """Equal, with NaN equal to NaN (nulls in JSON)."""
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return x == y


def test_lightning_live_records_equal_replay_of_its_checkpoints(tmp_path):
    pl.seed_everything(0)
    saves = SaveAtProbeSteps(tmp_path / "ckpt")
    cb = SinkWatchCallback(every_n_steps=EVERY, probes=PROBES, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)
    trainer(tmp_path, [cb, saves], max_steps=STEPS).fit(LitLM(build("llama")), loader(batch_size=BATCH))
    checkpoints = {f"step{s}": tmp_path / "ckpt" / f"step{s}" for s in sorted(saves.saved)}
    _assert_equal(read_jsonl(tmp_path / "sw" / "records.jsonl"), _replay(checkpoints, tmp_path, "sinkwatch-test/live-lightning"))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_hf_live_records_equal_replay_of_its_checkpoints(tmp_path):
    from train_helpers import CopyDataset

    model = build("gpt_neox")
    model.save_pretrained(tmp_path / "out" / "checkpoint-0")  # the initial weights the step-0 probe sees
    cb = SinkWatchTrainerCallback(every_n_steps=EVERY, probes=PROBES, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=3e-3, use_cpu=True,
        report_to=[], save_strategy="steps", save_steps=EVERY, logging_steps=1, seed=11, disable_tqdm=True,
        dataloader_num_workers=0, save_only_model=True,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=CopyDataset(), callbacks=[cb]).train()
    checkpoints = {f"step{s}": tmp_path / "out" / f"checkpoint-{s}" for s in range(0, STEPS + 1, EVERY)}
    _assert_equal(read_jsonl(tmp_path / "sw" / "records.jsonl"), _replay(checkpoints, tmp_path, "sinkwatch-test/live-hf"))
