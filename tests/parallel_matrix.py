"""The parallel-layout matrix (tests/test_parallel_matrix.py): one torchrun launch runs several cells.

    python -m torch.distributed.run --nproc_per_node N tests/parallel_matrix.py OUT CELL [CELL ...]

Every cell trains a tiny model for a few steps on CPU (gloo) with the callback at its defaults
(natural probe on, W&B "auto" = an offline run; only ``every_n_steps`` scaled down), on data whose
first batch differs by rank (``rows``: lengths, padding, BOS). Each rank writes, under OUT/CELL:
``result-rank{r}.json`` (ok, or the error), ``first-rank{r}.pt`` (the first training batch it saw),
``natural-rank{r}.pt`` (the natural windows its monitor froze); rank 0 ``final.pt`` (the final
weights, gathered). The test compares the records with a single-process run of the same core on
rank 0's first batch and the final weights.

A watchdog guards each cell (``faulthandler.dump_traceback_later``: a hang dumps every thread's
stack and exits), the process group times out, and the launcher runs with
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` so mismatched collectives fail instead of pairing silently. A cell
whose probe forward broke (``ProbeForwardBroken``) ends the launch, as it would end a training run:
it goes last.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OLMO_SHARED_FS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sinkwatch.reporting.base import Reporter  # noqa: E402

CELL_TIMEOUT_S = 150  # one cell, every rank: past this the watchdog dumps the stacks and exits
VOCAB, BOS, PAD = 64, 0, 0
STEPS, EVERY = 4, 2  # probes at 0, 2, 4
BATCH = 4  # rows per rank and step
HEADS = 4  # every model here (GPT-2, Llama, OLMo-core) has 4 query heads per layer
FAULT_STEPS = 10  # the fault cell: probes at 0, 2, ..., 10, a fault at each of 2..8


# ---- data and models (the test builds the same ones in one process) ------------------------------
def rows(rank: int, n: int = 32) -> list[dict]:
    """Rank ``rank``'s own rows (each rank reads its own shard of the data, as with per-rank files or
    streams). Even ranks: BOS + 63 tokens, so every natural window starts with BOS (the BOS-free
    twin runs). Odd ranks: 72 tokens without BOS + 8 of right padding (mask 0)."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(n):
        if rank % 2 == 0:
            ids = torch.cat([torch.tensor([BOS]), torch.randint(1, VOCAB, (63,), generator=g)])
            mask = torch.ones(64, dtype=torch.int64)
        else:
            ids = torch.cat([torch.randint(1, VOCAB, (72,), generator=g), torch.full((8,), PAD)])
            mask = torch.cat([torch.ones(72, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)])
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def collate(items: list[dict]) -> dict:
    """Right-pad to the longest row; padded labels are -100."""
    T = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), T), PAD, dtype=torch.int64)
    mask = torch.zeros(len(items), T, dtype=torch.int64)
    for i, it in enumerate(items):
        n = len(it["input_ids"])
        ids[i, :n], mask[i, :n] = it["input_ids"], it["attention_mask"]
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def tiny_gpt2(seed: int = 0):
    """A 2-block GPT-2 (d 32, 4 heads) with a position-0 sink planted: position 0's embedding carries a
    large state along a fixed direction u (the P0 circuit, from block 0 on), and every head of block
    1 keys on u, so it sinks onto position 0 (stage "final" from the first probe: one event)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=4, bos_token_id=BOS, eos_token_id=BOS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    d, hd = 32, 8
    u = torch.randn(d, generator=torch.Generator().manual_seed(seed))
    u = u - u.mean()  # orthogonal to the all-ones vector: LayerNorm keeps it
    u = u / u.norm()
    with torch.no_grad():
        model.transformer.wpe.weight[0] += 20.0 * u
        attn = model.transformer.h[1].attn
        for h in range(4):  # head h: key coordinate h*hd reads u, its query holds a constant there
            attn.c_attn.weight[:, d + h * hd] += 3.0 * u
            attn.c_attn.bias[h * hd] += 3.0
    return model


def tiny_llama(seed: int = 0):
    """A 2-block Llama (d 32, 4 heads, 2 KV heads): nn.Linear projections, so it takes a TP plan."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=BOS, eos_token_id=BOS,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def tp_plan_llama(model, tp_mesh) -> None:
    """torch's Megatron-style plan on each block: q/k/v and gate/up column-wise, o/down row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(), "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }  # fmt: skip
        parallelize_module(layer, tp_mesh, plan)


def options(cell: Path) -> dict:
    """The callbacks' options: defaults, but the interval, the output directory and hooks that record
    which ranks call user code."""
    files = RankFiles(cell / "hooks")
    return {"every_n_steps": EVERY, "out_dir": str(cell / "sw"), "on_event": files.on_event, "reporters": [files]}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class RankFiles(Reporter):
    """A user reporter and ``on_event`` hook appending what they get to DIR/<what>-rank<R>.jsonl."""

    def __init__(self, dir: Path):
        self.dir = Path(dir)

    def _append(self, what: str, item: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"{what}-rank{_rank()}.jsonl", "a") as f:
            f.write(json.dumps({"step": item.get("step")}) + "\n")

    def log_record(self, record: dict) -> None:
        self._append("reporter", record)

    def on_event(self, event: dict) -> None:
        self._append("on_event", event)


def save_rank(cell: Path, live, first: dict | None) -> None:
    """This rank's first batch and the natural windows its monitor froze."""
    r = _rank()
    if first is not None:
        torch.save({k: v for k, v in first.items() if k in ("input_ids", "attention_mask")}, cell / f"first-rank{r}.pt")
    if live is not None and live.natural is not None:
        torch.save(live.natural.tokens, cell / f"natural-rank{r}.pt")


