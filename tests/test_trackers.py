"""The run's own trackers get sinkwatch's scalars and stage events (TensorBoard, MLflow, CSV), read
back from the trackers' own files and APIs; training is unchanged; replay/demo honour WANDB_MODE.

A tiny GPT-2 really trains on the copy task. The event is forced cheaply: with the prefix rule's
"forming" score threshold at 0, every probe says "forming", so with patience 2 the induction
timeline declares absent -> forming at the second probe (step 4).
"""

import csv
import glob
import json
import shutil

import lightning.pytorch as pl
import pytest
import torch
from tiny_models import build
from train_helpers import CopyDataset, LitLM, loader, params_of, trainer
from transformers import Trainer, TrainingArguments

from sinkwatch import InductionProbe, RepeatedRandomProbe, StageConfig
from sinkwatch.cli import main
from sinkwatch.hf import SinkWatchTrainerCallback
from sinkwatch.lightning import SinkWatchCallback
from sinkwatch.replay import record_files
from sinkwatch.reporting.jsonl import read_jsonl
from sinkwatch.reporting.trackers import tracker_scalars
from sinkwatch.reporting.wandb_run import wandb_mode_from_env
from sinkwatch.stages import INDUCTION_STATES, P0_STAGES

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

PROBES = [InductionProbe(n=8, seq_len=64), RepeatedRandomProbe(n=8, seq_len=32)]
STAGES = StageConfig(induction_rule="prefix", prefix_forming_score=0.0, patience=2)
STEPS, EVERY = 10, 4
PROBED = [0, 4, 8, 10]  # 10: the end probe (probe_at_end), not a multiple of EVERY
EVENT = ("induction", "absent", "forming", 4)  # timeline, previous, stage, step
MESSAGE = "induction circuit: absent -> forming at step 4"


@pytest.fixture(autouse=True)
def mlflow_global_tracking_uri():
    """MLFlowLogger and MLflowCallback set MLflow's process-wide tracking URI (and MLFLOW_TRACKING_URI);
    unset it after each test so no run lands in another test's store or in ./mlruns."""
    yield
    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory):
    """An empty MLflow SQLite store, created once (its schema migrations take seconds); each run copies it."""
    path = tmp_path_factory.mktemp("mlflow") / "empty.db"
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def fresh_store(template, tmp_path) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path}/mlflow.db"


def watch(cls, out):
    return cls(every_n_steps=EVERY, out_dir=str(out), probes=PROBES, stages=STAGES, wandb="disabled", console=False)


def check_records(out):
    """The JSONL: every probe step, and the one forced event."""
    records = read_jsonl(out / "records.jsonl")
    assert [r["step"] for r in records] == PROBED
    events = read_jsonl(out / "events.jsonl")
    assert [(e["timeline"], e["previous"], e["stage"], e["step"]) for e in events] == [EVENT]
    return records, events[0]


def expected(record) -> dict:
    """What each tracker must hold at the record's step, checked against the record itself for the
    headline keys (an independent reading of the record, not the reporter's own function)."""
    want = tracker_scalars(record)
    assert want["sinkwatch/sink_rate"] == record["sink_rate"]
    assert want["sinkwatch/icl_score"] == record["icl_score"]
    assert want["sinkwatch/induction_state"] == INDUCTION_STATES.index(record["induction_state"])
    assert want["sinkwatch/p0_stage"] == P0_STAGES.index(record["p0_stage"])
    assert want["sinkwatch/tokens"] == record["tokens"]
    for k, v in enumerate(record["sink_profile"]):
        assert want[f"sinkwatch/sink_profile/k{k}"] == v
    assert not any(k.startswith("sinkwatch/by_tokens/") for k in want)  # W&B's second axis only
    return want


def tensorboard_scalars(logdir, prefix=""):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scal = {t[len(prefix) :]: {e.step: e.value for e in acc.Scalars(t)} for t in tags["scalars"] if t.startswith(prefix + "sinkwatch/")}
    texts = {}
    for tag in tags["tensors"]:
        if tag.startswith("sinkwatch/events"):
            texts.update({e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)})
    return scal, texts


def mlflow_scalars(client, run_id):
    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith("sinkwatch/")]
    return {k: {m.step: m.value for m in client.get_metric_history(run_id, k)} for k in keys}


def check_mlflow_event(client, run_id, event, tmp_path):
    tags = client.get_run(run_id).data.tags
    assert tags["sinkwatch/event/induction"] == "forming at step 4"
    [art] = client.list_artifacts(run_id, "sinkwatch_events")
    assert art.path == "sinkwatch_events/step000000004_induction.json"
    local = client.download_artifacts(run_id, art.path, str(tmp_path))
    assert json.loads(open(local).read()) == json.loads(json.dumps(event))


