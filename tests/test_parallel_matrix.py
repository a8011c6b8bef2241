"""Every parallel layout × framework, with the callbacks at their defaults (natural probe on; only the
interval scaled down) and first batches that differ by rank (lengths, padding, BOS): each cell either
equals a single-process run of the same core on rank 0's first batch and the final weights, or
refuses at setup with a clear error on every rank. Never a hang (each cell under a watchdog that dumps
every stack, each launch under a timeout, ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` where torch allows it,
so mismatched collectives fail) and never partial heads. The cells run in tests/parallel_matrix.py:
three torchrun launches, started together and each running several cells.

Every data-parallel cell splits the probe (``LiveConfig(split_probe=True)``, the default): each rank
runs its share of the sequences and one all-reduce combines them, so "equals a single-process run"
checks the split too (tests/test_probe_split.py checks it at W = 3, with uneven shares and bf16).

``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps the process group in a checker that torch 2.13's
DistributedDataParallel crashes on (a segfault in its constructor on CPU), so the DDP cells run in
their own launch without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torchrun import torchrun

from sinkwatch.live import LiveConfig, log_spaced_steps
from sinkwatch.probes import natural_windows
from sinkwatch.reporting.jsonl import read_jsonl

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import parallel_matrix as pm  # noqa: E402

LAUNCH_TIMEOUT_S = 540

LAUNCHES = {  # name: (processes, DETAIL, cells in order; a cell that must end its launch goes last)
    "sharded": (2, True, ["lightning_fsdp2", "lightning_tp", "lightning_tp_mesh", "hf_tp_plan", "fsdp1_orig_params", "fsdp1_flat_params",
                          "inputs_differ", "faults_held", "olmo_fsdp2", "olmo_refusals", "log_spaced_schedule", "fsdp1_bf16_params",
                          "identical_faults", "olmo_fsdp2_bf16",
                          "fault_in_model_forward"]),
    "ddp": (2, False, ["lightning_ddp", "hf_ddp", "olmo_ddp", "lightning_ddp_bf16", "hf_ddp_bf16"]),
    "four": (4, True, ["lightning_fsdp2_tp", "olmo_hsdp"]),
    "step0": (2, True, ["hf_fsdp1_bf16_step0", "hf_shard_grad_op_step0", "hf_fsdp2_step0"]),
}  # fmt: skip
WHERE = {cell: name for name, (_, _, cells) in LAUNCHES.items() for cell in cells}
SHARDED = {"lightning_fsdp2", "fsdp1_orig_params", "fsdp1_flat_params", "olmo_fsdp2", "olmo_hsdp", "faults_held"}  # every rank probes
SPLIT = SHARDED | {"lightning_ddp", "hf_ddp", "olmo_ddp"}  # every data-parallel rank probes its share of the sequences
EQUAL = ["lightning_ddp", "lightning_fsdp2", "lightning_tp_mesh", "hf_ddp", "fsdp1_orig_params", "fsdp1_flat_params", "olmo_fsdp2",
         "olmo_ddp", "olmo_hsdp"]  # fmt: skip
REFUSED_TP = ["lightning_tp", "lightning_fsdp2_tp", "hf_tp_plan"]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """The three launches, started together (they wait on each other's collectives less than on the
    CPU); returns {launch: (out dir, return code, output)}."""
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "WANDB_MODE": "offline",
        "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    running = {}
    for name, (nproc, detail, cells) in LAUNCHES.items():
        out = tmp_path_factory.mktemp(name)
        log = open(out / "launch.log", "w")
        run_env = (
            {**env, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if detail else {k: v for k, v in env.items() if k != "TORCH_DISTRIBUTED_DEBUG"}
        )
        cmd = torchrun(HERE / "parallel_matrix.py", str(out), *cells, nproc=nproc)
        running[name] = (out, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env, start_new_session=True))
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    done = {}
    for name, (out, log, proc) in running.items():
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
            rc = proc.wait()
        log.close()
        done[name] = (out, rc, (out / "launch.log").read_text())
    return done


def cell_dir(matrix, cell: str) -> Path:
    out, rc, output = matrix[WHERE[cell]]
    d = out / cell
    nproc = LAUNCHES[WHERE[cell]][0]
    missing = [r for r in range(nproc) if not (d / f"result-rank{r}.json").exists()]
    assert not missing, (
        f"{cell}: ranks {missing} never finished (launch rc {rc}: a hang shows the watchdog's stack dumps)\n{output[-6000:]}"
    )
    return d


def results(d: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(d.glob("result-rank*.json"))]


def final_model(cell: str, d: Path):
    state = torch.load(d / "final.pt", weights_only=True)
    if cell.startswith("olmo"):
        from olmo_core_helpers import model_config

        model = model_config().build(init_device="cpu")
    else:
        model = pm.tiny_gpt2()
    model.load_state_dict(state)
    return model.eval()


def first_batch(d: Path, rank: int) -> dict:
    return torch.load(d / f"first-rank{rank}.pt", weights_only=True)


def own_windows(d: Path, rank: int, context: int | None = 128) -> torch.Tensor:
    """The natural windows ``rank`` would freeze from its own first batch (the callback's rule)."""
    batch = first_batch(d, rank)
    ids = batch["input_ids"]
    T = min(LiveConfig().natural_seq_len, ids.shape[1], context or ids.shape[1])
    return natural_windows(ids, T, LiveConfig().natural_n, attention_mask=batch.get("attention_mask"))


@pytest.mark.parametrize("cell", EQUAL)
def test_cell_equals_a_single_process_run_on_rank0s_windows(matrix, cell, tmp_path):
    d = cell_dir(matrix, cell)
    for r in results(d):
        assert r["status"] == "ok", r.get("traceback")
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r.get("step") for r in records] == [0, pm.EVERY, pm.STEPS], records  # once each: rank 0 alone writes
    model = final_model(cell, d)
    assert {r["n_heads"] for r in records} == {pm.HEADS}  # whole heads, never a rank's share
    context = 128 if not cell.startswith("olmo") else None
    nproc = LAUNCHES[WHERE[cell]][0]
    windows = own_windows(d, 0, context)
    assert torch.equal(torch.load(d / "natural-rank0.pt"), windows)  # rank 0 froze its own first batch's windows
    if cell in SPLIT:  # every rank probes its share of the sequences, combined by one all-reduce
        assert all(r["probe_split"]["ranks"] == nproc for r in records), [r.get("probe_split") for r in records]
    else:  # a tensor-parallel mesh of whole models: one data-parallel rank, rank 0 probes alone
        assert not any("probe_split" in r for r in records)
    if cell in SPLIT:  # every rank took rank 0's windows, though its own batch differs
        for r in range(1, nproc):
            assert torch.equal(torch.load(d / f"natural-rank{r}.pt"), windows), r
        others = [own_windows(d, r, context) for r in range(1, nproc)]
        assert any(w.shape != windows.shape or not torch.equal(w, windows) for w in others)  # the data did differ
    pm.assert_records_equal(records[-1], pm.single_process_record(model, first_batch(d, 0), tmp_path))


