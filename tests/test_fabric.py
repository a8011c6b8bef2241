"""Lightning Fabric and LitGPT, on the real parts: ``litgpt.pretrain.setup`` unmodified (its
dataloaders and ``save_hyperparameters`` stood in for as LitGPT's own tests do), monitored through the
``lightning.fabric.callbacks_factory`` entry point pyproject.toml declares and ``SINKWATCH_FABRIC``; its
records every N steps equal ``sinkwatch replay`` of its own ``step-NNNNNNNN/`` checkpoints; a resumed
run continues the schedule without duplicates; a compiled model's graphs are not touched by a probe.
DDP and FSDP2 on 2 gloo processes: tests/test_parallel_matrix.py (the Fabric cells)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("litgpt")

import fabric_helpers as fh  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

from sinkwatch import InductionProbe  # noqa: E402
from sinkwatch.cli import main  # noqa: E402
from sinkwatch.fabric import SinkWatchFabricCallback, optimizer_steps  # noqa: E402
from sinkwatch.fabric_factory import ENV, callbacks  # noqa: E402
from sinkwatch.replay import record_files  # noqa: E402
from sinkwatch.reporting.jsonl import read_jsonl  # noqa: E402

# names, timing and the run's history (the replay sees only the saved checkpoints, not the step-0 probe)
REPLAY_ONLY_OR_NAMES = {"model", "revision", "path", "probe_seconds", "config_hash", "tracker_since_step", "stages_visited"}


@pytest.fixture(scope="module")
def entry_site(tmp_path_factory):
    return fh.entry_point_site(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def litgpt_run(tmp_path_factory, entry_site):
    """8 optimizer steps of litgpt.pretrain.setup, monitored through the entry point only."""
    root = tmp_path_factory.mktemp("litgpt")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(entry_site))
    mp.setenv(ENV, fh.env_options(root / "sw"))
    try:
        fh.pretrain(root / "out", 8)
    finally:
        mp.undo()
    return root


def test_pretrain_is_monitored_with_no_code_change(litgpt_run):
    """The entry point attached the callback: records at 0, 4, 8 (every_n_steps=4), tokens counted from
    the training batches, every layer's attention seen, the scalars in LitGPT's own CSV logger."""
    records = read_jsonl(litgpt_run / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 4, 8]
    assert [r["tokens"] for r in records] == [0, 4 * fh.TOKENS_PER_STEP, 8 * fh.TOKENS_PER_STEP]
    assert all(r["model"] == "litgpt.tiny-llama" and r["n_layers"] == 2 and r["n_heads"] == 4 for r in records)
    assert set(records[0]["probe_hashes"]) == {"natural", "induction", "repeated"}  # the defaults, fitted to max_seq_length 64
    assert records[0]["probe_hashes"] == records[-1]["probe_hashes"]
    import csv

    (metrics,) = (litgpt_run / "out" / "logs" / "csv").rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("sinkwatch/sink_rate")]
    assert [int(r["step"]) for r in rows] == [0, 4, 8]  # fabric.log_dict at the record's step
    assert float(rows[-1]["sinkwatch/sink_rate"]) == pytest.approx(records[-1]["sink_rate"])


def test_live_equals_replay_of_litgpt_checkpoints(litgpt_run, tmp_path):
    """``sinkwatch replay`` of step-00000004/ and step-00000008/ (lit_model.pth + model_config.yaml, through
    litgpt's GPT and the same capture) gives the live records, key for key."""
    out = tmp_path / "replay"
    argv = ["replay", str(litgpt_run / "out"), "--out", str(out), "--wandb", "disabled", "--no-progress"]
    argv += ["--live-store", str(litgpt_run / "sw"), "--tokens-per-step", str(fh.TOKENS_PER_STEP)]
    argv += ["--revisions", "step-00000004,step-00000008"]
    assert main(argv) == 0
    replayed = [r for p in record_files(out) for r in read_jsonl(p)]
    live = {r["step"]: r for r in read_jsonl(litgpt_run / "sw" / "records.jsonl")}
    assert [r["step"] for r in replayed] == [4, 8]
    for b in replayed:
        a = live[b["step"]]
        shared = sorted(set(a) & set(b) - REPLAY_ONLY_OR_NAMES)
        assert {"sink_rate", "selectivity", "pr", "induction_score", "icl_score", "p0_norm_ratio", "tokens"} <= set(shared)
        for key in shared:
            assert a[key] == b[key], f"step {a['step']}: {key}: live {a[key]!r} != replay {b[key]!r}"
    assert live[4]["sink_alpha"] != live[8]["sink_alpha"]  # the weights did change between the checkpoints


def test_resumed_litgpt_run_continues_the_schedule(litgpt_run, tmp_path, entry_site, monkeypatch):
    """Resumed from step-00000004 (Fabric calls no callback on load): the step comes from the optimizer's
    state and the callback's state from its store; the record at 8 of the abandoned timeline moves to
    records.superseded.jsonl, and 8 and 12 are probed again with the same probe sets: no duplicates."""
    shutil.copytree(litgpt_run / "out", tmp_path / "out")
    shutil.copytree(litgpt_run / "sw", tmp_path / "sw")
    monkeypatch.syspath_prepend(str(entry_site))
    monkeypatch.setenv(ENV, fh.env_options(tmp_path / "sw"))
    fh.pretrain(tmp_path / "out", 12, resume=tmp_path / "out" / "step-00000004" / "lit_model.pth")
    records = read_jsonl(tmp_path / "sw" / "records.jsonl")
    first = read_jsonl(litgpt_run / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 4, 8, 12]
    assert [r["tokens"] for r in records] == [s * fh.TOKENS_PER_STEP for s in (0, 4, 8, 12)]
    assert records[:2] == first[:2]  # kept as written
    assert [r["step"] for r in read_jsonl(tmp_path / "sw" / "records.superseded.jsonl")] == [8]
    assert {r["config_hash"] for r in records} == {first[0]["config_hash"]}  # the same probe sets (natural windows from probes.json)
    assert all(r["tracker_since_step"] == 0 for r in records)
    events = read_jsonl(tmp_path / "sw" / "events.jsonl")
    keys = [(e["timeline"], e["stage"]) for e in events]
    assert len(keys) == len(set(keys))


def test_compiled_model_graphs_unchanged_by_a_probe(tmp_path):
    """A torch.compile'd LitGPT GPT under Fabric: the probes (steps 0, 3, 6 and the last, 7: max_steps) add
    no Dynamo graph and cause no recompilation; the training forward keeps its graphs."""
    import torch._dynamo
    from litgpt.model import GPT

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    cb = SinkWatchFabricCallback(every_n_steps=3, max_steps=7, out_dir=str(tmp_path / "sw"), wandb="disabled", console=False)
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[cb])
    torch.manual_seed(0)
    model = torch.compile(GPT(fh.tiny_config()), backend="eager")
    model = fabric.setup(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = fh.dataset()
    graphs = []
    for step in range(7):
        batch = data[2 * step : 2 * step + 2]
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        graphs.append((counters["stats"]["unique_graphs"], dict(counters["recompiles"])))
    assert [r["step"] for r in read_jsonl(tmp_path / "sw" / "records.jsonl")] == [0, 3, 6, 7]
    assert graphs[0][0] >= 1
    assert all(g == graphs[0] for g in graphs), graphs  # the probes after steps 0, 3, 6 and 7 changed nothing
    assert cb._batch_hook is None  # max_steps reached: finished, the hook removed
    # a KV-cache forward (input_pos) is not a training batch
    cb2 = SinkWatchFabricCallback(out_dir=str(tmp_path / "sw2"), wandb="disabled", console=False)
    Fabric(accelerator="cpu", devices=1, callbacks=[cb2]).setup(GPT(fh.tiny_config())).train()
    with pytest.warns(RuntimeWarning, match="KV cache"):
        cb2._read_batch(cb2._fabric_module, (data[:2, :-1],), {"input_pos": torch.arange(fh.T)})
    assert cb2.live.natural is None and cb2.live.tokens_seen == 0
    cb2._read_batch(cb2._fabric_module, (data[:2, :-1],), {})
    assert cb2.live.natural is not None and cb2.live.tokens_seen == 2 * fh.T
    cb2.finish()


def test_the_tested_litgpt_version_is_checked_at_import(monkeypatch):
    import sinkwatch.fabric as sf

    monkeypatch.setattr(sf.metadata, "version", lambda name: "9.9.9")
    with pytest.warns(RuntimeWarning, match=f"litgpt 9.9.9 is installed; .* tested with litgpt {sf.TESTED_LITGPT}"):
        sf._check_litgpt_version()
    monkeypatch.setattr(sf.metadata, "version", lambda name: sf.TESTED_LITGPT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sf._check_litgpt_version()


def test_factory_never_raises_and_imports_nothing_heavy(monkeypatch, entry_site):
    monkeypatch.delenv(ENV, raising=False)
    assert callbacks() == []
    monkeypatch.setenv(ENV, "1")
    (cb,) = callbacks()
    assert isinstance(cb, SinkWatchFabricCallback) and cb.config.every_n_steps == 250
    monkeypatch.setenv(ENV, json.dumps({"every_n_steps": 7, "max_steps": 20}))
    (cb,) = callbacks()
    assert cb.config.every_n_steps == 7 and cb.max_steps == 20
    for bad in ("{not json", '["every_n_steps"]', '{"every_n_steps": 0}', '{"probes": null}', '{"bogus": 1}'):
        monkeypatch.setenv(ENV, bad)
        with pytest.warns(RuntimeWarning, match="Fabric runs without sinkwatch"):
            assert callbacks() == []
    # through Fabric itself: a bad value still builds the Fabric; unset, no callback
    monkeypatch.syspath_prepend(str(entry_site))
    monkeypatch.setenv(ENV, "{bad")
    with pytest.warns(RuntimeWarning):
        assert not any(isinstance(c, SinkWatchFabricCallback) for c in Fabric(accelerator="cpu", devices=1)._callbacks)
    monkeypatch.setenv(ENV, "1")
    assert any(isinstance(c, SinkWatchFabricCallback) for c in Fabric(accelerator="cpu", devices=1)._callbacks)
    heavy = "('sinkwatch.fabric', 'sinkwatch.live', 'lightning')"
    code = f"import sys, sinkwatch.fabric_factory as f; f.callbacks(); print(sorted(m for m in sys.modules if m in {heavy}))"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "[]"


def test_arguments_and_refusals(tmp_path):
    from litgpt.model import GPT

    with pytest.raises(ValueError, match="max_steps"):
        SinkWatchFabricCallback(max_steps=0)
    with pytest.raises(ValueError, match="log_spaced needs max_steps"):
        SinkWatchFabricCallback(log_spaced=10)
    with pytest.raises(TypeError, match="unknown sinkwatch option"):
        SinkWatchFabricCallback(every_n_step=3)
    # a probe longer than the model's max_seq_length: refused at fabric.setup, not mid-run
    cb = SinkWatchFabricCallback(probes=[InductionProbe(n=4, seq_len=64)], out_dir=str(tmp_path), wandb="disabled")
    model = GPT(fh.tiny_config())
    model.max_seq_length = 32
    with pytest.raises(ValueError, match="longer than the model's max_seq_length 32"):
        Fabric(accelerator="cpu", devices=1, callbacks=[cb]).setup(model)
    # fabric.setup_module calls no hook: one warning at the first optimizer step, nothing probed, training goes on
    cb = SinkWatchFabricCallback(out_dir=str(tmp_path / "unset"), wandb="disabled")
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[cb])
    module = fabric.setup_module(GPT(fh.tiny_config()))
    opt = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.1))
    module(fh.dataset()[:2, :-1]).sum().backward()
    with pytest.warns(RuntimeWarning, match="setup_module calls no callback"):
        opt.step()
    assert not (tmp_path / "unset" / "records.jsonl").exists()
    # DeepSpeed and tensor parallelism (neither runs here: their strategies checked as Fabric hands them over)
    from lightning.fabric.strategies import ModelParallelStrategy

    from sinkwatch.fabric import _refuse_strategy

    with pytest.raises(ValueError, match="DeepSpeed"):
        _refuse_strategy(type("DeepSpeedStrategy", (), {})())
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        _refuse_strategy(ModelParallelStrategy(lambda m, mesh: m, data_parallel_size=1, tensor_parallel_size=2))


