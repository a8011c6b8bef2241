"""torchtitan FSDP2 cells (tests/test_torchtitan_fsdp.py): one torchrun launch on 2 gloo processes.

    python -m torch.distributed.run --nproc_per_node 2 tests/torchtitan_cells.py OUT CELL [CELL ...]

A cell is a model family (``llama3``, ``qwen3``): torchtitan's own debug config for it
(``<family>_debugmodel()``: its loss, optimizer, LR schedule, activation checkpointing, spmd backend),
its real ``ParallelDims`` on a CPU mesh (dp_shard 2) and its own ``parallelize_fn`` (``apply_fsdp_to_decoder``
inside), then ``STEPS`` real ``Trainer.train_step`` calls on a trainer built the way torchtitan's unit
tests build one (``object.__new__``, then only what ``train_step`` touches). Every part ``train_step``
runs is real (``batch_generator``, ``post_dataloading_process``, ``forward_backward_step``, the loss,
``clip_grad_norm_``, the optimizer and LR scheduler) except the checkpointer and the metrics processor
(stand-ins: no checkpoint is written, nothing is logged but what is recorded), and FlexAttention where a
gradient is needed (CPU has no Flex backward: a dense masked SDPA, tests/torchtitan_helpers.py). Each
rank reads its own rows. The same steps run twice from the same initial weights and batches: with
``SinkWatchTrainer`` and with the stock ``Trainer``.

Writes under OUT/CELL: ``result-rank{r}.json`` (ok or the error, whether that rank's final shards equal
the stock run's, which steps that rank logged to ``metrics_processor.logger``), ``first-rank{r}.pt`` (the
first batch's inputs), ``natural-rank{r}.pt``, and on rank 0 ``initial.pt`` / ``final.pt`` (the full
weights, gathered) and ``sw/`` (the records). A watchdog (``faulthandler.dump_traceback_later``) ends a
hang with every stack on stderr; the process group times out too.
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
from unittest.mock import MagicMock

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchtitan_helpers as th  # noqa: E402

CELL_TIMEOUT_S = 120
STEPS, EVERY, BATCH, T = 3, 2, 2, 64  # probes at 0, 2, 3
LAYERS = 2  # two of the debug model's blocks (the same blocks, a shorter test)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def stock_config(family: str, *, bf16: bool = False, tp: bool = False, sp: bool = True):
    """torchtitan's own debug config for ``family``, shrunk: float32 parameters in FSDP's all-gather (so a
    probe can be compared with float32 weights in one process; ``bf16``: its default, bfloat16), a short
    run of short batches. ``tp``: tensor parallelism over the 2 ranks instead of FSDP, with torchtitan's
    default sequence parallelism (``sp`` False: without it)."""
    if family == "llama3":
        from torchtitan.models.llama3.config_registry import llama3_debugmodel as debugmodel
    else:
        from torchtitan.models.qwen3.config_registry import qwen3_debugmodel as debugmodel
    config = debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:LAYERS]
    config.training.steps, config.training.local_batch_size, config.training.seq_len = STEPS, BATCH, T
    config.training.mixed_precision_param = "bfloat16" if bf16 else "float32"
    # the default "spmd_types" backend hands fully_shard plain tensors with SPMD annotations, which torch 2.13's
    # fully_shard refuses at dp_shard > 1 ("all parameters must be DTensors"); "partial_dtensor" is its other FSDP path
    config.parallelism.spmd_backend = "partial_dtensor"
    if tp:
        config.parallelism.tensor_parallel_degree, config.parallelism.data_parallel_shard_degree = 2, 1
        config.parallelism.enable_sequence_parallel = sp
    return config


def rows(rank: int, vocab_size: int):
    """Rank ``rank``'s own batches, as torchtitan's loaders yield them: ({"input", "positions"}, labels)."""
    g = torch.Generator().manual_seed(3000 + rank)
    while True:
        ids = torch.randint(0, vocab_size, (BATCH, T + 1), generator=g)
        yield {"input": ids[:, :-1], "positions": torch.arange(T).expand(BATCH, T).clone()}, ids[:, 1:]


def build_trainer(cls, config, parallel_dims, cell: Path):
    """A ``cls`` (Trainer or SinkWatchTrainer) with what ``train_step`` touches, built as
    ``Trainer.__init__`` builds it (minus the device, the dataloader, the checkpointer and the metrics)."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import utils as dist_utils

    spec = config.model_spec
    if config.parallelism.tensor_parallel_degree > 1:  # as Trainer.__init__ (the loss-parallel loss asserts it)
        dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    model_config = spec.model
    model_config.update_from_config(config=config)  # as Trainer.__init__: RoPE caches, the sharding config
    torch.manual_seed(0)  # the same initial weights on every rank and in both runs
    model = model_config.build()
    model.init_states()
    model = spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism, compile_config=config.compile,
        ac_config=config.activation_checkpoint, dump_folder=str(cell),
    )  # fmt: skip
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():  # torchtitan divides gradients itself (factor 1: PREMUL_SUM, which gloo lacks); SUM is the same sum
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.train()
    trainer = object.__new__(cls)
    trainer.config, trainer.parallel_dims, trainer.model_config = config, parallel_dims, model_config
    trainer.device = torch.device("cpu")
    trainer.model_parts = [model]
    trainer.loss_fn = config.loss.build(compile_config=config.compile)
    if isinstance(trainer.loss_fn, ChunkedLossWrapper):  # as Trainer.__init__: the loss applies lm_head, the model skips it
        trainer.loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    trainer.optimizers = config.optimizer.build(model_parts=trainer.model_parts)
    trainer.lr_schedulers = config.lr_scheduler.build(optimizers=trainer.optimizers, training_steps=config.training.steps)
    trainer.checkpointer = MagicMock()
    trainer.metrics_processor = MagicMock()
    trainer.metrics_processor.should_log.return_value = True  # the loss reductions over the loss mesh run too
    trainer.step, trainer.ntokens_seen = 0, 0
    trainer.gradient_accumulation_steps, trainer.num_pipeline_parallel_microbatches = 1, 1
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=False)
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    return trainer