@pytest.mark.parametrize("cell", REFUSED_TP)
def test_tensor_parallel_is_refused_at_setup_on_every_rank(matrix, cell):
    d = cell_dir(matrix, cell)
    for r in results(d):
        assert r["status"] == "error" and r["type"] == "ValueError", r
        assert "tensor-parallel" in r["error"] and "sinkwatch replay" in r["error"] and "FSDP2" in r["error"], r["error"]
    assert not read_jsonl(d / "sw" / "records.jsonl")  # refused before any probe
    if cell == "hf_tp_plan":  # the HF Trainer itself refuses a tp_plan model on CPU: the callback's hooks ran without it
        assert "ParallelismConfig" in (d / "trainer-rank0.txt").read_text()


@pytest.mark.parametrize("cell", ["lightning_ddp", "lightning_fsdp2", "hf_ddp"])
def test_only_global_rank_zero_reports(matrix, cell):
    """One record set, one W&B run, one event; the user's hook and reporter run on rank 0 only (under
    FSDP2 every rank probes and sees the events)."""
    d = cell_dir(matrix, cell)
    events = read_jsonl(d / "sw" / "events.jsonl")
    assert [(e["previous"], e["stage"], e["step"]) for e in events] == [("none", "final", pm.EVERY)]
    assert len(list((d / "sw" / "wandb").glob("offline-run-*"))) == 1
    assert sorted(p.name for p in (d / "hooks").iterdir()) == ["on_event-rank0.jsonl", "reporter-rank0.jsonl"]
    assert [e["step"] for e in read_jsonl(d / "hooks" / "on_event-rank0.jsonl")] == [pm.EVERY]
    assert [r["step"] for r in read_jsonl(d / "hooks" / "reporter-rank0.jsonl")] == [0, pm.EVERY, pm.STEPS]