def assert_same(got: dict, records, *, rel: float = 0.0):
    """Every key of every record at its step, equal (TensorBoard stores float32: rel 1e-6)."""
    for r in records:
        for key, value in expected(r).items():
            assert key in got, key
            assert r["step"] in got[key], (key, r["step"])
            assert got[key][r["step"]] == pytest.approx(value, rel=rel, abs=0 if rel == 0 else 1e-7), (key, r["step"])
    # nothing at other steps; a key is absent at a step where its value is undefined (NaN: e.g. p0_persistence
    # when the emergence block is the last one), and present wherever the record has it (the loop above)
    assert all(set(steps) <= set(PROBED) for steps in got.values())


# ---- Lightning: TensorBoard + CSV + MLflow loggers ------------------------------------------------
def lightning_run(tmp_path, mlflow_db, with_callback):
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger

    pl.seed_everything(3)
    loggers = [
        TensorBoardLogger(str(tmp_path / "tb"), name="", version=0),
        CSVLogger(str(tmp_path / "csv"), name="", version=0),
        MLFlowLogger(experiment_name="sw", tracking_uri=fresh_store(mlflow_db, tmp_path), artifact_location=str(tmp_path / "art")),
    ]
    lit = LitLM(build("gpt2", seed=7))
    cbs = [watch(SinkWatchCallback, tmp_path / "sw")] if with_callback else []
    trainer(tmp_path, cbs, max_steps=STEPS, logger=loggers, log_every_n_steps=1).fit(lit, loader(batch_size=4))
    return lit.losses, params_of(lit), loggers


def test_lightning_loggers_get_every_scalar_and_the_event(tmp_path, mlflow_db):
    """TensorBoard, CSV and MLflow loggers hold every probe's scalars and the event; training is bit-identical."""
    losses_a, params_a, _ = lightning_run(tmp_path / "a", mlflow_db, with_callback=False)
    losses_b, params_b, (tb, csv_logger, ml) = lightning_run(tmp_path / "b", mlflow_db, with_callback=True)
    assert losses_a == losses_b and len(losses_a) == STEPS  # bit-identical training with the trackers on
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name

    records, event = check_records(tmp_path / "b" / "sw")

    scal, texts = tensorboard_scalars(tb.log_dir)
    assert_same(scal, records, rel=1e-6)
    assert list(texts) == [4] and MESSAGE in texts[4] and "[INFO]" in texts[4]

    rows = list(csv.DictReader(open(f"{csv_logger.log_dir}/metrics.csv")))
    got: dict = {}
    for row in rows:
        for k, v in row.items():
            if k.startswith("sinkwatch/") and v != "":
                got.setdefault(k, {})[int(row["step"])] = float(v)
    assert_same(got, records)
    [ev_row] = list(csv.DictReader(open(f"{csv_logger.log_dir}/sinkwatch_events.csv")))
    assert (ev_row["timeline"], ev_row["previous"], ev_row["stage"], int(ev_row["step"])) == EVENT
    assert ev_row["message"] == event["message"] and int(ev_row["tokens"]) == event["tokens"]

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'b'}/mlflow.db")
    assert_same(mlflow_scalars(client, ml.run_id), records)
    check_mlflow_event(client, ml.run_id, event, tmp_path)


# ---- HF Trainer: report_to=["tensorboard", "mlflow"] -------------------------------------------------
def hf_run(tmp_path, mlflow_db, monkeypatch, with_callback):
    db = fresh_store(mlflow_db, tmp_path)
    mlflow.set_tracking_uri(db)  # what the MLflowCallback uses when set (it also reads MLFLOW_TRACKING_URI)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "sw-hf")
    mlflow.MlflowClient(tracking_uri=db).create_experiment("sw-hf", artifact_location=str(tmp_path / "art"))
    model = build("llama", seed=3)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        use_cpu=True,
        report_to=["tensorboard", "mlflow"],
        save_strategy="no",
        logging_steps=1,
        seed=11,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    cbs = [watch(SinkWatchTrainerCallback, tmp_path / "sw")] if with_callback else []
    t = Trainer(model=model, args=args, train_dataset=CopyDataset(), callbacks=cbs)
    t.train()
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    return losses, t.state.log_history, {n: p.detach().clone() for n, p in model.named_parameters()}, db


