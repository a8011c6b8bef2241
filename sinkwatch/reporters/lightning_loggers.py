"""The Lightning trainer's own loggers (``trainer.loggers``) as a sinkwatch reporter.

Every ``sinkwatch/*`` scalar goes to every attached logger through its public
``log_metrics(metrics, step)`` at the record's step (the trainer's global step), then
``logger.save()`` as Lightning's own logger connector does after each log (the CSV logger writes its
file there). W&B loggers are left to the W&B reporter, which logs the same scalars to that same run
with its extras (step and tokens axes, heatmaps, head table, ``run.alert``): logging them here too
would write every scalar twice.

Stage events, on loggers that have no alerts (see ``trackers``): TensorBoardLogger's SummaryWriter
gets a text entry, MLFlowLogger's run a tag and a JSON artifact, CSVLogger a ``sinkwatch_events.csv``
beside ``metrics.csv``. Other loggers get the scalars only; every event is also in ``events.jsonl``
and on the console.

Built on global rank zero only (the loggers' ``log_metrics`` are rank-zero methods anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import MultiReporter, Reporter
from .trackers import CSVEvents, MLflowEvents, TensorBoardEvents, inherits, tracker_scalars


def is_wandb_logger(logger: Any) -> bool:
    return inherits(logger, "WandbLogger")


def event_writer(logger: Any):
    """The event writer for a logger kind, or None for loggers with nowhere to put text."""
    if inherits(logger, "TensorBoardLogger"):
        return TensorBoardEvents(lambda: logger.experiment)
    if inherits(logger, "MLFlowLogger"):
        return MLflowEvents(lambda: (logger.experiment, logger.run_id))
    if inherits(logger, "CSVLogger"):
        return CSVEvents(lambda: logger.log_dir)
    return None


class LoggerReporter(Reporter):
    """One Lightning logger; wrapped by ``lightning_loggers_reporter`` in a MultiReporter so a logger
    that fails gets its own warning and the others go on."""

    def __init__(self, logger: Any):
        self.logger = logger
        self.name = f"Lightning {type(logger).__name__}"
        self.events = event_writer(logger)

    def log_record(self, record: dict[str, Any]) -> None:
        metrics = tracker_scalars(record)
        if metrics:
            self.logger.log_metrics(metrics, step=record.get("step") or 0)
            self.logger.save()

    def log_event(self, event: dict[str, Any]) -> None:
        if self.events is not None:
            self.events.write(event)

    def log_skip(self, step: int, tokens: int | None, reason: str) -> None:
        self.logger.log_metrics({"sinkwatch/probe_skipped": 1}, step=step)
        self.logger.save()


def lightning_loggers_reporter(loggers: Sequence[Any]) -> Reporter:
    """A reporter for ``trainer.loggers`` (W&B loggers excluded, see the module docstring)."""
    mine = [LoggerReporter(lg) for lg in loggers or () if not is_wandb_logger(lg)]
    return MultiReporter(mine) if mine else Reporter()
