"""SinkWatchCallback in real lightning.Trainer.fit runs on CPU (docs/design.md §7)."""

import sys
import warnings

import lightning.pytorch as pl
import planted
import pytest
import torch
from tiny_models import build
from train_helpers import LitLM, LitNanoGPT, loader, params_of, trainer

from sinkwatch import InductionProbe, ProbeSet, RepeatedRandomProbe, StageConfig, UnsupportedModelError
from sinkwatch.lightning import SinkWatchCallback
from sinkwatch.reporting.jsonl import read_jsonl

SMALL = [InductionProbe(n=16, seq_len=64), RepeatedRandomProbe(n=8, seq_len=32)]


def test_fit_records_keys_and_wandb_offline(tmp_path):
    """A Lightning fit writes records with every key and logs them to an offline W&B run."""
    pl.seed_everything(0)
    cb = SinkWatchCallback(every_n_steps=10, out_dir=str(tmp_path / "sw"), wandb="offline", console=False)
    lit = LitLM(build("llama"))
    trainer(tmp_path, [cb], max_steps=20).fit(lit, loader())
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 10, 20]
    assert [r["tokens"] for r in records] == [0, 10 * 8 * 64, 20 * 8 * 64]
    assert records[0]["probe"] == "natural+induction+repeated"  # default probes, natural frozen from batch 0
    for key in (
        "sink_rate",
        "sink_profile",
        "selectivity",
        "pr",
        "induction_score",
        "icl_score",
        "p0_stage",
        "induction_state",
        "p0_stage_now",
    ):
        assert key in records[-1], key
    assert len({r["probe_hash"] for r in records}) == 1
    reporter = cb.live.wandb_reporter
    summary = reporter.final_summary
    for key in (
        "sinkwatch/sink_rate",
        "sinkwatch/n_induction_ge50",
        "sinkwatch/icl_score",
        "sinkwatch/p0_stage",
        "sinkwatch/step",
        "sinkwatch/tokens",
        "sinkwatch/by_tokens/sink_rate",
        "sinkwatch/sink_profile/k0",
        "sinkwatch/p0_norm_ratio/L1",
    ):
        assert key in summary, key
    assert summary["sinkwatch/step"] == 20 and summary["sinkwatch/tokens"] == records[-1]["tokens"]
    assert summary["sinkwatch/sink_rate"] == pytest.approx(records[-1]["sink_rate"])
    run_dir = tmp_path / "sw" / "wandb" / "latest-run" / "files" / "media"
    assert list((run_dir / "images" / "sinkwatch" / "heatmap").glob("sink_alpha_*.png"))  # heatmaps reached the run
    assert list((run_dir / "table" / "sinkwatch").glob("head_classes_*.table.json"))

class PlantedLit(LitLM):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the planted circuit stays as built


def test_a_transition_gives_exactly_one_alert(tmp_path):
    """A planted stage transition gives exactly one event and one W&B alert."""
    lit = PlantedLit(planted.p0_final())
    cb = SinkWatchCallback(
        every_n_steps=5, out_dir=str(tmp_path / "sw"), probes=[InductionProbe(n=8, seq_len=64)], wandb="offline", console=False
    )
    from torch.utils.data import DataLoader

    data = DataLoader([{"input_ids": t, "labels": t} for t in torch.randint(0, 64, (64, 32))], batch_size=4)
    trainer(tmp_path, [cb], max_steps=15).fit(lit, data)
    events = read_jsonl(tmp_path / "sw" / "events.jsonl")
    assert [(e["timeline"], e["previous"], e["stage"]) for e in events] == [("p0", "none", "final")]
    assert events[0]["first_met_step"] == 0 and events[0]["step"] == 5 and events[0]["level"] == "WARN"
    assert len(cb.live.wandb_reporter.alerts) == 1
    assert cb.live.wandb_reporter.final_summary["sinkwatch/alerts"] == 1


def run_losses_and_params(tmp_path, with_callback: bool, **fit_kw):
    pl.seed_everything(123)
    lit = LitLM(build("gpt2", seed=7))
    cbs = [SinkWatchCallback(every_n_steps=3, out_dir=str(tmp_path / "sw"), wandb="offline", console=False)] if with_callback else []
    trainer(tmp_path, cbs, max_steps=12, **fit_kw).fit(lit, loader(batch_size=4))
    return lit.losses, params_of(lit)


def test_the_monitor_is_invisible_to_training(tmp_path):
    """Losses and final parameters are bit-identical with and without the callback."""
    losses_a, params_a = run_losses_and_params(tmp_path / "a", with_callback=False)
    losses_b, params_b = run_losses_and_params(tmp_path / "b", with_callback=True)
    assert losses_a == losses_b  # bit-identical loss sequence
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
    assert len(read_jsonl(tmp_path / "b" / "sw" / "records.jsonl")) == 5  # steps 0, 3, 6, 9, 12