@pytest.mark.parametrize("cell", ["lightning_ddp", "lightning_fsdp2", "lightning_tp_mesh", "olmo_fsdp2", "olmo_hsdp"])
def test_tokens_count_each_data_parallel_rank_once(matrix, cell):
    """Tokens: Lightning counts rank 0's batch times the data-parallel size (tensor-parallel peers read
    the same batch); OLMo-core's trainer counts the global batch itself."""
    d = cell_dir(matrix, cell)
    nproc = LAUNCHES[WHERE[cell]][0]
    if cell.startswith("olmo"):
        per_step = first_batch(d, 0)["input_ids"].numel() * nproc
    else:
        per_step = first_batch(d, 0)["input_ids"].numel() * (1 if cell == "lightning_tp_mesh" else nproc)
    assert [r["tokens"] for r in read_jsonl(d / "sw" / "records.jsonl")] == [0, pm.EVERY * per_step, pm.STEPS * per_step]


def test_olmo_core_fsdp2_trains_bit_identically_and_logs_through_the_trainer(matrix):
    d = cell_dir(matrix, "olmo_fsdp2")
    olmo = torch.load(d / "olmo.pt", weights_only=False)
    assert "FSDPTransformer" in olmo["sharded"] and len(olmo["sharded"]) >= 3  # the root and each block
    assert olmo["bit_identical"] and all(olmo["bit_identical"].values())
    assert {s: m["sinkwatch/step"] for s, m in olmo["logged"].items()} == {1: 0, 2: 2, 4: 4}


@pytest.mark.parametrize("kind", ["tensor", "context", "pipeline", "expert"])
def test_olmo_core_parallelisms_that_split_attention_are_refused(matrix, kind):
    message = json.loads((cell_dir(matrix, "olmo_refusals") / "refused.json").read_text())[kind]
    assert f"{kind} parallelism" in message and "sinkwatch" in message


def test_a_fault_on_one_rank_at_each_agreed_point_skips_that_probe_everywhere(matrix, tmp_path):
    """memory (rank 1, before), stats (rank 0, inside a forward: held until it ends), between (rank 1,
    after a forward), after (rank 0, before anything is written): each probe is one error line naming
    the rank and the fault, no rank writes it or counts it, and the ranks stay in step (the last
    probe equals a single-process run)."""
    d = cell_dir(matrix, "faults_held")
    assert all(r["status"] == "ok" for r in results(d))
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4, 6, 8, pm.FAULT_STEPS]
    for rec, (rank, point) in zip(records[1:5], [(1, "memory"), (0, "stats"), (1, "between"), (0, "after")]):
        assert f"rank {rank}: InjectedFault: test fault injected at '{point}'" in rec["error"], rec
        assert "no rank wrote it" in rec["error"]
    # the tracker skipped the failed probes: "final" holds at 0 and 10, so patience 2 declares it at 10
    assert [(e["stage"], e["step"]) for e in read_jsonl(d / "sw" / "events.jsonl")] == [("final", pm.FAULT_STEPS)]
    pm.assert_records_equal(records[-1], pm.single_process_record(final_model("faults_held", d), first_batch(d, 0), tmp_path))


