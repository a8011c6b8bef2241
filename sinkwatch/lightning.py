"""Lightning adapter: ``SinkWatchCallback`` (SPEC §7). Imports lightning; nothing else in sinkwatch does.

    from sinkwatch.lightning import SinkWatchCallback
    trainer = lightning.Trainer(callbacks=[SinkWatchCallback()])

Probes after every ``every_n_steps``-th optimizer step (de-duplicated on ``trainer.global_step``:
the batch-end hook fires per micro-batch), at step 0 and at the end. Strategies: single device,
DDP (global rank 0 probes the bare module — never the DDP wrapper, which would hang), FSDP2 via
``ModelParallelStrategy`` (every rank runs the probe forward, whose hooks all-gather the shards),
FSDP (every rank probes together inside ``summon_full_params``; needs GPUs, see docs/live.md).
Only global rank 0 reports.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the standalone pytorch_lightning package
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

from .live import LiveConfig, LiveMonitor, is_fsdp


def _wandb_run(trainer):
    for logger in getattr(trainer, "loggers", []) or []:
        if type(logger).__name__ == "WandbLogger":
            return logger.experiment
    return None


class SinkWatchCallback(Callback):
    """Watch attention sinks and induction heads form during ``Trainer.fit``.

    Every keyword is a ``sinkwatch.live.LiveConfig`` field (``every_n_steps``, ``log_spaced``,
    ``out_dir``, ``tokens_per_step``, ``probes``, ``wandb``, ``stages``, ``raise_on_error``...).
    """

    def __init__(self, **kwargs: Any):
        super().__init__()
        self.config = LiveConfig.from_kwargs(kwargs)
        self.live = LiveMonitor(self.config)

    @property
    def state_key(self) -> str:
        return "SinkWatchCallback"

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # not in ``setup``: that hook runs before ``configure_model`` shards the model (FSDP2) and
        # before the strategy wraps it (FSDP), and whether every rank must probe depends on both
        self.live.setup(
            pl_module,
            is_global_zero=trainer.is_global_zero,
            probes_here=trainer.is_global_zero or is_fsdp(trainer.strategy.model or pl_module),
            max_steps=trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None,
            world_size=trainer.world_size,
            wandb_run=_wandb_run(trainer) if trainer.is_global_zero else None,
        )
        self._report_to_loggers(trainer)

    def _report_to_loggers(self, trainer: pl.Trainer) -> None:
        # the trainer's own loggers (TensorBoard, MLflow, CSV, ...) get the scalars and events too;
        # W&B loggers stay with the W&B reporter (see sinkwatch.reporting.lightning_loggers)
        if trainer.is_global_zero and trainer.loggers:
            from .reporting.lightning_loggers import lightning_loggers_reporter

            self.live.add_reporter(lightning_loggers_reporter(trainer.loggers))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.live.batch_start(batch)
        if trainer.global_step == 0:
            self.live.step_end(0)  # the initial model, once the first batch froze the natural probe

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.live.batch_end(batch)
        self.live.step_end(trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        self.live.train_end(trainer.global_step)
        self.live.finish()

    def state_dict(self) -> dict:
        return self.live.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.live.load_state_dict(state_dict)
