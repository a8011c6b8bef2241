"""Live monitoring under the settings real runs use: backend strings, compile, schedules,
short first batches, skipped probes, early stopping, DeepSpeed's step in backward, mixed precision."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from sinkwatch import distributed


# ---- item 5: the agreements' device comes from the group's device types -------------------------
@pytest.mark.parametrize(
    ("backend", "prefer", "want"),
    [
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),  # OLMo-core's default string, a CPU model
        ("cpu:gloo,cuda:nccl", "cuda", "cuda"),  # ... and a CUDA model: NCCL, never a CPU detour
        ("cuda:nccl", "cpu", "cuda"),  # an NCCL-only group never gets a CPU tensor
        ("nccl", None, "cuda"),
        ("gloo", None, "cpu"),
        ("gloo", "cuda", "cuda"),
    ],
)
def test_probe_group_device_follows_the_groups_device_types(backend, prefer, want):
    with (
        mock.patch("torch.distributed.get_backend", return_value=backend),
        mock.patch("torch.cuda.is_available", return_value=False),
    ):
        group = distributed.ProbeGroup(2, prefer=prefer)
    assert group.device.type == want, (backend, prefer, group.device)


def test_an_nccl_only_backend_string_gets_cuda_tensors():
    with (
        mock.patch("torch.distributed.get_backend", return_value="cuda:nccl"),
        mock.patch("torch.cuda.is_available", return_value=False),
    ):
        assert distributed.ProbeGroup(2).device.type == "cuda"


# ---- item 9: per-block torch.compile: probe forwards never reach Dynamo ---------------------------
def small_probes():
    from sinkwatch import InductionProbe, RepeatedRandomProbe

    return [InductionProbe(n=4, seq_len=64, vocab_range=(2, 250)), RepeatedRandomProbe(n=4, seq_len=32, vocab_range=(2, 250))]


def quiet(tmp_path, **kw) -> dict:
    return {"out_dir": str(tmp_path / "sw"), "wandb": "disabled", "console": False, **kw}


def test_a_probe_adds_no_dynamo_graph_under_per_block_compile(tmp_path):
    """OLMo-core's apply_compile compiles each block in place; a probe forward through those blocks
    (with sinkwatch's hooks on them) must run eagerly, not trace new graphs (formerly 2 -> 49)."""
    import torch._dynamo
    from tiny_models import build
    from torch._dynamo.testing import CompileCounter

    from sinkwatch.live import LiveConfig, LiveMonitor
    from sinkwatch.reporting.jsonl import read_jsonl

    torch._dynamo.reset()
    counter = CompileCounter()
    model = build("llama").train()
    for block in model.model.layers:
        block.compile(backend=counter)
    ids = torch.randint(2, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    before = counter.frame_count
    assert before >= 1
    live = LiveMonitor(LiveConfig(probes=small_probes(), **quiet(tmp_path)))
    live.setup(model, is_global_zero=True)
    live.step_end(0)
    assert [r["step"] for r in read_jsonl(tmp_path / "sw" / "records.jsonl")] == [0]
    assert "error" not in read_jsonl(tmp_path / "sw" / "records.jsonl")[0]
    assert counter.frame_count == before, f"the probe compiled {counter.frame_count - before} new graphs"
    model(input_ids=ids, labels=ids).loss.backward()  # training's graphs are still the ones it had
    assert counter.frame_count == before
    torch._dynamo.reset()


# ---- item 6: a short first batch: said, warned, recorded --------------------------------------------
def test_a_short_first_batch_warns_and_the_record_says_what_the_natural_probe_holds(tmp_path):
    from tiny_models import build

    from sinkwatch.live import LiveConfig, LiveMonitor
    from sinkwatch.reporting.jsonl import read_jsonl

    model = build("llama")
    live = LiveMonitor(LiveConfig(natural_n=8, natural_seq_len=64, **quiet(tmp_path)))
    live.setup(model, is_global_zero=True)
    short = torch.randint(2, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match=r"2 natural windows of 16 tokens where 8 x 64 were asked"):
        live.batch_start({"input_ids": short})
        live.step_end(0)
    live.batch_start({"input_ids": torch.randint(2, 250, (8, 128))})  # a later, longer batch changes nothing
    (record,) = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert record["natural_probe"] == {"n": 2, "seq_len": 16, "requested_n": 8, "requested_seq_len": 64}
    assert live.natural.params["n"] == 2 and live.natural.params["seq_len"] == 16
    assert live.natural.params["requested_n"] == 8 and live.natural.params["requested_seq_len"] == 64


# ---- item 2: the pre-flight probe ----------------------------------------------------------------
def test_a_model_that_cannot_be_probed_disables_sinkwatch_at_setup_and_trains_on(tmp_path):
    """A model whose blocks raise in eval mode: before, every probe of the run failed (one warning, an
    error line per probe); now the pre-flight probe before the first probe says it once and sinkwatch stands down."""
    from tiny_models import build

    from sinkwatch.live import LiveConfig, LiveMonitor
    from sinkwatch.reporting.jsonl import read_jsonl

    model = build("llama").train()

    def eval_only(module, args):
        if not module.training:
            raise RuntimeError("this block cannot run in eval mode")

    model.model.layers[1].register_forward_pre_hook(eval_only)
    live = LiveMonitor(LiveConfig(probes=small_probes(), every_n_steps=1, **quiet(tmp_path)))
    live.setup(model, is_global_zero=True)
    with pytest.warns(RuntimeWarning, match="sinkwatch is disabled for this run.*RuntimeError: this block cannot run in eval mode"):
        live.step_end(0)
    assert live.disabled is not None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(2, 250, (2, 32))
    for step in (1, 2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        live.step_end(step)
    live.train_end(2)
    (line,) = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert line["step"] is None and "disabled for this run" in line["error"]
    assert model.training  # left as found


def test_the_preflight_probe_leaves_a_healthy_run_alone(tmp_path):
    from tiny_models import build

    from sinkwatch.live import LiveConfig, LiveMonitor
    from sinkwatch.reporting.jsonl import read_jsonl

    model = build("llama").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    live = LiveMonitor(LiveConfig(probes=small_probes(), **quiet(tmp_path)))
    live.setup(model, is_global_zero=True)
    live.step_end(0)
    assert live.disabled is None and model.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [r["step"] for r in read_jsonl(tmp_path / "sw" / "records.jsonl")] == [0]


# ---- item 3: HF early stopping + load_best_model_at_end --------------------------------------------
def test_early_stopping_with_the_best_model_reloaded_probes_the_last_trained_weights(tmp_path):
    """EarlyStoppingCallback stops in on_evaluate (after on_step_end) and load_best_model_at_end reloads
    checkpoint-1 before on_train_end: the last record must be the weights trained to step 3 (before:
    it was checkpoint-1's numbers labelled step 3)."""
    from tiny_models import build
    from train_helpers import CopyDataset
    from transformers import EarlyStoppingCallback, Trainer, TrainingArguments

    from sinkwatch import Monitor
    from sinkwatch.hf import SinkWatchTrainerCallback
    from sinkwatch.reporting.jsonl import read_jsonl

    scores = iter([1.0, 0.5, 0.25, 0.1, 0.05])  # the first evaluation is the best: checkpoint-1

    def compute_metrics(_):
        return {"score": next(scores)}

    cb = SinkWatchTrainerCallback(every_n_steps=100, probes=small_probes(), **quiet(tmp_path))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=10, per_device_train_batch_size=4, learning_rate=3e-2, use_cpu=True,
        report_to=[], eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
        metric_for_best_model="score", greater_is_better=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    model = build("llama")
    trainer = Trainer(
        model=model, args=args, train_dataset=CopyDataset(n=64), eval_dataset=CopyDataset(n=4, seed=1), compute_metrics=compute_metrics,
        callbacks=[cb, EarlyStoppingCallback(early_stopping_patience=2)],
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 3], records

    def probe(checkpoint):
        from transformers import AutoModelForCausalLM

        return Monitor(small_probes()).probe(AutoModelForCausalLM.from_pretrained(tmp_path / "out" / checkpoint)).to_record()

    last, best = probe("checkpoint-3"), probe("checkpoint-1")
    assert records[-1]["sink_alpha"] != best["sink_alpha"]  # the training did move the weights between the two
    for key in ("sink_alpha", "pr", "induction_score"):
        torch.testing.assert_close(torch.tensor(records[-1][key]), torch.tensor(last[key]), rtol=1e-5, atol=1e-6, msg=key)


def test_epoch_evaluation_early_stopping_probes_the_last_trained_weights(tmp_path):
    """Evaluation per epoch: EarlyStoppingCallback decides in on_evaluate, after on_epoch_end, and
    load_best_model_at_end reloads the best checkpoint (epoch 1's) before on_train_end. The last trained
    weights are probed just before that reload (before: they were never probed; the run's last record
    was step 0's)."""
    from tiny_models import build
    from train_helpers import CopyDataset
    from transformers import EarlyStoppingCallback, Trainer, TrainingArguments

    from sinkwatch import Monitor
    from sinkwatch.hf import SinkWatchTrainerCallback
    from sinkwatch.reporting.jsonl import read_jsonl

    scores = iter([1.0, 0.5, 0.25, 0.1, 0.05])  # the first evaluation is the best: epoch 1's checkpoint (step 2)

    def compute_metrics(_):
        return {"score": next(scores)}

    cb = SinkWatchTrainerCallback(every_n_steps=100, probes=small_probes(), **quiet(tmp_path))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), num_train_epochs=10, per_device_train_batch_size=4, learning_rate=3e-2, use_cpu=True,
        report_to=[], eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True, metric_for_best_model="score",
        greater_is_better=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(
        model=build("llama"), args=args, train_dataset=CopyDataset(n=8), eval_dataset=CopyDataset(n=4, seed=1),
        compute_metrics=compute_metrics, callbacks=[cb, EarlyStoppingCallback(early_stopping_patience=2)],
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 6 and trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 6], records
    from transformers import AutoModelForCausalLM

    last = Monitor(small_probes()).probe(AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint-6")).to_record()
    for key in ("sink_alpha", "pr", "induction_score"):
        torch.testing.assert_close(torch.tensor(records[-1][key]), torch.tensor(last[key]), rtol=1e-5, atol=1e-6, msg=key)


# ---- item 7: HF + DeepSpeed ZeRO-1/2: the optimizer steps inside backward -----------------------------
class _NoStepOptimizer(torch.optim.SGD):
    """accelerate's DeepSpeedOptimizerWrapper: the Trainer's ``optimizer.step()`` is a no-op."""

    def step(self, closure=None):
        return None

    def engine_step(self):
        super().step()
        self.zero_grad()


class _EngineWrapperStandIn:
    """accelerate's DeepSpeedEngineWrapper.backward: ``engine.backward(loss)`` then ``engine.step()``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def backward(self, loss, sync_gradients=True, **kwargs):
        loss.backward(**kwargs)
        if sync_gradients:
            self.optimizer.engine_step()


class _ZeroTwoConfig:
    def is_zero3(self) -> bool:
        return False


def test_under_deepspeed_the_step0_record_is_the_initial_weights(tmp_path):
    import copy

    from tiny_models import build
    from train_helpers import CopyDataset
    from transformers import Trainer, TrainingArguments

    from sinkwatch.hf import SinkWatchTrainerCallback
    from sinkwatch.live import LiveConfig, LiveMonitor
    from sinkwatch.reporting.jsonl import read_jsonl

    model = build("llama")
    initial = copy.deepcopy(model)
    first: dict = {}

    def keep_first(module, args, kwargs):
        if module.training:
            first.setdefault("input_ids", kwargs["input_ids"].clone())

    model.register_forward_pre_hook(keep_first, with_kwargs=True)
    opt = _NoStepOptimizer(model.parameters(), lr=0.5)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    cb = SinkWatchTrainerCallback(every_n_steps=100, **quiet(tmp_path))
    trainer = Trainer(model=model, args=args, train_dataset=CopyDataset(n=16), callbacks=[cb], optimizers=(opt, None))
    args.hf_deepspeed_config = _ZeroTwoConfig()  # what TrainingArguments(deepspeed=...) sets for a ZeRO-1/2 config
    engine = _EngineWrapperStandIn(opt)
    trainer.accelerator.backward = lambda loss, **kw: engine.backward(loss, sync_gradients=True)
    trainer.train()
    assert not all(torch.equal(a, b) for a, b in zip(initial.parameters(), model.parameters()))  # the stand-in did step
    step0 = read_jsonl(tmp_path / "sw" / "records.jsonl")[0]
    assert step0["step"] == 0
    live = LiveMonitor(LiveConfig(**quiet(tmp_path / "single")))
    live.setup(initial, is_global_zero=True)
    live.batch_start({"input_ids": first["input_ids"]})
    live.step_end(0)
    want = read_jsonl(tmp_path / "single" / "sw" / "records.jsonl")[0]
    for key in ("sink_alpha", "pr", "induction_score", "icl_score"):
        torch.testing.assert_close(torch.tensor(step0[key]), torch.tensor(want[key]), rtol=1e-5, atol=1e-6, msg=key)


# ---- item 4: a probe skipped for lack of memory is retried, and every reporter sees the skip ---------
def test_a_memory_skip_is_retried_next_step_and_every_reporter_sees_it(tmp_path, monkeypatch):
    """The pre-probe memory check says no at steps 4, 5 and 8 (mocked: no GPU here). Before: step 4
    was lost (counted as probed, never retried) and only the console and the JSONL knew. Now step 5
    retries (still no), step 6 probes; the next scheduled probe (8) is skipped again, with no retry
    left before the end; W&B, the Lightning loggers and the user's reporters get
    ``sinkwatch/probe_skipped`` at 4 and 8, W&B one alert for the run."""
    import csv

    from lightning.pytorch.loggers import CSVLogger
    from tiny_models import build
    from train_helpers import LitLM, loader, trainer

    import sinkwatch.live.monitor
    from sinkwatch.distributed import ProbeNotReady
    from sinkwatch.lightning import SinkWatchCallback
    from sinkwatch.reporting.base import Reporter
    from sinkwatch.reporting.jsonl import read_jsonl

    def memory(target, sets, batch_tokens, **layout):
        if run.global_step in (4, 5, 8):
            raise ProbeNotReady(f"0.10 GiB free on cuda:0, the probe needs at least 0.50 GiB (step {run.global_step})")

    monkeypatch.setattr(sinkwatch.live.monitor, "check_probe_memory", memory)

    class Skips(Reporter):
        name = "skips"
        seen: list = []

        def log_skip(self, step, tokens, reason):
            self.seen.append(step)

    cb = SinkWatchCallback(
        every_n_steps=4, probes=small_probes(), out_dir=str(tmp_path / "sw"), wandb="offline", console=False, reporters=[Skips()]
    )
    logger = CSVLogger(str(tmp_path), name="csv")
    run = trainer(tmp_path, [cb], max_steps=8, logger=logger)
    run.fit(LitLM(build("llama")), loader(batch_size=4, n=64))
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [(r["step"], "error" in r) for r in records] == [(0, False), (4, True), (6, False), (8, True)], records
    assert "ProbeNotReady" in records[1]["error"] and "retried" in records[1]["error"]
    assert records[2]["scheduled_step"] == 4 and "scheduled_step" not in records[0]  # the probe due at 4 ran at 6
    assert Skips.seen == [4, 8]
    with open(next((tmp_path / "csv").rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("sinkwatch/probe_skipped")]
    assert [int(r["step"]) for r in rows] == [4, 8]
    wb = cb.live.wandb_reporter
    assert [a["title"] for a in wb.alerts] == ["sinkwatch: a probe was skipped"]
    assert wb.final_summary.get("sinkwatch/probes_skipped") == 2


def test_a_memory_skip_is_retried_with_a_backoff(tmp_path, monkeypatch):
    """Memory short from step 16 to 25 with probes every 16 steps: retried at 17, 18, 20 and 24 (each retry
    one all-reduce, nothing gathered), then the scheduled probe at 32 is written (before: a check, an
    all-reduce and an all_gather_object at every one of steps 17 to 31)."""
    from tiny_models import build

    import sinkwatch.live.monitor
    from sinkwatch.distributed import ProbeNotReady
    from sinkwatch.live import LiveConfig, LiveMonitor
    from sinkwatch.reporting.jsonl import read_jsonl

    checked = []

    def memory(target, sets, batch_tokens, **layout):
        checked.append(now["step"])
        if 16 <= now["step"] <= 25:
            raise ProbeNotReady("0.10 GiB available on cuda:0, the probe needs about 0.50 GiB")

    monkeypatch.setattr(sinkwatch.live.monitor, "check_probe_memory", memory)
    live = LiveMonitor(LiveConfig(every_n_steps=16, probes=small_probes(), **quiet(tmp_path)))
    live.setup(build("llama"), is_global_zero=True)
    now = {}
    for step in range(33):
        now["step"] = step
        live.step_end(step)
    assert checked == [0, 16, 17, 18, 20, 24, 32]
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [(r["step"], "error" in r) for r in records] == [(0, False), (16, True), (32, False)], records
    assert "scheduled_step" not in records[-1]  # 32 was due anyway


# ---- item 10 (first part): the probe runs in the trainer's compute dtype -----------------------------
def _step0_in_bf16(record: dict, model) -> None:
    """The step-0 record is the initial weights probed under bf16 autocast: not the float32 numbers,
    within bf16 tolerance of them, and ``probe_dtype`` says so."""
    from sinkwatch import Monitor

    assert record["probe_dtype"] == "bfloat16", record.get("probe_dtype")
    f32 = Monitor(small_probes()).probe(model).to_record()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = Monitor(small_probes()).probe(model).to_record()
    for key in ("sink_alpha", "induction_score"):
        got = torch.tensor(record[key])
        torch.testing.assert_close(got, torch.tensor(bf16[key]), rtol=1e-5, atol=1e-6, msg=key)
        assert not torch.equal(got, torch.tensor(f32[key])), key
        torch.testing.assert_close(got, torch.tensor(f32[key]), rtol=5e-2, atol=5e-2, msg=key)


def test_lightning_bf16_mixed_probes_under_autocast(tmp_path):
    import copy

    from tiny_models import build
    from train_helpers import LitLM, loader, trainer

    from sinkwatch.lightning import SinkWatchCallback
    from sinkwatch.reporting.jsonl import read_jsonl

    model = build("llama")
    initial = copy.deepcopy(model)
    cb = SinkWatchCallback(every_n_steps=2, probes=small_probes(), **quiet(tmp_path))
    trainer(tmp_path, [cb], max_steps=2, precision="bf16-mixed").fit(LitLM(model), loader(batch_size=4, n=16))
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2] and all("error" not in r for r in records)
    _step0_in_bf16(records[0], initial)


def test_hf_bf16_probes_under_autocast(tmp_path):
    import copy

    from tiny_models import build
    from train_helpers import CopyDataset
    from transformers import Trainer, TrainingArguments

    from sinkwatch.hf import SinkWatchTrainerCallback
    from sinkwatch.reporting.jsonl import read_jsonl

    model = build("llama")
    initial = copy.deepcopy(model)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, use_cpu=True, bf16=True, report_to=[],
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    cb = SinkWatchTrainerCallback(every_n_steps=2, probes=small_probes(), **quiet(tmp_path))
    Trainer(model=model, args=args, train_dataset=CopyDataset(n=16), callbacks=[cb]).train()
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2] and all("error" not in r for r in records)
    _step0_in_bf16(records[0], initial)


def test_olmo_core_autocast_precision_probes_in_bf16(tmp_path):
    pytest.importorskip("olmo_core")
    from olmo_core_helpers import build_trainer

    from sinkwatch import InductionProbe, RepeatedRandomProbe
    from sinkwatch.olmo_core import SinkWatchCallback
    from sinkwatch.reporting.jsonl import read_jsonl

    probes = [InductionProbe(n=4, seq_len=64), RepeatedRandomProbe(n=4, seq_len=32)]  # fitted to its 64-id vocabulary
    cb = SinkWatchCallback(every_n_steps=2, probes=probes, **quiet(tmp_path))
    build_trainer(tmp_path / "run", {"sinkwatch": cb}, steps=2, autocast_precision=torch.bfloat16).fit()
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2] and all("error" not in r for r in records), records
    assert {r["probe_dtype"] for r in records} == {"bfloat16"}


def test_replay_of_a_bf16_live_run_probes_in_bf16(tmp_path):
    """The live state (and probes.json) carry probe_dtype; replay of the run's checkpoints without
    --dtype probes in it (before: float32, a different dtype from the live records)."""
    from test_live_equals_replay import _replay
    from tiny_models import build
    from train_helpers import CopyDataset
    from transformers import Trainer, TrainingArguments

    from sinkwatch.hf import SinkWatchTrainerCallback
    from sinkwatch.reporting.jsonl import read_jsonl

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, use_cpu=True, bf16=True, report_to=[],
        save_strategy="steps", save_steps=2, save_only_model=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    cb = SinkWatchTrainerCallback(every_n_steps=2, probes=small_probes(), **quiet(tmp_path))
    Trainer(model=build("llama"), args=args, train_dataset=CopyDataset(n=16), callbacks=[cb]).train()
    live = read_jsonl(tmp_path / "sw" / "records.jsonl")[-1]
    (replayed,) = _replay(tmp_path / "out", tmp_path / "replay", "--live-store", str(tmp_path / "sw"))
    assert live["probe_dtype"] == replayed["dtype"] == "bfloat16", (live.get("probe_dtype"), replayed.get("dtype"))
    torch.testing.assert_close(torch.tensor(replayed["sink_alpha"]), torch.tensor(live["sink_alpha"]), rtol=5e-2, atol=5e-2)