def test_gradient_accumulation_probes_once_per_optimizer_step(tmp_path):
    """With gradient accumulation the callback probes once per optimizer step."""
    cb = SinkWatchCallback(every_n_steps=2, out_dir=str(tmp_path / "sw"), probes=SMALL, wandb="disabled", console=False)
    trainer(tmp_path, [cb], max_steps=6, accumulate_grad_batches=4).fit(LitLM(build("qwen2")), loader(batch_size=2))
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4, 6]
    assert [r["tokens"] for r in records] == [0, 2 * 4 * 2 * 64, 4 * 4 * 2 * 64, 6 * 4 * 2 * 64]


def test_resume_mid_run_continues_without_refiring(tmp_path):
    """Resuming mid-run continues the records and fires no event twice."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = tmp_path / "sw"
    data = torch.utils.data.DataLoader([{"input_ids": t, "labels": t} for t in torch.randint(0, 64, (256, 32))], batch_size=4)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
    cb = SinkWatchCallback(every_n_steps=5, out_dir=str(out), probes=[InductionProbe(n=8, seq_len=64)], wandb="disabled", console=False)
    trainer(tmp_path, [cb, ckpt], max_steps=20, enable_checkpointing=True).fit(PlantedLit(planted.p0_final()), data)
    first = read_jsonl(out / "records.jsonl")
    assert [r["step"] for r in first] == [0, 5, 10, 15, 20]
    assert len(read_jsonl(out / "events.jsonl")) == 1  # none -> final, confirmed at step 5

    # resume from the step-10 checkpoint (steps 15 and 20 are rolled back) and train to 30
    cb2 = SinkWatchCallback(every_n_steps=5, out_dir=str(out), probes=[InductionProbe(n=8, seq_len=64)], wandb="disabled", console=False)
    t2 = trainer(
        tmp_path, [cb2, ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=10)], max_steps=30, enable_checkpointing=True
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t2.fit(PlantedLit(planted.p0_final()), data, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=10.ckpt"))
    records = read_jsonl(out / "records.jsonl")
    assert [r["step"] for r in records] == [0, 5, 10, 15, 20, 25, 30]  # history continues, no duplicates
    assert len({r["probe_hash"] for r in records}) == 1
    assert len(read_jsonl(out / "events.jsonl")) == 1  # the event did not fire again
    assert [r["step"] for r in read_jsonl(out / "records.superseded.jsonl")] == [15, 20]  # nothing lost
    assert any("superseded" in str(w.message) for w in caught)
    assert all(r["p0_stage"] == "final" for r in records[1:])


def test_faults_never_stop_training(tmp_path, monkeypatch):
    # wandb missing: one warning, JSONL keeps everything
    """A missing wandb warns once and training and the JSONL go on."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    cb = SinkWatchCallback(every_n_steps=5, out_dir=str(tmp_path / "a"), probes=SMALL, wandb="offline", console=False)
    with pytest.warns(RuntimeWarning, match="wandb is not installed"):
        trainer(tmp_path, [cb], max_steps=10).fit(LitLM(build("llama")), loader())
    assert [r["step"] for r in read_jsonl(tmp_path / "a" / "records.jsonl")] == [0, 5, 10]
    monkeypatch.delitem(sys.modules, "wandb")


