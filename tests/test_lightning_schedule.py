"""Lightning: the last probe rides in the last checkpoint, and log-spaced probes under max_epochs
, in real ``Trainer.fit`` runs with ``ModelCheckpoint(save_last=True)``.

Lightning runs checkpoint callbacks last in every hook, and ``ModelCheckpoint`` saves in
``on_train_batch_end`` (``every_n_train_steps``), ``on_train_epoch_end`` or ``on_validation_end``,
all before ``on_train_end``; so a probe of the last step must happen in the batch-end hook, or, when
the stop is decided in the hook that saves (``EarlyStopping``), while the checkpoint is written.
"""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from tiny_models import build
from torch.utils.data import DataLoader, IterableDataset
from train_helpers import CopyDataset, LitLM, loader, trainer

from sinkwatch import InductionProbe
from sinkwatch.lightning import SinkWatchCallback
from sinkwatch.reporting.jsonl import read_jsonl

PROBES = [InductionProbe(n=4, seq_len=64)]


def callback(out, **kw) -> SinkWatchCallback:
    return SinkWatchCallback(out_dir=str(out), probes=PROBES, wandb="disabled", console=False, **kw)


def saved_last_step(path) -> int | None:
    """The sinkwatch state's last probed step inside a Lightning checkpoint file."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("SinkWatchCallback")]
    return state["last_probed_step"]


def steps(path) -> list[int]:
    return [r["step"] for r in read_jsonl(path)]


def test_last_probe_is_in_last_ckpt_and_a_resume_neither_loses_nor_repeats_it(tmp_path):
    """every_n_steps=4, max_steps=10: the step-10 probe is taken before last.ckpt is written at
    step 10, so resuming last.ckpt to 12 gives [0, 4, 8, 10, 12] (it gave [0, 4, 8, 12])."""
    out, ckpt_dir = tmp_path / "sw", tmp_path / "a" / "ckpt"

    def fit(run: str, max_steps: int, ckpt_path=None):
        callbacks = [callback(out, every_n_steps=4), ModelCheckpoint(dirpath=tmp_path / run / "ckpt", save_last=True)]
        trainer(tmp_path / run, callbacks, max_steps=max_steps, enable_checkpointing=True).fit(
            LitLM(build("llama")), loader(batch_size=2), ckpt_path=ckpt_path
        )

    fit("a", 10)
    assert steps(out / "records.jsonl") == [0, 4, 8, 10]
    assert saved_last_step(ckpt_dir / "last.ckpt") == 10
    fit("b", 12, ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert steps(out / "records.jsonl") == [0, 4, 8, 10, 12]
    assert not (out / "records.superseded.jsonl").exists()  # nothing rolled back: nothing lost, nothing repeated


def test_log_spaced_under_max_epochs_and_the_last_epoch_probe_in_last_ckpt(tmp_path):
    """max_epochs=2 x 5 batches, log_spaced=4: probes [0, 1, 2, 5, 10] (geomspace(1, 10, 4) over
    Lightning's own estimate of the run's steps; it gave [0, 10]), and last.ckpt, written at the
    last epoch's end, holds the step-10 probe."""
    out, ckpt_dir = tmp_path / "sw", tmp_path / "ckpt"
    cb = callback(out, every_n_steps=None, log_spaced=4)
    trainer(tmp_path, [cb, ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], max_steps=-1, max_epochs=2, limit_train_batches=5,
            enable_checkpointing=True).fit(LitLM(build("llama")), loader(batch_size=2))  # fmt: skip
    assert steps(out / "records.jsonl") == [0, 1, 2, 5, 10]
    assert saved_last_step(ckpt_dir / "last.ckpt") == 10


class ValLM(LitLM):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)


def test_early_stopping_step_is_probed_before_its_checkpoint(tmp_path):
    """EarlyStopping decides at the end of epoch 0 (step 3) in the hook where ModelCheckpoint then
    saves: the step-3 probe is taken while that checkpoint is written, and is in it."""
    out, ckpt_dir = tmp_path / "sw", tmp_path / "ckpt"
    stop = EarlyStopping(monitor="val_loss", stopping_threshold=1e9)  # any finite loss stops the run at the first check
    trainer(tmp_path, [callback(out, every_n_steps=100), stop, ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], max_steps=-1,
            max_epochs=5, limit_train_batches=3, limit_val_batches=1, num_sanity_val_steps=0, enable_checkpointing=True,
            ).fit(ValLM(build("llama")), loader(batch_size=2), loader(batch_size=2))  # fmt: skip
    assert steps(out / "records.jsonl") == [0, 3]
    assert saved_last_step(ckpt_dir / "last.ckpt") == 3


class Stream(IterableDataset):
    """A stream with no length: Lightning cannot know how many steps an epoch takes."""

    def __iter__(self):
        data = CopyDataset(n=10)
        return (data[i] for i in range(len(data)))


def test_log_spaced_warns_when_the_run_length_is_unknown(tmp_path):
    out = tmp_path / "sw"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback(out, every_n_steps=None, log_spaced=4)], max_steps=-1, max_epochs=1).fit(
            LitLM(build("llama")), DataLoader(Stream(), batch_size=2)
        )
    notes = [str(w.message) for w in caught if "log_spaced=4" in str(w.message)]
    assert len(notes) == 1 and "max_steps" in notes[0], notes
    assert steps(out / "records.jsonl") == [0, 5]  # the start and the end still probe
