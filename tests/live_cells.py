"""Parallel-matrix cells for where a probe may run (tests/test_parallel_matrix.py, the ``step0`` launch).

The HF Trainer and Fabric callbacks probe step 0 once the first training batch is read. Under FSDP a
probe forward unshards parameters; a probe between the first backward and ``optimizer.step()`` left
them unsharded (FSDP v1's root under parameter mixed precision, every unit under ``SHARD_GRAD_OP``,
FSDP2's root), the optimizer updated the shards, and the next forward skipped its unshard: step 2
trained on pre-update weights. Each cell trains the same model twice from the same seed, once
unmonitored and once watched, and records whether the losses and the final weights are bit-identical.

accelerate turns FSDP off on CPU (``AcceleratorState`` enables it for GPU types only), so the HF cells
drive the real ``SinkWatchTrainerCallback`` through its hooks in the order ``Trainer._inner_training_loop``
calls them (transformers 5.x), around the model wrapped as accelerate wraps it: FSDP v1 with
``transformer_layer_cls_to_wrap`` (GPT2Block) and bf16 ``MixedPrecision`` plus autocast (``bf16=True``), or
``SHARD_GRAD_OP``, or FSDP2 (``fully_shard`` on each block, then the root). The callback gets what the
Trainer hands it under FSDP: the wrapped model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from parallel_matrix import BATCH, STEPS, _rank, collate, options, rows, save_final, save_rank, tiny_gpt2

LR = 1e-2  # AdamW: one update moves every weight, so a stale unshard shows in the next loss


def _accelerate_fsdp1(model, *, strategy: str, bf16: bool):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16) if bf16 else None
    return FSDP(
        model, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), device_id=torch.device("cpu"), use_orig_params=True,
        sharding_strategy=getattr(ShardingStrategy, strategy), mixed_precision=mp,
    )  # fmt: skip


def _accelerate_fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def _full_state(wrapped) -> dict:
    """The full weights on rank 0 (a collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(wrapped, FSDP):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
            return {k: v.detach().clone() for k, v in wrapped.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _hf_order(cell: Path, wrap, *, bf16: bool, watched: bool) -> tuple[list[float], dict]:
    """``STEPS`` optimizer steps of ``wrap(tiny_gpt2())`` with the callback's hooks where the Trainer calls
    them: on_train_begin; per step on_step_begin, the training forward (the callback's pre-hook reads the
    batch), backward, on_pre_optimizer_step, optimizer.step, on_optimizer_step, on_step_end (the
    DefaultFlowCallback, first in the list, has set should_training_stop at max_steps); on_train_end."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from sinkwatch.hf import SinkWatchTrainerCallback

    wrapped = wrap(tiny_gpt2())
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    args = TrainingArguments(output_dir=str(cell / "trainer"), max_steps=STEPS, use_cpu=True, report_to=[], bf16=bf16)
    state, control = TrainerState(max_steps=STEPS, is_world_process_zero=_rank() == 0), TrainerControl()
    cb = SinkWatchTrainerCallback(**options(cell)) if watched else None
    data, first, losses = rows(_rank(), n=STEPS * BATCH), None, []

    def call(hook: str) -> None:
        if cb is not None:
            getattr(cb, hook)(args, state, control, model=wrapped)

    call("on_train_begin")
    for step in range(STEPS):
        batch = collate(data[step * BATCH : (step + 1) * BATCH])
        first = first or batch
        call("on_step_begin")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = wrapped(**batch).loss
        loss.backward()
        call("on_pre_optimizer_step")
        opt.step()
        call("on_optimizer_step")
        opt.zero_grad()
        state.global_step += 1
        control.should_training_stop = state.global_step >= STEPS
        call("on_step_end")
        losses.append(loss.item())
    call("on_train_end")
    if cb is not None:
        save_rank(cell, cb.live, first)
    return losses, _full_state(wrapped)


def _identical(cell: Path, wrap, *, bf16: bool = False) -> None:
    """Unmonitored, then watched, from the same seed: whether losses and final weights are bit-identical."""
    plain_losses, plain = _hf_order(cell, wrap, bf16=bf16, watched=False)
    losses, final = _hf_order(cell, wrap, bf16=bf16, watched=True)
    save_final(cell, final)
    if _rank() == 0:
        same = {k: torch.equal(v, final[k]) for k, v in plain.items()}
        out = {"losses": losses, "plain_losses": plain_losses, "weights_identical": same}
        (cell / "identical.json").write_text(json.dumps(out))


def hf_fsdp1_bf16_step0(cell: Path) -> None:
    _identical(cell, lambda m: _accelerate_fsdp1(m, strategy="FULL_SHARD", bf16=True), bf16=True)


def hf_shard_grad_op_step0(cell: Path) -> None:
    _identical(cell, lambda m: _accelerate_fsdp1(m, strategy="SHARD_GRAD_OP", bf16=False))


def hf_fsdp2_step0(cell: Path) -> None:
    _identical(cell, _accelerate_fsdp2)


CELLS = {f.__name__: f for f in (hf_fsdp1_bf16_step0, hf_shard_grad_op_step0, hf_fsdp2_step0)}