def params(model) -> dict:
    """The parameters by name, as an unwrapped model names them (activation checkpointing's wrapper left out;
    not ``state_dict()``: the fused QKV linear renames its weight there)."""
    return {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}


def full_params(model) -> dict:
    """Every parameter gathered whole (a collective per sharded one), on CPU."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in params(model).items()}


def data_rank(parallel_dims) -> int:
    """The rank whose rows this rank reads: its own under data parallelism, its replica's under tensor parallelism
    (tensor-parallel peers read the same rows, as torchtitan's loaders give them)."""
    batch = parallel_dims.get_optional_mesh("batch")
    return batch.get_local_rank() if batch is not None else 0


def train(trainer, vocab_size: int):
    data = trainer.batch_generator(rows(data_rank(trainer.parallel_dims), vocab_size))
    for step in range(1, STEPS + 1):
        trainer.step = step
        trainer.train_step(data)


def family_cell(cell: Path, name: str) -> dict:
    """``<family>``: both runs, everything saved; ``<family>_bf16``: FSDP's default bfloat16 parameter mixed
    precision, the SinkWatchTrainer run alone (its records)."""
    family, bf16, tp, sp = name.split("_")[0], name.endswith("_bf16"), "_tp" in name, not name.endswith("_nosp")
    import torchtitan.distributed.parallel_dims as pdims
    from torchtitan.distributed import ParallelDims
    from torchtitan.trainer import Trainer

    from sinkwatch.torchtitan import SinkWatchTrainer, sinkwatch_config

    pdims.device_type = "cpu"  # torchtitan falls back to "cuda" where no accelerator is found; the mesh here is CPU (gloo)
    th.eager_flex(trainable=True)
    stock = stock_config(family, bf16=bf16, tp=tp, sp=sp)
    parallel_dims = ParallelDims.from_config(stock.parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    V = stock.model_spec.model.vocab_size

    options = {"every_n_steps": EVERY, "out_dir": str(cell / "sw"), "wandb": "disabled", "console": False, "raise_on_error": True}
    config = sinkwatch_config(stock_config(family, bf16=bf16, tp=tp, sp=sp), **options)
    trainer = build_trainer(SinkWatchTrainer, config, parallel_dims, cell)
    initial = full_params(trainer.model_parts[0])
    trainer.sinkwatch_setup()
    th.use_small_probes(trainer.sinkwatch)
    train(trainer, V)
    logged = [c.args[1] for c in trainer.metrics_processor.logger.log.call_args_list]
    if bf16:
        return {"logged_steps": logged}

    plain = build_trainer(Trainer, stock, parallel_dims, cell)
    train(plain, V)

    a, b = params(trainer.model_parts[0]), params(plain.model_parts[0])
    same = sorted(a) == sorted(b) and all(torch.equal(a[k].to_local(), b[k].to_local()) for k in a)  # this rank's shards
    final = full_params(trainer.model_parts[0])
    live = trainer.sinkwatch
    torch.save(live.natural.tokens, cell / f"natural-rank{_rank()}.pt")
    first = next(rows(data_rank(parallel_dims), V))[0]["input"]
    torch.save(first, cell / f"first-rank{_rank()}.pt")
    if _rank() == 0:
        torch.save(initial, cell / "initial.pt")
        torch.save(final, cell / "final.pt")
    sharded = sorted({type(m).__name__ for m in trainer.model_parts[0].modules() if "FSDP" in type(m).__name__})
    return {"same_as_stock": same, "logged_steps": logged, "sharded": sharded, "skip_lm_head": trainer.model_parts[0]._skip_lm_head}


def main(out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    faulthandler.enable()
    dist.init_process_group("gloo", timeout=timedelta(seconds=CELL_TIMEOUT_S))
    for name in names:
        cell = Path(out) / name
        cell.mkdir(parents=True, exist_ok=True)
        faulthandler.dump_traceback_later(CELL_TIMEOUT_S, exit=True)
        print(f"[rank {_rank()}] cell {name}", file=sys.stderr, flush=True)
        result = {"status": "ok"}
        t0 = time.monotonic()
        try:
            result.update(family_cell(cell, name))
        except Exception as exc:  # noqa: BLE001 - the test reads what each cell raised
            result = {"status": "error", "type": type(exc).__name__, "error": str(exc), "traceback": traceback.format_exc()}
        result["seconds"] = time.monotonic() - t0
        (cell / f"result-rank{_rank()}.json").write_text(json.dumps(result))
        dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
