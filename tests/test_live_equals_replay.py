"""docs/design.md §1, proved on the real paths: the live record at step N equals the record ``sinkwatch replay``
computes on the checkpoint saved at step N. Each framework trains with the callback at
its DEFAULTS (induction, repeated-random and natural probes, the natural windows frozen from the first
training batch; only the probe interval is set), saves checkpoints its own way, and the replay CLI
reads the folder of checkpoints as a run (``sinkwatch replay DIR``):

- Lightning: ``.ckpt`` files written by ``ModelCheckpoint`` (``--lightning-module``), and
  ``save_pretrained`` folders with the step in their name (``--live-store``: the callback's store);
- HF Trainer: its ``checkpoint-N/`` folders (tokens and natural windows from ``trainer_state.json``);
- OLMo-core: its ``stepN/`` checkpoints, through OLMo-core's own converter (test at the end).

The replay rebuilds the live probe sets from the callback state (their hashes checked). Every key
both records share agrees: exactly for transformers models (the same weights through the same code),
within float32 rounding for OLMo-core (its model vs the converted transformers model)."""

import math
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny_models import build
from train_helpers import LitTiny, loader, trainer
from transformers import Trainer, TrainingArguments

from sinkwatch.cli import main
from sinkwatch.hf import SinkWatchTrainerCallback
from sinkwatch.lightning import SinkWatchCallback
from sinkwatch.replay import record_files
from sinkwatch.reporting.jsonl import read_jsonl

EVERY, STEPS, BATCH, LENGTH = 5, 10, 8, 64  # loader(): 8 rows of 64 tokens per step
LIVE_ONLY = {"probe_seconds", "config_hash", "tracker_since_step"}
# what only a replay record says about itself (provenance, the store), and what names the weights' source
REPLAY_ONLY_OR_NAMES = {"model", "revision", "path"}


