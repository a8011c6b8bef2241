"""Lightning adapter: ``SinkWatchCallback`` (docs/design.md §7). Imports lightning; nothing else in sinkwatch does.

    from sinkwatch.lightning import SinkWatchCallback
    trainer = lightning.Trainer(callbacks=[SinkWatchCallback()])

Probes after every ``every_n_steps``-th optimizer step (de-duplicated on ``trainer.global_step``:
the batch-end hook fires per micro-batch), at step 0 and at the end. The last step is probed
before the checkpoint saved at it (Lightning runs ``ModelCheckpoint`` last in each hook, and saves
in the batch-end, epoch-end or validation-end hook, all before ``on_train_end``), so a resume from
``last.ckpt`` neither loses nor repeats it. Log-spaced steps span Lightning's estimate of the run
(``trainer.estimated_stepping_batches``: ``max_steps``, or ``max_epochs`` x batches per epoch). Strategies: single device,
DDP (every rank probes the bare module — never the DDP wrapper, which would hang), FSDP2 via
``ModelParallelStrategy`` (every rank runs the probe forward, whose hooks all-gather the shards),
FSDP v1 (every rank probes together; the parameters no inner unit owns are gathered through the
strategy's root wrapper); each rank runs its share of the probe's sequences (``sinkwatch.probe.share``).
Tensor parallelism and DeepSpeed ZeRO-3 are refused at fit start. Only global rank 0 reports
(docs/live.md, "Distributed training").
"""

from __future__ import annotations

import math
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the standalone pytorch_lightning package
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

from ..live import LiveConfig, LiveMonitor


def _wandb_run(trainer):
    for logger in getattr(trainer, "loggers", []) or []:
        if type(logger).__name__ == "WandbLogger":
            return logger.experiment
    return None


def data_parallel_size(trainer) -> int:
    """Ranks that read distinct batches: the strategy's sampler replicas (DDP/FSDP: the world size;
    ModelParallelStrategy: the data-parallel mesh, so tensor-parallel peers, which read the same
    batch, count once)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return max(1, int(kwargs.get("num_replicas", trainer.world_size) or 1))


def mixed_precision_dtype(trainer):
    """The autocast dtype of Lightning's ``precision="bf16-mixed"`` / ``"16-mixed"`` (None otherwise:
    ``32-true``, or ``*-true``, where the weights themselves carry the dtype)."""
    import torch

    precision = str(getattr(trainer, "precision", "") or "")
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def planned_steps(trainer) -> int | None:
    """Optimizer steps the fit will take, as Lightning estimates them (``max_steps``, or ``max_epochs``
    x batches per epoch / gradient accumulation, whichever is smaller); None when it cannot know
    (an iterable dataset without ``__len__`` and no ``max_steps``, or ``max_epochs=-1``)."""
    try:
        steps = trainer.estimated_stepping_batches  # loads the train dataloader early, as configure_optimizers may
    except Exception:  # noqa: BLE001 - e.g. an accumulation schedule that changes by epoch
        return None
    if steps is None or not math.isfinite(steps) or steps < 1:
        return None
    return int(steps)


def fit_ends_after(trainer, batch_idx: int) -> bool:
    """Whether the optimizer step just taken is the fit's last by the trainer's limits: ``max_steps``
    reached, or the last batch of the last epoch (where Lightning always steps). Every rank agrees
    (no collective needed). A stop decided later (EarlyStopping, Timer) shows in ``trainer.should_stop``."""
    if trainer.max_steps is not None and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    if max_epochs is None or max_epochs < 0 or trainer.current_epoch + 1 < max_epochs:
        return False
    n = trainer.num_training_batches
    if isinstance(n, (int, float)) and math.isfinite(n) and batch_idx + 1 >= n:
        return True
    # an iterable dataset without length: the data fetcher looks one batch ahead
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


class SinkWatchCallback(Callback):
    """Watch attention sinks and induction heads form during ``Trainer.fit``.

    ``SinkWatchCallback(config=None, **overrides)``: the options are ``sinkwatch.live.LiveConfig``'s (its
    docstring lists them). What Lightning changes: ``log_spaced`` reads ``trainer.estimated_stepping_batches``
    (unknown for streaming data without ``max_steps``: one warning, no log-spaced steps); the state goes into
    Lightning's checkpoints (``state_dict``).
    """

    def __init__(self, config: LiveConfig | None = None, **overrides: Any):
        super().__init__()
        self.config = LiveConfig.with_overrides(config, overrides)
        self.live = LiveMonitor(self.config)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # not in ``setup``: that hook runs before ``configure_model`` shards the model (FSDP2) and
        # before the strategy wraps it (FSDP), and whether every rank must probe depends on both
        self.live.setup(
            pl_module,
            is_global_zero=trainer.is_global_zero,
            wrapped=trainer.strategy.model or pl_module,
            max_steps=planned_steps(trainer) if self.config.log_spaced else None,
            world_size=data_parallel_size(trainer),
            wandb_run=_wandb_run(trainer) if trainer.is_global_zero else None,
            # DeepSpeedStrategy's own flag (no deepspeed import); the parameters' ``ds_id`` and tensor-parallel
            # shards are checked in setup, which refuses such layouts on every rank before any probe
            zero3=bool(getattr(trainer.strategy, "zero_stage_3", False)),
            compute_dtype=mixed_precision_dtype(trainer),  # bf16-mixed / 16-mixed: the probe runs under autocast in it
        )
        self._report_to_loggers(trainer)

    def _report_to_loggers(self, trainer: pl.Trainer) -> None:
        # the trainer's own loggers (TensorBoard, MLflow, CSV, ...) get the scalars and events too;
        # W&B loggers stay with the W&B reporter (see sinkwatch.reporters.lightning_loggers)
        if trainer.is_global_zero and trainer.loggers:
            from ..reporters.lightning_loggers import lightning_loggers_reporter

            self.live.add_reporter(lightning_loggers_reporter(trainer.loggers))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.live.batch_start(batch)
        if trainer.global_step == 0:
            self.live.step_end(0)  # the initial model, once the first batch froze the natural probe

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.live.batch_end(batch)
        self.live.step_end(trainer.global_step)
        if fit_ends_after(trainer, batch_idx):
            # the last step, probed now: ModelCheckpoint saves it later in this hook or at epoch/validation end
            self.live.train_end(trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # a stop decided in the very hook that saves (EarlyStopping, Timer: both run before ModelCheckpoint)
        # shows only here: probe the last step now and put the state after that probe into this checkpoint
        if trainer.should_stop and not trainer.sanity_checking and "callbacks" in checkpoint:
            before = self.live.last_probed_step
            self.live.train_end(trainer.global_step)
            if self.live.last_probed_step != before:
                checkpoint["callbacks"][self.state_key] = self.state_dict()

    def on_train_end(self, trainer, pl_module) -> None:
        self.live.train_end(trainer.global_step)  # a no-op when the last step was probed above
        self.live.finish()

    def state_dict(self) -> dict:
        return self.live.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.live.load_state_dict(state_dict)