def test_probe_sets_that_differ_between_ranks_stop_every_rank_before_the_forward(matrix):
    """Checked before any probe collective: a probe set rank 1 cannot build (named in the error line), and
    probe sets that differ (the config hashes every rank sends disagree); training goes on either way."""
    d = cell_dir(matrix, "inputs_differ")
    assert all(r["status"] == "ok" for r in results(d))
    unbuildable = read_jsonl(d / "unbuildable" / "sw" / "records.jsonl")
    assert [r["step"] for r in unbuildable] == [0, 2]
    assert all("rank 1: ValueError" in r["error"] and "vocabulary" in r["error"] for r in unbuildable), unbuildable
    different = read_jsonl(d / "different" / "sw" / "records.jsonl")
    assert [r["step"] for r in different] == [0, 2]
    assert all("probe sets or thresholds differ (config_hash rank 0: " in r["error"] for r in different), different


def test_a_fault_inside_the_models_own_forward_stops_the_run(matrix):
    """Rank 1 fails inside its probe forward while rank 0 waits in that forward's all-gather: rank 1
    raises ProbeForwardBroken (the run ends: the launch exits, the launcher stops rank 0) instead of
    going on to collectives that would pair with the wrong ones; nothing hangs."""
    out, rc, output = matrix["sharded"]
    assert rc != 0
    (result,) = [json.loads((out / "fault_in_model_forward" / "result-rank1.json").read_text())]
    assert result["type"] == "ProbeForwardBroken" and "rank 1" in result["error"] and "Resume from the last checkpoint" in result["error"]
    # bounded: rank 1 waited the fault verdict's timeout for a fault rank 0 never posted (it is inside the all-gather)
    assert f"ranks [0] raised no fault there within {pm.FAULT_TIMEOUT_S:g} s" in result["error"], result["error"]
    assert result["seconds"] < pm.CELL_TIMEOUT_S / 2, result["seconds"]
    assert [r["step"] for r in read_jsonl(out / "fault_in_model_forward" / "sw" / "records.jsonl")] == [0]


# ---- ZeRO-3: one check refuses it in every adapter (deepspeed is not installable here: parameters
# carry the ``ds_id`` that deepspeed.zero.Init puts on each partitioned one, as the real engine's do) ----
def test_zero3_is_refused_by_the_lightning_callback(tmp_path):
    import lightning.pytorch as pl

    from sinkwatch.lightning import SinkWatchCallback

    lit = pm._lightning_module(pm.zero3_model())
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, callbacks=[SinkWatchCallback(**pm.options(tmp_path))], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    with pytest.raises(ValueError, match="ZeRO-3.*ZeRO stage 1 or 2"):
        trainer.fit(lit, torch.utils.data.DataLoader(pm.rows(0), batch_size=pm.BATCH, collate_fn=pm.collate))
    assert not read_jsonl(tmp_path / "sw" / "records.jsonl")


def test_zero3_is_refused_by_the_hf_callback(tmp_path):
    from transformers import Trainer, TrainingArguments

    from sinkwatch.hf import SinkWatchTrainerCallback

    args = TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=2, per_device_train_batch_size=pm.BATCH, use_cpu=True, report_to=[])
    trainer = Trainer(
        model=pm.zero3_model(), args=args, train_dataset=pm.rows(0), data_collator=pm.collate,
        callbacks=[SinkWatchTrainerCallback(**pm.options(tmp_path))],
    )  # fmt: skip
    with pytest.raises(ValueError, match="ZeRO-3.*ZeRO stage 1 or 2"):
        trainer.train()
    assert not read_jsonl(tmp_path / "sw" / "records.jsonl")


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next"])
def test_the_sharded_probe_path_passes_every_capture_hook_through(family):
    """Ranks that probe together run through distributed.GroupForwards, whose collector wrapper holds
    statistics faults: it must hand on every hook of capture's Collector (learned sinks, gates, the
    gated head output), so a sharded gpt-oss or Qwen3-Next record equals the plain probe's."""
    import families
    import numpy as np

    from sinkwatch import InductionProbe, Monitor, RepeatedRandomProbe
    from sinkwatch.capture import resolve_target
    from sinkwatch.distributed import GroupForwards, ProbeGroup

    model = families.build(family)
    probes = [InductionProbe(n=6, seq_len=64, vocab_range=(2, 250)), RepeatedRandomProbe(n=4, seq_len=32, vocab_range=(2, 250))]
    plain = Monitor(probes).probe(model).to_record()
    guarded = Monitor(probes).probe(GroupForwards(resolve_target(model), ProbeGroup(1), step=0, token=1)).to_record()
    keys = ["sink_alpha", "pr", "induction_score", "sink_learned_alpha" if family == "gpt_oss" else "attn_gate_mean"]
    for key in keys:
        assert key in plain, key
        np.testing.assert_array_equal(np.array(guarded[key], dtype=float), np.array(plain[key], dtype=float), err_msg=key)