def test_wandb_init_failure(tmp_path, monkeypatch):
    """A failing wandb.init warns and the JSONL records go on."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: init fails
    import wandb

    init = {"settings": wandb.Settings(init_timeout=3)}
    cb = SinkWatchCallback(every_n_steps=5, out_dir=str(tmp_path / "b"), probes=SMALL, wandb="online", wandb_init=init, console=False)
    with pytest.warns(RuntimeWarning, match="wandb reporter failed"):
        trainer(tmp_path, [cb], max_steps=10).fit(LitLM(build("llama")), loader())
    assert [r["step"] for r in read_jsonl(tmp_path / "b" / "records.jsonl")] == [0, 5, 10]


def test_logging_to_a_finished_run_fails_softly(tmp_path):
    """Logging to a finished W&B run warns and the JSONL records go on."""
    import wandb

    run = wandb.init(project="t", dir=str(tmp_path), mode="offline")
    run.finish()  # every later run.log raises
    from lightning.pytorch.loggers import WandbLogger

    logger = WandbLogger(experiment=run)
    cb = SinkWatchCallback(every_n_steps=5, out_dir=str(tmp_path / "c"), probes=SMALL, console=False)
    with pytest.warns(RuntimeWarning, match="wandb reporter failed"):
        trainer(tmp_path, [cb], max_steps=10, logger=logger).fit(LitLM(build("llama")), loader())
    assert [r["step"] for r in read_jsonl(tmp_path / "c" / "records.jsonl")] == [0, 5, 10]


def test_nan_activations_and_probe_exceptions(tmp_path):
    """NaN activations are recorded as null; a failing probe is logged as an error and training goes on."""
    lit = LitLM(build("llama"))
    with torch.no_grad():
        lit.model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    cb = SinkWatchCallback(every_n_steps=5, out_dir=str(tmp_path / "n"), probes=SMALL, wandb="disabled", console=False)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        trainer(tmp_path, [cb], max_steps=5).fit(lit, loader())
    recs = read_jsonl(tmp_path / "n" / "records.jsonl")
    assert [r["step"] for r in recs] == [0, 5] and recs[0]["induction_score"][1][0] is None

    bad = ProbeSet("natural", torch.full((2, 16), 10_000), {}, {})  # ids outside the vocabulary
    cb = SinkWatchCallback(every_n_steps=5, out_dir=str(tmp_path / "e"), probes=[bad], wandb="disabled", console=False)
    lit = LitLM(build("llama"))
    with pytest.warns(RuntimeWarning, match="probe at step 0 failed"):
        trainer(tmp_path, [cb], max_steps=6).fit(lit, loader())
    assert len(lit.losses) == 6  # training went on
    errors = read_jsonl(tmp_path / "e" / "records.jsonl")
    assert errors[0]["step"] == 0 and "vocabulary" in errors[0]["error"]

    cb = SinkWatchCallback(every_n_steps=5, out_dir=str(tmp_path / "r"), probes=[bad], wandb="disabled", console=False, raise_on_error=True)
    with pytest.raises(ValueError, match="vocabulary"):
        trainer(tmp_path, [cb], max_steps=6).fit(LitLM(build("llama")), loader())


def test_unsupported_model_fails_at_fit_start(tmp_path):
    """A module without a transformers model fails at fit start with the reason."""
    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 4)

        def training_step(self, batch, i):  # pragma: no cover - never reached
            raise AssertionError("training must not start")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(UnsupportedModelError, match="no transformers PreTrainedModel found inside Plain"):
        trainer(tmp_path, [SinkWatchCallback(wandb="disabled")], max_steps=2).fit(Plain(), loader())


def test_nanogpt_style_module_through_the_adapter(tmp_path):
    """A nanoGPT-style module with sinkwatch_target() is probed through the callback."""
    cb = SinkWatchCallback(every_n_steps=5, out_dir=str(tmp_path / "g"), wandb="disabled", console=False)
    trainer(tmp_path, [cb], max_steps=10).fit(LitNanoGPT(), loader())
    recs = read_jsonl(tmp_path / "g" / "records.jsonl")
    assert [r["step"] for r in recs] == [0, 5, 10]
    assert recs[-1]["model"] == "NanoGPT" and recs[-1]["n_layers"] == 2 and recs[-1]["n_heads"] == 4
    assert 0 <= recs[-1]["sink_rate"] <= 1 and "icl_score" in recs[-1]


def test_peft_wrapped_model(tmp_path):
    """A PEFT-wrapped model is probed through the callback."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    cb = SinkWatchCallback(every_n_steps=5, out_dir=str(tmp_path / "p"), probes=SMALL, wandb="disabled", console=False)
    trainer(tmp_path, [cb], max_steps=5).fit(LitLM(model), loader())
    assert [r["step"] for r in read_jsonl(tmp_path / "p" / "records.jsonl")] == [0, 5]


def test_bf16_mixed_precision(tmp_path):
    """bf16 mixed precision training is probed and gives finite scores."""
    cb = SinkWatchCallback(every_n_steps=5, out_dir=str(tmp_path / "m"), probes=SMALL, wandb="disabled", console=False)
    trainer(tmp_path, [cb], max_steps=5, precision="bf16-mixed").fit(LitLM(build("olmo")), loader())
    recs = read_jsonl(tmp_path / "m" / "records.jsonl")
    assert [r["step"] for r in recs] == [0, 5] and recs[-1]["icl_score"] is not None


def test_compiled_model_is_not_recompiled_by_probing(tmp_path):
    """Probing a torch.compile'd model leaves its compiled graphs as they were."""
    import torch._dynamo

    def run(with_cb):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        lit = LitLM(torch.compile(build("llama"), backend="eager"))
        cbs = (
            [SinkWatchCallback(every_n_steps=2, out_dir=str(tmp_path / f"c{with_cb}"), probes=SMALL, wandb="disabled", console=False)]
            if with_cb
            else []
        )
        trainer(tmp_path, cbs, max_steps=6).fit(lit, loader())
        return sum(torch._dynamo.utils.counters["stats"].values()), dict(torch._dynamo.utils.counters["recompiles"])

    without, with_ = run(False), run(True)
    assert with_ == without
    assert [r["step"] for r in read_jsonl(tmp_path / "cTrue" / "records.jsonl")] == [0, 2, 4, 6]


def test_callback_validates_its_arguments():
    """Bad callback options are refused at construction with the option named."""
    with pytest.raises(ValueError, match="every_n_steps"):
        SinkWatchCallback(every_n_steps=0)
    with pytest.raises(ValueError, match="wandb"):
        SinkWatchCallback(wandb="sometimes")
    with pytest.raises(TypeError, match="unknown sinkwatch option"):
        SinkWatchCallback(every_n_step=10)
    with pytest.raises(TypeError, match="StageConfig"):
        SinkWatchCallback(stages={"patience": 3})
    cb = SinkWatchCallback(stages=StageConfig(patience=3))
    assert cb.config.monitor.stages.patience == 3