def test_step_from_the_optimizer_state():
    p = torch.nn.Parameter(torch.ones(2))
    adam = torch.optim.AdamW([p])
    assert optimizer_steps(adam) == 0
    for _ in range(3):
        p.grad = torch.ones(2)
        adam.step()
    assert optimizer_steps(adam) == 3
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(2)
    sgd.step()
    assert optimizer_steps(sgd) is None  # momentum only: no step count (the store's last record is used)


def test_litgpt_recipe_runs_from_a_scratch_directory(tmp_path, entry_site):
    """recipes/litgpt/pretrain.py, run from an empty directory with only the entry point installed: 4 steps
    of litgpt.pretrain.setup, records at 0, 2, 4 under --out (TORCHDYNAMO_DISABLE: inductor's C++ build of
    LitGPT's torch.compile takes minutes on 2 cores; compiled runs are tested above)."""
    recipe = fh.ROOT / "recipes" / "litgpt" / "pretrain.py"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update(PYTHONPATH=f"{fh.ROOT}{os.pathsep}{entry_site}", TORCHDYNAMO_DISABLE="1", WANDB_MODE="disabled")
    argv = ["--steps", "4", "--every", "2", "--batch-size", "2", "--seq-len", "64", "--layers", "2", "--d-model", "32"]
    argv += ["--wandb", "disabled", "--out", "run"]
    res = subprocess.run([sys.executable, str(recipe), *argv], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    records = read_jsonl(tmp_path / "run" / "sinkwatch" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4] and records[0]["model"] == "litgpt.recipe-llama"
    assert (tmp_path / "run" / "step-00000004" / "lit_model.pth").is_file()