def test_the_fault_holding_wrapper_has_every_hook_of_the_collector_protocol():
    """A hook missing from the wrapper is silently lost on every sharded probe (the fused-attention hook
    was: the group's statistics made a second pass and differed from the plain probe in the 7th digit)."""
    from sinkwatch.capture.session import Collector
    from sinkwatch.distributed.forwards import _HeldFaults

    hooks = {name for name in vars(Collector) if name.startswith("on_")}
    assert hooks and hooks <= set(vars(_HeldFaults)), sorted(hooks - set(vars(_HeldFaults)))


def test_log_spaced_steps_are_rank_0s_on_every_rank(matrix):
    """Rank 0 plans 10 steps, rank 1 1000 (unequal data): both probe rank 0's log-spaced steps."""
    d = cell_dir(matrix, "log_spaced_schedule")
    assert all(r["status"] == "ok" for r in results(d)), results(d)
    schedules = [json.loads((d / f"schedule-rank{r}.json").read_text()) for r in range(2)]
    assert schedules[0] == schedules[1] == sorted(log_spaced_steps(5, 10)), schedules


def test_fsdp1_bf16_parameter_mixed_precision_probes_in_bf16(matrix, tmp_path):
    """FSDP v1 with MixedPrecision(param_dtype=bf16) over float32 weights (Lightning's FSDPStrategy
    "bf16-mixed", accelerate's mixed_precision="bf16"): every probe is written (before the fix each run
    stopped at step 0 with ProbeForwardBroken: block 0 met float32 activations with bf16 weights), in
    bf16, equal within bf16 tolerance to a single process probing the final weights cast to bf16."""
    d = cell_dir(matrix, "fsdp1_bf16_params")
    for r in results(d):
        assert r["status"] == "ok", r.get("traceback")
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r.get("step") for r in records] == [0, pm.EVERY, pm.STEPS], records
    assert {r["probe_dtype"] for r in records} == {"bfloat16"}
    model = final_model("fsdp1_bf16_params", d).to(torch.bfloat16)
    pm.assert_records_equal(records[-1], pm.single_process_record(model, first_batch(d, 0), tmp_path), rtol=1e-2, atol=1e-2)


def test_the_same_fault_on_every_rank_skips_the_probe_and_training_goes_on(matrix, tmp_path):
    """Both ranks raise the same fault at the same line inside a sharded probe forward (before: every
    rank raised ProbeForwardBroken and the run stopped). The verdict, on the c10d store, sees the same
    fault everywhere: the probe is one error line, training goes on, the next probe equals a single
    process on the final weights."""
    d = cell_dir(matrix, "identical_faults")
    assert all(r["status"] == "ok" for r in results(d)), results(d)
    records = read_jsonl(d / "in_probe" / "sw" / "records.jsonl")
    assert [r["step"] for r in records] == [0, pm.EVERY, pm.STEPS]
    assert "error" not in records[0] and "error" not in records[2]
    for rank in (0, 1):
        assert f"rank {rank}: ProbeFaultEverywhere: every rank raised the same fault" in records[1]["error"], records[1]
    pm.assert_records_equal(
        records[-1], pm.single_process_record(final_model("identical_faults", d / "in_probe"), first_batch(d / "in_probe", 0), tmp_path)
    )


