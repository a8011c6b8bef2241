"""SinkWatchTrainerCallback in real transformers.Trainer.train runs on CPU (docs/design.md §7)."""

import json

import planted
import pytest
import torch
from tiny_models import build
from train_helpers import CopyDataset
from transformers import Trainer, TrainingArguments

from sinkwatch import InductionProbe, RepeatedRandomProbe
from sinkwatch.hf import SinkWatchTrainerCallback
from sinkwatch.reporting.jsonl import read_jsonl

SMALL = [InductionProbe(n=16, seq_len=64), RepeatedRandomProbe(n=8, seq_len=32)]


def args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"), max_steps=20, per_device_train_batch_size=8, learning_rate=3e-3, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, seed=11, disable_tqdm=True, dataloader_num_workers=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def test_train_reuses_the_wandb_callback_run(tmp_path):
    """The HF callback logs records and reuses the WandbCallback's run instead of starting one."""
    cb = SinkWatchTrainerCallback(every_n_steps=10, out_dir=str(tmp_path / "sw"), console=False)
    t = Trainer(
        model=build("gpt_neox"), args=args(tmp_path, report_to=["wandb"], run_name="hf-test"), train_dataset=CopyDataset(), callbacks=[cb]
    )
    import os

    os.environ["WANDB_DIR"] = str(tmp_path)
    t.train()
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 10, 20]
    assert [r["tokens"] for r in records] == [0, 10 * 8 * 64, 20 * 8 * 64]
    assert records[0]["probe"] == "natural+induction+repeated"
    reporter = cb.live.wandb_reporter
    assert reporter._owns_run is False  # the WandbCallback's run, not a second one
    summary = reporter.final_summary
    for key in ("sinkwatch/sink_rate", "sinkwatch/icl_score", "sinkwatch/step", "sinkwatch/by_tokens/n_induction_ge50", "train/loss"):
        assert key in summary, key
    import wandb

    wandb.finish()


def test_a_transition_gives_exactly_one_alert(tmp_path):
    """A planted stage transition gives exactly one event and one W&B alert."""
    cb = SinkWatchTrainerCallback(
        every_n_steps=5, out_dir=str(tmp_path / "sw"), probes=[InductionProbe(n=8, seq_len=64)], wandb="offline", console=False
    )
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 64, (128, 32))]
    Trainer(model=planted.p0_final(), args=args(tmp_path, learning_rate=0.0, max_steps=15), train_dataset=data, callbacks=[cb]).train()
    events = read_jsonl(tmp_path / "sw" / "events.jsonl")
    assert [(e["previous"], e["stage"]) for e in events] == [("none", "final")]
    assert len(cb.live.wandb_reporter.alerts) == 1


def losses_and_params(tmp_path, with_cb):
    model = build("llama", seed=3)
    cbs = (
        [SinkWatchTrainerCallback(every_n_steps=4, out_dir=str(tmp_path / "sw"), probes=SMALL, wandb="offline", console=False)]
        if with_cb
        else []
    )
    t = Trainer(model=model, args=args(tmp_path, max_steps=12), train_dataset=CopyDataset(), callbacks=cbs)
    t.train()
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_monitor_is_invisible_to_training(tmp_path):
    """Losses and final parameters are bit-identical with and without the callback."""
    la, pa = losses_and_params(tmp_path / "a", False)
    lb, pb = losses_and_params(tmp_path / "b", True)
    assert la == lb and len(la) == 12
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
    assert [r["step"] for r in read_jsonl(tmp_path / "b" / "sw" / "records.jsonl")] == [0, 4, 8, 12]


def test_gradient_accumulation_one_probe_per_optimizer_step(tmp_path):
    """With gradient accumulation the callback probes once per optimizer step."""
    cb = SinkWatchTrainerCallback(every_n_steps=2, out_dir=str(tmp_path / "sw"), probes=SMALL, wandb="disabled", console=False)
    Trainer(
        model=build("qwen3"),
        args=args(tmp_path, max_steps=6, per_device_train_batch_size=2, gradient_accumulation_steps=4),
        train_dataset=CopyDataset(),
        callbacks=[cb],
    ).train()
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4, 6]
    assert records[1]["tokens"] == 2 * 2 * 4 * 64


