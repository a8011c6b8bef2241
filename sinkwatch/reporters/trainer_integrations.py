"""The HF Trainer's ``report_to`` integrations (TensorBoard, MLflow, trackio, Comet, ...) as a sinkwatch
reporter: the scalars travel the Trainer's own logging path, exactly like the loss.

How. The Trainer logs by calling ``on_log(args, state, control, logs)`` on every callback
(``CallbackHandler.on_log``); each integration callback turns ``logs`` into its tracker's calls at
``state.global_step`` (TensorBoard ``add_scalar`` under ``train/``, MLflow ``log_metrics``, trackio
``log`` under ``train/``). This reporter calls each integration callback's ``on_log`` with its own
logs dict, at the probed step. Why not the alternatives:

- ``CallbackHandler.on_log`` itself resets ``control.should_log``: called from ``on_step_end`` it would
  cancel the loss log the DefaultFlowCallback had just scheduled for that step.
- ``control.should_log = True`` and merging into the Trainer's next log: the integrations run before
  user callbacks in that ``on_log`` (report_to callbacks are registered first), so the merge could
  not reach them; and a forced log adds loss points at probe steps and changes the window the
  logged loss is averaged over.
- ``Trainer.log``: also resets ``control.should_log``, and appends to ``state.log_history``.

So training, the loss log and ``log_history`` are untouched; each integration gets a copy of the
control object (nothing it sets flows back into the run) and a copy of the state whose
``global_step`` is the record's step. W&B (``WandbCallback``) is left to the W&B reporter, which
logs to that same run with its extras; routing the scalars there too would write them twice.

Stage events: the TensorBoardCallback's own ``tb_writer`` gets a text entry and the MLflowCallback's
active run a tag and a JSON artifact (see ``trackers``); other integrations get the scalars only.

The integrations close their trackers in their ``on_train_end``, which runs before sinkwatch's
(report_to callbacks come first), so the adapter probes the last step in ``on_step_end`` and then
calls ``close``: a probe after that (training stopped by a callback that runs after sinkwatch's)
reaches ``records.jsonl`` and W&B only, with one warning, instead of reopening a closed writer or
starting a stray MLflow run.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

from .base import MultiReporter, Reporter
from .trackers import MLflowEvents, TensorBoardEvents, inherits, tracker_scalars


def is_wandb_callback(callback: Any) -> bool:
    return inherits(callback, "WandbCallback")


def _mlflow_active_run():
    import mlflow  # only reached with the MLflowCallback in report_to, so mlflow is installed

    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("no active MLflow run (the MLflowCallback ended it)")
    return mlflow.MlflowClient(), run.info.run_id


def event_writer(callback: Any):
    if inherits(callback, "TensorBoardCallback"):
        return TensorBoardEvents(lambda: callback.tb_writer)
    if inherits(callback, "MLflowCallback"):
        return MLflowEvents(_mlflow_active_run)
    return None


class TrainerRun:
    """The Trainer objects an integration's ``on_log`` reads, captured at ``on_train_begin`` (the
    Trainer keeps the same ``args``, ``state`` and ``control`` objects for the whole run)."""

    def __init__(self, args: Any, state: Any, control: Any, model: Any = None):
        self.args, self.state, self.control, self.model = args, state, control, model
        self.closed = False

    def state_at(self, step: int):
        state = copy.copy(self.state)  # shallow: log_history etc. are shared, never modified
        state.global_step = step
        return state


class IntegrationReporter(Reporter):
    """One integration callback."""

    def __init__(self, callback: Any, run: TrainerRun):
        self.callback = callback
        self.run = run
        self.name = f"Trainer {type(callback).__name__}"
        self.events = event_writer(callback)

    def log_record(self, record: dict[str, Any]) -> None:
        logs = tracker_scalars(record)
        if logs:
            run = self.run
            state = run.state_at(record.get("step") or 0)
            self.callback.on_log(run.args, state, copy.copy(run.control), logs=logs, model=run.model)

    def log_event(self, event: dict[str, Any]) -> None:
        if self.events is not None:
            self.events.write(event)

    def log_skip(self, step: int, tokens: int | None, reason: str) -> None:
        run = self.run
        self.callback.on_log(run.args, run.state_at(step), copy.copy(run.control), logs={"sinkwatch/probe_skipped": 1}, model=run.model)


class TrainerIntegrationsReporter(MultiReporter):
    """Fans out to the integration callbacks (W&B excluded); silent, with one warning, after ``close``."""

    name = "Trainer integrations"

    def __init__(self, callbacks: Sequence[Any], run: TrainerRun):
        super().__init__([IntegrationReporter(cb, run) for cb in callbacks if not is_wandb_callback(cb)])
        self.run = run

    def close(self) -> None:
        self.run.closed = True

    def _each(self, method: str, *args) -> None:
        if self.run.closed and method in ("log_record", "log_event", "log_skip"):
            if self.reporters and "closed" not in self._warned:
                self._warned.add("closed")
                names = ", ".join(type(r.callback).__name__ for r in self.reporters)
                warnings.warn(
                    f"sinkwatch: a probe came after the Trainer's integrations closed ({names}); it is in records.jsonl "
                    "(and W&B) only. The last step is probed in on_step_end when the Trainer's flow stops training; "
                    "a callback after sinkwatch's that stops training skips that",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        super()._each(method, *args)