def test_a_deterministic_error_in_the_preflight_probe_disables_sinkwatch_and_training_goes_on(matrix):
    """A model that cannot run in eval mode (before: ProbeForwardBroken at the step-0 probe, the run
    stopped): the pre-flight probe (before the first probe) fails the same way on both ranks; one error line, no probe."""
    d = cell_dir(matrix, "identical_faults") / "preflight"
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert len(records) == 1 and records[0]["step"] is None, records
    assert (
        "sinkwatch is disabled for this run" in records[0]["error"]
        and "RuntimeError: this block cannot run in eval mode" in records[0]["error"]
    )
    for rank in (0, 1):
        assert "disabled for this run" in (d / f"disabled-rank{rank}.txt").read_text()
    assert (d / "final.pt").exists()  # training ran to the end


def test_olmo_core_fsdp2_bf16_autocast_probes_in_bf16(matrix, tmp_path):
    """OLMo-core FSDP2 with autocast_precision=bf16: records in bf16 (before: float32 under a bf16 run),
    equal within bf16 tolerance to one process probing the final weights under bf16 autocast."""
    d = cell_dir(matrix, "olmo_fsdp2_bf16")
    for r in results(d):
        assert r["status"] == "ok", r.get("traceback")
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r.get("step") for r in records] == [0, pm.EVERY, pm.STEPS], records
    assert {r["probe_dtype"] for r in records} == {"bfloat16"}
    want = pm.single_process_record(final_model("olmo_fsdp2_bf16", d), first_batch(d, 0), tmp_path, compute_dtype=torch.bfloat16)
    pm.assert_records_equal(records[-1], want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cell", ["lightning_ddp_bf16", "hf_ddp_bf16"])
def test_ddp_bf16_mixed_probes_each_ranks_share_in_bf16(matrix, cell, tmp_path):
    """Lightning ``precision="bf16-mixed"`` and the HF Trainer's ``bf16=True`` under DDP (CPU autocast):
    records in bf16 (``probe_dtype``), split over both ranks, equal within bf16 tolerance to one
    process probing the final weights under bf16 autocast."""
    d = cell_dir(matrix, cell)
    for r in results(d):
        assert r["status"] == "ok", r.get("traceback")
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r.get("step") for r in records] == [0, pm.EVERY, pm.STEPS], records
    assert {r["probe_dtype"] for r in records} == {"bfloat16"}
    assert {r["probe_split"]["ranks"] for r in records} == {2}
    want = pm.single_process_record(final_model(cell, d), first_batch(d, 0), tmp_path, compute_dtype=torch.bfloat16)
    pm.assert_records_equal(records[-1], want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cell", ["hf_fsdp1_bf16_step0", "hf_shard_grad_op_step0", "hf_fsdp2_step0"])
def test_the_hf_step0_probe_under_fsdp_leaves_training_bit_identical(matrix, cell, tmp_path):
    """The HF callback's step-0 probe (once the first batch is read) at FSDP v1 bf16 parameter mixed
    precision, SHARD_GRAD_OP and FSDP2: losses and final weights equal an unmonitored run's exactly.
    Before, the probe ran after the first backward and before optimizer.step() and left parameters
    unsharded: step 2 trained on pre-update weights (every weight differed from the second loss on)."""
    d = cell_dir(matrix, cell)
    for r in results(d):
        assert r["status"] == "ok", r.get("traceback")
    same = json.loads((d / "identical.json").read_text())
    assert same["losses"] == same["plain_losses"], same
    assert all(same["weights_identical"].values()), [k for k, v in same["weights_identical"].items() if not v]
    records = read_jsonl(d / "sw" / "records.jsonl")
    assert [r.get("step") for r in records] == [0, pm.EVERY, pm.STEPS], records
    model = final_model(cell, d)
    if "bf16" in cell:  # the units compute with bf16 weights (parameter mixed precision): one process with the weights in bf16
        assert {r["probe_dtype"] for r in records} == {"bfloat16"}
        model = model.to(torch.bfloat16)
    want = pm.single_process_record(model, first_batch(d, 0), tmp_path)
    pm.assert_records_equal(records[-1], want, **({"rtol": 1e-2, "atol": 1e-2} if "bf16" in cell else {}))