def save_final(cell: Path, state: dict) -> None:
    if _rank() == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, cell / "final.pt")


# ---- Lightning ------------------------------------------------------------------------------------
def _lightning_module(model, *, tp: bool = False, fsdp2: bool = False):
    import lightning.pytorch as pl

    class LitCausalLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def configure_model(self):  # ModelParallelStrategy calls it with its meshes
            if tp:
                tp_plan_llama(self.model, self.device_mesh["tensor_parallel"])
            if fsdp2:
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                blocks = self.model.transformer.h if hasattr(self.model, "transformer") else self.model.model.layers
                for block in blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return LitCausalLM()


def _fit_lightning(cell: Path, lit, strategy, *, tp: int = 1, precision: str = "32-true") -> tuple:
    """Fit on this rank's rows; ``tp`` ranks in a row form one tensor-parallel group, which reads one
    batch (the rows of its data-parallel index)."""
    import lightning.pytorch as pl

    from sinkwatch.lightning import SinkWatchCallback

    seen: dict = {}

    class FirstBatch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("first", {k: v.detach().clone() for k, v in batch.items()})

    cb = SinkWatchCallback(**options(cell))
    trainer = pl.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=STEPS, callbacks=[FirstBatch(), cb],
        precision=precision,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(cell),
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(rows(_rank() // tp), batch_size=BATCH, collate_fn=collate)
    try:
        trainer.fit(lit, loader)
    finally:
        save_rank(cell, cb.live, seen.get("first"))
    return trainer, cb


def lightning_ddp(cell: Path) -> None:
    lit = _lightning_module(tiny_gpt2())
    _fit_lightning(cell, lit, "ddp")
    save_final(cell, lit.model.state_dict())


def lightning_ddp_bf16(cell: Path) -> None:
    """DDP with ``precision="bf16-mixed"`` (CPU autocast in bf16): every rank probes its share in bf16."""
    lit = _lightning_module(tiny_gpt2())
    _fit_lightning(cell, lit, "ddp", precision="bf16-mixed")
    save_final(cell, lit.model.state_dict())


def lightning_fsdp2(cell: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    lit = _lightning_module(tiny_gpt2(), fsdp2=True)
    _fit_lightning(cell, lit, ModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1))
    save_final(cell, get_model_state_dict(lit.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))  # a collective


def lightning_tp_mesh(cell: Path) -> None:
    """A tensor-parallel mesh with no plan applied: whole models, so rank 0 probes alone; both ranks
    read their batches through a data-parallel sampler of size 1 (tokens count once)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    lit = _lightning_module(tiny_gpt2())
    _fit_lightning(
        cell, lit, ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=dist.get_world_size()), tp=dist.get_world_size()
    )
    save_final(cell, lit.model.state_dict())


def lightning_tp(cell: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    lit = _lightning_module(tiny_llama(), tp=True)
    _fit_lightning(
        cell, lit, ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=dist.get_world_size()), tp=dist.get_world_size()
    )


def lightning_fsdp2_tp(cell: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    lit = _lightning_module(tiny_llama(), tp=True, fsdp2=True)
    tp = dist.get_world_size() // 2
    _fit_lightning(cell, lit, ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=tp), tp=tp)


# ---- HF Trainer -----------------------------------------------------------------------------------
def _train_hf(cell: Path, model, **arguments) -> tuple:
    from transformers import Trainer, TrainingArguments

    from sinkwatch.hf import SinkWatchTrainerCallback

    seen: dict = {}

    def first_batch(module, args, kwargs):
        if module.training and "first" not in seen:
            seen["first"] = {k: kwargs[k].detach().clone() for k in ("input_ids", "attention_mask")}

    hook = model.register_forward_pre_hook(first_batch, with_kwargs=True)
    cb = SinkWatchTrainerCallback(**options(cell))
    args = TrainingArguments(
        output_dir=str(cell / "trainer"), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3,
        use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
        dataloader_num_workers=0, remove_unused_columns=False, **arguments,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows(_rank()), data_collator=collate, callbacks=[cb])
    try:
        trainer.train()
    finally:
        hook.remove()
        save_rank(cell, cb.live, seen.get("first"))
    return trainer, cb


def hf_ddp(cell: Path) -> None:
    model = tiny_gpt2()
    _train_hf(cell, model)
    save_final(cell, model.state_dict())


def hf_ddp_bf16(cell: Path) -> None:
    """DDP with ``TrainingArguments(bf16=True)`` (accelerate's CPU autocast in bf16)."""
    model = tiny_gpt2()
    _train_hf(cell, model, bf16=True)
    save_final(cell, model.state_dict())


def hf_tp_plan(cell: Path) -> None:
    """A real ``from_pretrained(tp_plan="auto")`` model. The HF Trainer itself refuses it on CPU
    (accelerate's ParallelismConfig wants GPUs), so the callback's hooks run here in the Trainer's
    order: ``on_train_begin``, a training forward (the hook that reads the first batch and would probe
    step 0), ``on_pre_optimizer_step``."""
    from transformers import LlamaForCausalLM, Trainer, TrainerControl, TrainerState, TrainingArguments

    from sinkwatch.hf import SinkWatchTrainerCallback

    path = cell / "llama"
    if _rank() == 0:
        tiny_llama().save_pretrained(path)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(path, tp_plan="auto")
    args = TrainingArguments(output_dir=str(cell / "trainer"), max_steps=STEPS, use_cpu=True, ddp_backend="gloo", report_to=[])
    try:
        Trainer(model=model, args=args, train_dataset=rows(0), data_collator=collate)
    except ValueError as exc:
        (cell / f"trainer-rank{_rank()}.txt").write_text(str(exc))
    cb = SinkWatchTrainerCallback(**options(cell))
    state = TrainerState(max_steps=STEPS, is_world_process_zero=_rank() == 0)
    cb.on_train_begin(args, state, TrainerControl(), model=model)
    model.train()
    model(**collate(rows(0)[:BATCH]))  # tensor-parallel peers read the same batch
    cb.on_pre_optimizer_step(args, state, TrainerControl())
    cb.on_train_end(args, state, TrainerControl())


# ---- FSDP v1 through the live core (Lightning's FSDPStrategy refuses CPU) ----------------------------
class _Wrapped(torch.nn.Module):
    """What a strategy puts inside its root FSDP unit: a module around the transformers model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch).loss


def _loop(cell: Path, root, inner, *, steps: int = STEPS, live_options: dict | None = None):
    """A plain training loop over this rank's rows with the live core wired the way the
    Lightning adapter wires it: ``batch_start``/``step_end(0)`` on the first batch, ``batch_end`` and
    ``step_end`` after each step, ``train_end``."""
    from sinkwatch.live import LiveConfig, LiveMonitor

    live = LiveMonitor(LiveConfig(**(live_options or options(cell))))
    live.setup(inner, is_global_zero=_rank() == 0, wrapped=root, max_steps=steps, world_size=dist.get_world_size())
    data = rows(_rank(), n=steps * BATCH)
    opt = torch.optim.SGD(root.parameters(), lr=1e-3)
    first = None
    try:
        for step in range(steps):
            batch = collate(data[step * BATCH : (step + 1) * BATCH])
            first = first or batch
            live.batch_start(batch)
            if step == 0:
                live.step_end(0)
            loss = root(**batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            live.batch_end(batch)
            live.step_end(step + 1)
        live.train_end(steps)
    finally:
        live.finish()
        save_rank(cell, live, first)
    return live


def _fsdp1(cell: Path, use_orig_params: bool, mixed_precision=None) -> None:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    model = tiny_gpt2()
    root = FSDP(
        _Wrapped(model), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), device_id=torch.device("cpu"), use_orig_params=use_orig_params,
        mixed_precision=mixed_precision,
    )  # fmt: skip
    shards = [p.numel() for p in root.parameters()]
    _loop(cell, root, root.module)
    # every probe gathered and gave back: the parameters are this rank's shards again
    assert [p.numel() for p in root.parameters()] == shards, "a probe left FSDP parameters unsharded"
    # offload_to_cpu=True segfaults in torch 2.13's CPU clone of the gathered tensors; on CPU there is nothing to offload
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
        full = root.state_dict()  # a collective
    save_final(cell, {k.removeprefix("model."): v for k, v in full.items()})


def fsdp1_orig_params(cell: Path) -> None:
    _fsdp1(cell, use_orig_params=True)


def fsdp1_flat_params(cell: Path) -> None:
    _fsdp1(cell, use_orig_params=False)


def fsdp1_bf16_params(cell: Path) -> None:
    """Parameter mixed precision as Lightning's ``FSDPStrategy(precision="bf16-mixed")`` and accelerate's
    ``mixed_precision="bf16"`` build it: float32 weights, each unit computing in bfloat16."""
    from torch.distributed.fsdp import MixedPrecision

    bf16 = torch.bfloat16
    _fsdp1(cell, use_orig_params=True, mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16))


# ---- faults on one rank of an FSDP2 run (the live core, so the steps are ours to name) --------------
def _fsdp2_loop(cell: Path, *, steps: int, live_options: dict | None = None, prepare=None):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = tiny_gpt2()
    if prepare is not None:
        prepare(model)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    wrapped = _Wrapped(model)
    live = _loop(cell, wrapped, model, steps=steps, live_options=live_options)
    save_final(cell, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    return live


def faults_held(cell: Path) -> None:
    """A fault on one rank at each agreed point, one per probe step: before (memory), inside the
    statistics, between two forwards, after; the probes between and after still run."""
    from sinkwatch.distributed import FAULT_ENV

    os.environ[FAULT_ENV] = "memory@1@2,stats@0@4,between@1@6,after@0@8"
    try:
        _fsdp2_loop(cell, steps=FAULT_STEPS)
    finally:
        del os.environ[FAULT_ENV]


def inputs_differ(cell: Path) -> None:
    """Rank 1's probe set cannot be built (ids outside the vocabulary: before any forward); then, in a
    second run, rank 1's probe set is valid but not rank 0's (the agreed config hashes differ)."""
    from sinkwatch import ProbeSet

    def natural(seed: int, high: int = VOCAB) -> ProbeSet:
        return ProbeSet("natural", torch.randint(1, high, (2, 16), generator=torch.Generator().manual_seed(seed)), {}, {})

    bad = ProbeSet("natural", torch.full((2, 16), 10_000), {}, {})
    for name, rank1 in (("unbuildable", bad), ("different", natural(1))):
        sub = cell / name
        sub.mkdir(exist_ok=True)
        _fsdp2_loop(sub, steps=2, live_options={**options(sub), "probes": [rank1 if _rank() == 1 else natural(0)]})


FAULT_TIMEOUT_S = 5.0  # the cells' wait for the other ranks' fault verdicts (LiveConfig.fault_timeout_s)


def fault_in_model_forward(cell: Path) -> None:
    """A fault inside the model's own forward on rank 1 (its middle block): the run must stop, within
    the fault verdict's timeout (rank 0 never posts a fault: it waits inside the block's all-gather)."""
    from sinkwatch.distributed import FAULT_ENV

    os.environ[FAULT_ENV] = "model@1@2"
    _fsdp2_loop(cell, steps=STEPS, live_options={**options(cell), "fault_timeout_s": FAULT_TIMEOUT_S})


def eval_only_fault(model) -> None:
    """A model whose blocks raise in eval mode only (trains, cannot be evaluated): block 1 raises
    the same RuntimeError at the same line on every rank."""

    def hook(module, args):
        if not module.training:
            raise RuntimeError("this block cannot run in eval mode")

    model.transformer.h[1].register_forward_pre_hook(hook)


def identical_faults(cell: Path) -> None:
    """Every rank raising the same fault at the same place of a sharded probe forward: in a probe
    (the injected model fault on both ranks at step 2) that probe is skipped everywhere and training
    goes on; before the first probe (a model that cannot run in eval mode) the pre-flight probe disables sinkwatch."""
    from sinkwatch.distributed import FAULT_ENV

    sub = cell / "in_probe"
    sub.mkdir(exist_ok=True)
    os.environ[FAULT_ENV] = "model@0@2,model@1@2"
    try:
        _fsdp2_loop(sub, steps=STEPS, live_options={**options(sub), "fault_timeout_s": FAULT_TIMEOUT_S})
    finally:
        del os.environ[FAULT_ENV]
    sub = cell / "preflight"
    sub.mkdir(exist_ok=True)
    live = _fsdp2_loop(sub, steps=STEPS, live_options={**options(sub), "fault_timeout_s": FAULT_TIMEOUT_S}, prepare=eval_only_fault)
    (sub / f"disabled-rank{_rank()}.txt").write_text(str(live.disabled))


# ---- settings real runs use -------------------------------------------------------------
def log_spaced_schedule(cell: Path) -> None:
    """Ranks whose trainers estimate different run lengths (unequal data: Lightning's
    ``estimated_stepping_batches`` per rank) must still probe the same log-spaced steps: rank 0's."""
    from sinkwatch.live import LiveConfig, LiveMonitor

    model = tiny_gpt2()
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    live = LiveMonitor(LiveConfig(**{**options(cell), "log_spaced": 5, "every_n_steps": None}))
    live.setup(model, is_global_zero=_rank() == 0, max_steps=10 if _rank() == 0 else 1000, world_size=dist.get_world_size())
    (cell / f"schedule-rank{_rank()}.json").write_text(json.dumps(sorted(live.schedule.log_steps)))
    live.finish()


# ---- OLMo-core ------------------------------------------------------------------------------------
def _olmo(cell: Path, dp: str, *, hsdp_replicas: int | None = None, compare: bool = False, autocast=None) -> None:
    import olmo_core.distributed.parallel as olmo_parallel
    from olmo_core.train.callbacks import Callback
    from olmo_core_helpers import build_trainer, metrics_log_callback, model_state, token_file

    from sinkwatch.olmo_core import SinkWatchCallback

    seen: dict = {}

    class FirstBatch(Callback):
        def pre_step(self, batch):
            seen.setdefault("first", {k: v.detach().clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})

    logged: dict[int, dict] = {}
    runs = ("plain", "watched") if compare else ("watched",)
    for name in runs:
        if _rank() == 0:
            (cell / name / "data").mkdir(parents=True, exist_ok=True)
            token_file(cell / name / "data", bos=BOS)
        dist.barrier()
    states = {}
    for name in runs:
        cbs = {"metrics": metrics_log_callback(logged)}
        if name == "watched":
            cbs["first"] = FirstBatch()
            cbs["sinkwatch"] = sw = SinkWatchCallback(**options(cell))
        olmo_parallel._WORLD_MESH = None  # OLMo-core builds one world mesh per process; this one trains twice
        trainer = build_trainer(
            cell / name, cbs, steps=STEPS, dp=dp, hsdp_replicas=hsdp_replicas, global_seqs=2 * dist.get_world_size(),
            autocast_precision=autocast,
        )  # fmt: skip
        try:
            trainer.fit()
        finally:
            if name == "watched":
                save_rank(cell, sw.live, seen.get("first"))
        states[name] = model_state(trainer)  # a collective under FSDP2
    save_final(cell, states["watched"])
    if _rank() == 0:
        from torch.distributed.fsdp import FSDPModule

        sharded = [type(m).__name__ for m in trainer.train_module.model.modules() if isinstance(m, FSDPModule)]
        same = {k: torch.equal(v, states["watched"][k]) for k, v in states["plain"].items()} if compare else None
        torch.save({"logged": logged, "sharded": sharded, "bit_identical": same}, cell / "olmo.pt")


def olmo_fsdp2(cell: Path) -> None:
    _olmo(cell, "fsdp", compare=True)


def olmo_fsdp2_bf16(cell: Path) -> None:
    """OLMo-core FSDP2 with ``autocast_precision=bfloat16``: every rank probes in bf16, as it trains."""
    _olmo(cell, "fsdp", autocast=torch.bfloat16)


def olmo_ddp(cell: Path) -> None:
    _olmo(cell, "ddp")


def olmo_hsdp(cell: Path) -> None:
    _olmo(cell, "hsdp", hsdp_replicas=2)


def olmo_refusals(cell: Path) -> None:
    """The parallelisms sinkwatch refuses for OLMo-core, applied for real on the whole mesh."""
    from olmo_core_helpers import model_config
    from torch.distributed.device_mesh import init_device_mesh

    from sinkwatch.capture import OLMoCoreTarget, UnsupportedModelError

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for kind in ("tensor", "context", "pipeline", "expert"):
        model = model_config(moe=kind == "expert").build(init_device="cpu")
        if kind == "tensor":
            model.apply_tp(mesh)
        elif kind == "context":
            from olmo_core.train.train_module.transformer.config import TransformerContextParallelConfig

            model.apply_cp(mesh, uly=TransformerContextParallelConfig.ulysses(degree=dist.get_world_size()).uly)  # ring needs flash
        elif kind == "pipeline":
            model.apply_pp(mesh)
        else:
            model.apply_ep(mesh)
        try:
            OLMoCoreTarget(model)
            out[kind] = "accepted"
        except UnsupportedModelError as exc:
            out[kind] = str(exc)
    if _rank() == 0:
        (cell / "refused.json").write_text(json.dumps(out))


# ---- the ZeRO-3 refusal of both adapters (no process group needed: deepspeed is not installable) ----
def zero3_model():
    """A model whose parameters carry the ``ds_id`` deepspeed.zero.Init puts on each partitioned one."""
    model = tiny_gpt2()
    for i, p in enumerate(model.parameters()):
        p.ds_id = i
    return model


# ---- the single-process side of each comparison (the test and tests/fsdp1_lightning.py) ------------
# the sharded forward gathers exactly the weights the single process holds; reductions may still be
# ordered differently (a DTensor all-gather hands back a fresh contiguous copy), so: float32 noise
RTOL, ATOL = 1e-5, 1e-6


def single_process_record(model, first: dict, tmp: Path, *, compute_dtype=None) -> dict:
    """The same live core in one process: rank 0's first batch freezes the natural windows, then one probe."""
    from sinkwatch.live import LiveConfig, LiveMonitor
    from sinkwatch.reporting.jsonl import read_jsonl

    live = LiveMonitor(LiveConfig(out_dir=str(tmp), wandb="disabled", console=False))
    live.setup(model, is_global_zero=True, compute_dtype=compute_dtype)
    live.batch_start(first)
    live.step_end(0)
    (record,) = read_jsonl(tmp / "records.jsonl")
    return record


# differ by design: where and when it ran, the tracker's history ("model" must match: capture names a
# model by its own class, never the "FSDP<class>" subclass fully_shard swaps in)
# the run's history and provenance, not this probe's measurement
TRACKED = {"step", "tokens", "probe_seconds", "p0_stage", "induction_state", "tracker_since_step", "stages_visited", "versions"}


def assert_records_equal(got: dict, want: dict, *, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert "error" not in got, got
    for key, value in want.items():
        if key in TRACKED:
            continue
        assert key in got, key
        if key.startswith("probe"):
            assert got[key] == value, key
        else:
            _assert_value_equal(got[key], value, key, rtol=rtol, atol=atol)


def _assert_value_equal(got, want, where: str, *, rtol: float, atol: float) -> None:
    """Strings, flags and None exactly; dicts and lists of dicts item by item (the anchor views, the stages
    visited); numbers within tolerance."""
    if isinstance(want, (str, bool)) or want is None:
        assert got == want, where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for sub, v in want.items():
            _assert_value_equal(got[sub], v, f"{where}.{sub}", rtol=rtol, atol=atol)
    elif isinstance(want, list) and want and isinstance(want[0], dict):  # the tracker's stages_visited
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_value_equal(g, w, f"{where}[{i}]", rtol=rtol, atol=atol)
    elif isinstance(want, list) and want and isinstance(np.array(want, dtype=object).flat[0], str):
        assert got == want, where
    else:
        np.testing.assert_allclose(np.array(got, dtype=float), np.array(want, dtype=float), rtol=rtol, atol=atol, err_msg=where)

CELLS = {
    f.__name__: f
    for f in (
        lightning_ddp, lightning_ddp_bf16, hf_ddp_bf16,
        lightning_fsdp2, lightning_tp_mesh, lightning_tp, lightning_fsdp2_tp, hf_ddp, hf_tp_plan, fsdp1_orig_params,
        fsdp1_flat_params, faults_held, inputs_differ, fault_in_model_forward, olmo_fsdp2, olmo_ddp, olmo_hsdp, olmo_refusals,
        log_spaced_schedule, fsdp1_bf16_params, identical_faults, olmo_fsdp2_bf16,
    )
}  # fmt: skip


def main(out: str, names: list[str]) -> None:
    from live_cells import CELLS as LIVE_CELLS

    CELLS.update(LIVE_CELLS)
    torch.set_num_threads(1)
    faulthandler.enable()  # a crash in native code prints the Python stack too
    # SINKWATCH_MATRIX_BACKEND: benchmarks/gpu_check.sh runs OLMo-core's default "cpu:gloo,cuda:nccl" (a CPU-only torch cannot)
    dist.init_process_group(os.environ.get("SINKWATCH_MATRIX_BACKEND", "gloo"), timeout=timedelta(seconds=CELL_TIMEOUT_S))
    for name in names:
        cell = Path(out) / name
        cell.mkdir(parents=True, exist_ok=True)
        faulthandler.dump_traceback_later(CELL_TIMEOUT_S, exit=True)  # a hang: every stack on stderr, then exit
        print(f"[rank {_rank()}] cell {name}", file=sys.stderr, flush=True)
        result = {"status": "ok"}
        t0 = time.monotonic()
        try:
            CELLS[name](cell)
        except Exception as exc:  # noqa: BLE001 - the test reads what each cell raised
            result = {"status": "error", "type": type(exc).__name__, "error": str(exc), "traceback": traceback.format_exc()}
        result["seconds"] = time.monotonic() - t0
        (cell / f"result-rank{_rank()}.json").write_text(json.dumps(result))
        if result.get("type") == "ProbeForwardBroken":
            os._exit(3)  # the other ranks wait inside the probe's collectives: the run ends here, as training would
        dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
