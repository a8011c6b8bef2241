"""Resuming with changed stage thresholds or probes never stops the run: one
warning, every earlier record kept, a new tracker segment from the resumed step, and every record
marked with the configuration that made it (``config_hash``)."""

import warnings

import planted
import torch
from test_lightning import PlantedLit
from train_helpers import trainer

from sinkwatch import InductionProbe, StageConfig
from sinkwatch.lightning import SinkWatchCallback
from sinkwatch.reporting.jsonl import read_jsonl

BEFORE = dict(probes=[InductionProbe(n=8, seq_len=64)])
# recalibrated thresholds (docs/stages.md) and a larger probe, as one resume
AFTER = dict(probes=[InductionProbe(n=12, seq_len=64)], stages=StageConfig(patience=3, circuit_min_norm_ratio=4.0))


def test_resume_with_changed_thresholds_and_probes_starts_a_new_segment(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = tmp_path / "sw"
    data = torch.utils.data.DataLoader([{"input_ids": t, "labels": t} for t in torch.randint(0, 64, (256, 32))], batch_size=4)
    common = dict(every_n_steps=5, out_dir=str(out), wandb="disabled", console=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
    trainer(tmp_path, [SinkWatchCallback(**common, **BEFORE), ckpt], max_steps=10, enable_checkpointing=True).fit(
        PlantedLit(planted.p0_final()), data
    )
    first = read_jsonl(out / "records.jsonl")
    assert [r["step"] for r in first] == [0, 5, 10]
    assert [e["step"] for e in read_jsonl(out / "events.jsonl")] == [5]  # none -> final under the first configuration

    cb = SinkWatchCallback(**common, **AFTER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [cb], max_steps=25).fit(
            PlantedLit(planted.p0_final()), data, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=10.ckpt")
        )
    records = read_jsonl(out / "records.jsonl")
    assert [r["step"] for r in records] == [0, 5, 10, 15, 20, 25]  # the run went on
    assert records[:3] == first  # every earlier record kept as written
    old_hash, new_hash = records[0]["config_hash"], records[-1]["config_hash"]
    assert old_hash and new_hash and old_hash != new_hash
    assert {r["config_hash"] for r in records[:3]} == {old_hash} and {r["config_hash"] for r in records[3:]} == {new_hash}
    assert [r["tracker_since_step"] for r in records] == [0, 0, 0, 10, 10, 10]
    notes = [str(w.message) for w in caught if "new segment" in str(w.message)]
    assert len(notes) == 1 and "step 10" in notes[0] and "probes" in notes[0] and "thresholds" in notes[0], notes
    # the new segment's tracker starts from none and declares under the new rules (patience 3: at step 25)
    events = read_jsonl(out / "events.jsonl")
    assert [e["step"] for e in events] == [5, 25]
    assert records[3]["p0_stage"] == "none" and records[-1]["p0_stage"] == "final"