@pytest.mark.parametrize("restore_flag", [False, True])
def test_resume_from_checkpoint(tmp_path, restore_flag):
    """Resuming from a checkpoint restores the callback state and continues the records without duplicates."""
    out = tmp_path / "sw"
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 64, (512, 32))]
    kw = dict(out_dir=str(out), every_n_steps=5, probes=[InductionProbe(n=8, seq_len=64)], wandb="disabled", console=False)
    a = args(
        tmp_path,
        learning_rate=0.0,
        max_steps=20,
        save_strategy="steps",
        save_steps=10,
        restore_callback_states_from_checkpoint=restore_flag,
    )
    Trainer(model=planted.p0_final(), args=a, train_dataset=data, callbacks=[SinkWatchTrainerCallback(**kw)]).train()
    assert [r["step"] for r in read_jsonl(out / "records.jsonl")] == [0, 5, 10, 15, 20]
    state = json.loads((tmp_path / "out" / "checkpoint-10" / "trainer_state.json").read_text())
    saved = state["stateful_callbacks"]["SinkWatchTrainerCallback"]["attributes"]["sinkwatch_state"]
    assert saved["last_probed_step"] == 10 and saved["tracker"]["declared"]["p0"] == "final"

    a2 = args(tmp_path, learning_rate=0.0, max_steps=30, save_strategy="no", restore_callback_states_from_checkpoint=restore_flag)
    t2 = Trainer(model=planted.p0_final(), args=a2, train_dataset=data, callbacks=[SinkWatchTrainerCallback(**kw)])
    t2.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-10"))
    records = read_jsonl(out / "records.jsonl")
    assert [r["step"] for r in records] == [0, 5, 10, 15, 20, 25, 30]
    assert len({r["probe_hash"] for r in records}) == 1
    assert len(read_jsonl(out / "events.jsonl")) == 1
    assert [r["step"] for r in read_jsonl(out / "records.superseded.jsonl")] == [15, 20]


def test_resume_from_a_checkpoint_saved_before_the_first_probe(tmp_path):
    """A checkpoint older than the first probe still carries the token count: the resumed run's record
    counts every step's tokens, and the preempted run's later record is superseded, not repeated."""
    out = tmp_path / "sw"
    kw = dict(out_dir=str(out), every_n_steps=4, probe_at_start=False, probes=SMALL, wandb="disabled", console=False)

    def run(resume=None):
        a = args(tmp_path, max_steps=4, per_device_train_batch_size=2, save_strategy="steps", save_steps=2)
        Trainer(model=build("llama", seed=3), args=a, train_dataset=CopyDataset(), callbacks=[SinkWatchTrainerCallback(**kw)]).train(
            resume_from_checkpoint=resume
        )

    run()  # stands for a run preempted after its step-4 probe; checkpoint-2 predates every probe
    assert [(r["step"], r["tokens"]) for r in read_jsonl(out / "records.jsonl")] == [(4, 4 * 2 * 64)]
    run(resume=str(tmp_path / "out" / "checkpoint-2"))
    assert [(r["step"], r["tokens"]) for r in read_jsonl(out / "records.jsonl")] == [(4, 4 * 2 * 64)]
    assert [r["step"] for r in read_jsonl(out / "records.superseded.jsonl")] == [4]


def test_resume_with_changed_probes_restored_by_transformers_starts_a_new_segment(tmp_path):
    """restore_callback_states_from_checkpoint rebuilds the callback from JSON: the resumed run still uses the
    callback the user built (new probes), keeps the earlier records and marks a new config_hash segment."""
    out = tmp_path / "sw"
    common = dict(out_dir=str(out), every_n_steps=2, wandb="disabled", console=False)

    def run(probes, resume=None):
        a = args(tmp_path, max_steps=4, per_device_train_batch_size=2, save_strategy="steps", save_steps=2)
        a.restore_callback_states_from_checkpoint = True
        cb = SinkWatchTrainerCallback(probes=probes, **common)
        Trainer(model=build("llama", seed=3), args=a, train_dataset=CopyDataset(), callbacks=[cb]).train(resume_from_checkpoint=resume)

    run([InductionProbe(n=8, seq_len=64)])
    first = read_jsonl(out / "records.jsonl")
    with pytest.warns(RuntimeWarning, match="new segment at step 2"):
        run([InductionProbe(n=12, seq_len=64)], resume=str(tmp_path / "out" / "checkpoint-2"))
    records = read_jsonl(out / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4] and records[:2] == first[:2]
    assert records[0]["config_hash"] == records[1]["config_hash"] != records[2]["config_hash"]
    assert [r["tracker_since_step"] for r in records] == [0, 0, 2]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch_compile"])
def test_the_deferred_step0_probe_is_invisible_to_training(tmp_path, compiled):
    """With the default probes the step-0 probe runs in the first training forward's pre-hook (before any
    backward; gradients then accumulate over two micro-batches): losses and weights stay bit-identical, also
    under the Trainer's torch_compile, whose compiled call runs the model's hooks (Dynamo never traces it)."""

    compile_args = {"torch_compile": True, "torch_compile_backend": "eager"} if compiled else {}

    def run(sub, cbs):
        model = build("llama", seed=3)
        a = args(tmp_path / sub, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2, **compile_args)
        t = Trainer(model=model, args=a, train_dataset=CopyDataset(), callbacks=cbs)
        t.train()
        return [h["loss"] for h in t.state.log_history if "loss" in h], {n: p.detach().clone() for n, p in model.named_parameters()}

    cb = SinkWatchTrainerCallback(every_n_steps=2, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)
    la, pa = run("a", [])
    lb, pb = run("b", [cb])
    assert la == lb and len(la) == 3
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [(r["step"], r["probe"]) for r in records] == [(s, "natural+induction+repeated") for s in (0, 2, 3)]
    assert cb._hook is None  # the batch pre-hook is removed at train end