class SaveAtProbeSteps(pl.Callback):
    """At each probe step: ``save_pretrained`` of the inner model into stepN/, and at step 0 a Lightning
    checkpoint too (``ModelCheckpoint`` writes the later ones). Runs after the sinkwatch callback, whose
    step-0 probe (at the first batch's start) froze the natural windows."""

    def __init__(self, root: Path, ckpt_dir: Path):
        self.root, self.ckpt_dir, self.saved = root, ckpt_dir, set()

    def _save(self, pl_module, step: int) -> None:
        if step % EVERY == 0 and step not in self.saved:
            self.saved.add(step)
            pl_module.model.save_pretrained(self.root / f"step{step}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0 and 0 not in self.saved:
            trainer.save_checkpoint(self.ckpt_dir / "epoch=0-step=0.ckpt")
            self._save(pl_module, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._save(pl_module, trainer.global_step)


def _replay(target: Path, out: Path, *extra: str) -> list[dict]:
    argv = ["replay", str(target), "--out", str(out), "--wandb", "disabled", "--no-progress", *extra]
    assert main(argv) == 0
    return [r for p in record_files(out) for r in read_jsonl(p)]  # each replay worker writes its own records file


def _assert_equal(live: list[dict], replayed: list[dict], steps: list[int], close=None) -> None:
    live = [r for r in live if r["step"] in steps]
    assert [r["step"] for r in live] == [r["step"] for r in replayed] == steps
    assert all(r["duplicate_of"] is None and r["weights_fingerprint"] for r in replayed)  # each checkpoint its own weights
    assert {"natural", "induction", "repeated"} == set(live[0]["probe_hashes"])  # the callback's default probe sets
    for a, b in zip(live, replayed):
        assert a["probe_hashes"] == b["probe_hashes"] and a["probe_hash"] == b["probe_hash"]
        shared = sorted((set(a) & set(b)) - LIVE_ONLY - REPLAY_ONLY_OR_NAMES)
        numeric = [k for k in shared if _numeric(a[k])]
        assert {"sink_rate", "selectivity", "pr", "induction_score", "icl_score", "p0_norm_ratio", "tokens"} <= set(numeric)
        for key in shared:
            tolerant = close is not None and key in numeric and key not in ("step", "tokens")
            same = close(a[key], b[key]) if tolerant else _same(a[key], b[key])
            assert same, f"step {a['step']}: {key}: live {a[key]!r} != replay {b[key]!r}"
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


def _plan(target: Path, out: Path, capsys, *extra: str) -> str:
    """``sinkwatch replay DIR --plan`` of a replayed folder: every checkpoint done, nothing to fetch."""
    capsys.readouterr()
    assert main(["replay", str(target), "--out", str(out), "--plan", *extra]) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "to measure: 0 revision(s), 0 to download (0 B)" in text, text
    return text


def test_lightning_live_records_equal_replay_of_its_checkpoints(tmp_path, capsys):
    pl.seed_everything(0)
    saves = SaveAtProbeSteps(tmp_path / "pretrained", tmp_path / "ckpt")
    cb = SinkWatchCallback(every_n_steps=EVERY, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=EVERY, save_top_k=-1, filename="{epoch}-{step}")
    trainer(tmp_path, [cb, saves, ckpt], max_steps=STEPS, enable_checkpointing=True).fit(LitTiny("llama"), loader(batch_size=BATCH))
    live = read_jsonl(tmp_path / "sw" / "records.jsonl")
    steps = list(range(0, STEPS + 1, EVERY))
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")) == [f"epoch=0-step={s}.ckpt" for s in (0, 10, 5)]
    # .ckpt files: step and tokens from the checkpoint, the probe sets and natural windows from the callback state
    ckpts = _replay(tmp_path / "ckpt", tmp_path / "replay-ckpt", "--lightning-module", "train_helpers:LitTiny")
    _assert_equal(live, ckpts, steps)
    # the plan of the same command (--lightning-module given: it was refused as if missing); no config.json to size from
    plan = _plan(tmp_path / "ckpt", tmp_path / "replay-ckpt", capsys, "--lightning-module", "train_helpers:LitTiny")
    assert "3 done already in the store" in plan and "memory: not estimated" in plan
    # save_pretrained folders with the step in the name: tokens per step given, the probe sets from the live store
    live_store = ("--live-store", str(tmp_path / "sw"), "--tokens-per-step", str(BATCH * LENGTH))
    folders = _replay(tmp_path / "pretrained", tmp_path / "replay-pretrained", *live_store)
    _assert_equal(live, folders, steps)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_hf_live_records_equal_replay_of_its_checkpoints(tmp_path):
    from train_helpers import CopyDataset

    model = build("gpt_neox")
    model.save_pretrained(tmp_path / "out" / "checkpoint-0")  # the initial weights the step-0 probe sees
    cb = SinkWatchTrainerCallback(every_n_steps=EVERY, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=3e-3, use_cpu=True,
        report_to=[], save_strategy="steps", save_steps=EVERY, logging_steps=1, seed=11, disable_tqdm=True,
        dataloader_num_workers=0, save_only_model=True,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=CopyDataset(), callbacks=[cb]).train()
    replayed = _replay(tmp_path / "out", tmp_path / "replay")  # checkpoint-N/: tokens counted by the callback, from trainer_state.json
    assert [r["revision"] for r in replayed] == ["checkpoint-0", "checkpoint-5", "checkpoint-10"]
    _assert_equal(read_jsonl(tmp_path / "sw" / "records.jsonl"), replayed, list(range(0, STEPS + 1, EVERY)))


# ---- OLMo-core: its own checkpoints, converted by its own converter --------------------------------------------
RTOL, ATOL = 1e-5, 1e-6  # OLMo-core's model vs the converted transformers model: float32 rounding, as tests/test_olmo_core.py


def _close(x, y) -> bool:
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_close(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_close(a, b) for a, b in zip(x, y))
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
        return bool(np.isclose(float(x), float(y), rtol=RTOL, atol=ATOL, equal_nan=True))
    return x == y


def test_olmo_core_live_records_equal_replay_of_its_checkpoints(tmp_path, capsys):
    pytest.importorskip("olmo_core")
    from olmo_core.train.callbacks import ConfigSaverCallback
    from olmo_core_helpers import build_trainer, model_config

    from sinkwatch.olmo_core import SinkWatchCallback as OLMoCoreCallback

    every, steps = 2, 4
    cb = OLMoCoreCallback(every_n_steps=every, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)
    trainer_ = build_trainer(tmp_path, {"sinkwatch": cb, "config_saver": ConfigSaverCallback()}, steps=steps, save_interval=every)
    trainer_.callbacks["config_saver"].config = {"model": model_config().as_config_dict()}  # what OLMo-core's own scripts save
    trainer_.fit()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step")) == ["step0", "step2", "step4"]
    replayed = _replay(tmp_path / "ckpt", tmp_path / "replay")
    assert [r["revision"] for r in replayed] == ["step0", "step2", "step4"]
    _assert_equal(read_jsonl(tmp_path / "sw" / "records.jsonl"), replayed, [0, 2, 4], close=_close)
    # the plan of the same folder: OLMo-core's config.json is its experiment config, not a transformers one
    assert "3 done already in the store" in _plan(tmp_path / "ckpt", tmp_path / "replay", capsys)