def test_hf_report_to_integrations_get_every_scalar_and_the_event(tmp_path, mlflow_db, monkeypatch):
    """report_to tensorboard and mlflow get every probe's scalars and the event; loss log and training unchanged."""
    losses_a, history_a, params_a, _ = hf_run(tmp_path / "a", mlflow_db, monkeypatch, with_callback=False)
    losses_b, history_b, params_b, db = hf_run(tmp_path / "b", mlflow_db, monkeypatch, with_callback=True)
    assert losses_a == losses_b and len(losses_a) == STEPS  # the loss is logged as often as before, identical
    assert [sorted(h) for h in history_a[:-1]] == [sorted(h) for h in history_b[:-1]]  # log_history untouched
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name

    records, event = check_records(tmp_path / "b" / "sw")

    [logdir] = glob.glob(str(tmp_path / "b" / "out" / "runs" / "*"))
    scal, texts = tensorboard_scalars(logdir, prefix="train/")  # the integration's own prefix, as for train/loss
    assert_same(scal, records, rel=1e-6)
    assert list(texts) == [4] and MESSAGE in texts[4]

    client = mlflow.MlflowClient(tracking_uri=db)
    [run] = client.search_runs([client.get_experiment_by_name("sw-hf").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, STEPS + 1))
    assert_same(mlflow_scalars(client, run.info.run_id), records)
    check_mlflow_event(client, run.info.run_id, event, tmp_path)


# ---- WANDB_MODE for the runs sinkwatch starts itself -------------------------------------------------
def test_wandb_mode_follows_the_flag_then_the_environment(monkeypatch):
    """--wandb wins, then WANDB_MODE, then offline; a bad WANDB_MODE is a clear error."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode_from_env(None) == "offline"  # no account needed by default
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode_from_env(None) == "disabled" and wandb_mode_from_env("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert wandb_mode_from_env(None) == "offline"
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ValueError, match="WANDB_MODE='sometimes'"):
        wandb_mode_from_env(None)


def test_demo_honours_wandb_mode_disabled(tmp_path, monkeypatch):
    """sinkwatch demo without --wandb starts no W&B run under WANDB_MODE=disabled."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "2", "--every", "2", "--out", str(out)]) == 0
    assert [r["step"] for r in read_jsonl(out / "records.jsonl")] == [0, 2]
    assert not (out / "wandb").exists()  # before: an offline W&B run was started anyway


def test_replay_honours_wandb_mode_disabled(tmp_path, monkeypatch):
    """sinkwatch replay without --wandb follows WANDB_MODE: disabled starts no run, offline does."""
    from trajectory import hf_cache_from_checkpoints

    build("llama").save_pretrained(tmp_path / "step0")  # one revision of an untrained tiny model is enough here
    repo = hf_cache_from_checkpoints({"step0": tmp_path / "step0"}, tmp_path / "cache")
    argv = [
        "replay",
        repo,
        "--revisions",
        "step0",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--n",
        "4",
        "--seq-len",
        "64",
        "--tokens-per-step",
        "64",
        "--no-progress",
    ]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert main([*argv, "--out", str(tmp_path / "off")]) == 0
    assert [len(read_jsonl(p)) for p in record_files(tmp_path / "off")] == [1]  # the worker's own records file
    assert not (tmp_path / "off" / "wandb").exists()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main([*argv, "--out", str(tmp_path / "on")]) == 0
    assert list((tmp_path / "on" / "wandb").glob("offline-run-*"))


def test_a_failing_logger_warns_once_and_the_others_still_log(tmp_path):
    """A logger that raises gets one warning; the other loggers still get every record."""
    import os

    from lightning.pytorch.loggers import CSVLogger

    from sinkwatch.reporting.lightning_loggers import lightning_loggers_reporter

    bad, good = CSVLogger(str(tmp_path / "bad"), name="", version=0), CSVLogger(str(tmp_path / "good"), name="", version=0)
    os.makedirs(os.path.join(bad.log_dir, "metrics.csv"))  # a directory where the CSV file must go: every save fails
    reporter = lightning_loggers_reporter([bad, good])
    with pytest.warns(RuntimeWarning, match="Lightning CSVLogger reporter failed in log_record"):
        for step in (3, 6):
            reporter.log_record({"step": step, "tokens": 32 * step, "sink_rate": step / 10})
    rows = list(csv.DictReader(open(os.path.join(good.log_dir, "metrics.csv"))))
    assert [(int(r["step"]), float(r["sinkwatch/sink_rate"]), int(r["sinkwatch/tokens"])) for r in rows] == [(3, 0.3, 96), (6, 0.6, 192)]
