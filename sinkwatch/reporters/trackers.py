"""What the run's own trackers get, whatever the framework: the scalar view of a record and, on the
trackers that have no alerts, a visible trace of each stage event.

Scalars: ``tracker_scalars`` is the W&B reporter's flat view (``sinkwatch/*``, see docs/live.md)
less its ``by_tokens/*`` copies, which only exist for W&B's second x-axis; ``sinkwatch/tokens`` is
kept as a scalar instead, so tokens can be read at every probe step on any tracker.

Events (one writer per tracker kind, each given the tracker's own object, never a second writer):

    TensorBoard  ``add_text("sinkwatch/events", line, step)`` on the run's SummaryWriter (Text tab)
    MLflow       tag ``sinkwatch/event/<timeline>`` = the latest stage, and a JSON artifact per
                 event, ``sinkwatch_events/step<step>_<timeline>.json``
    CSV          ``sinkwatch_events.csv`` beside the CSV logger's ``metrics.csv``

No module here imports a training framework; mlflow and tensorboard are only touched through the
objects the adapters hand in.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from .wandb_run import scalars  # a pure function: importing it does not import wandb

EVENTS_TAG = "sinkwatch/events"
EVENT_CSV = "sinkwatch_events.csv"
EVENT_COLUMNS = ("step", "tokens", "timeline", "previous", "stage", "first_met_step", "first_met_tokens", "level", "message")


def tracker_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The ``sinkwatch/*`` scalars a tracker gets for one record (ints stay ints, floats become
    Python floats: trackers drop types they do not know)."""
    out = {k: v for k, v in scalars(record).items() if not k.startswith("sinkwatch/by_tokens/")}
    if record.get("tokens") is not None:
        out["sinkwatch/tokens"] = record["tokens"]
    return {k: (int(v) if isinstance(v, int) else float(v)) for k, v in out.items()}


def event_line(event: dict[str, Any]) -> str:
    """One readable line: the level and the message (which names where the rule was first met)."""
    return f"[{event.get('level', 'INFO')}] {event['message']}"


def inherits(obj: Any, class_name: str) -> bool:
    """Whether ``obj``'s class or a base class is named ``class_name`` (no framework import)."""
    return any(c.__name__ == class_name for c in type(obj).__mro__)


class TensorBoardEvents:
    """Events as text on the run's SummaryWriter (TensorBoard's Text tab, at the event's step)."""

    def __init__(self, writer_of):
        self._writer_of = writer_of  # a callable: the writer may be created or replaced lazily

    def write(self, event: dict[str, Any]) -> None:
        writer = self._writer_of()
        if writer is None:
            raise RuntimeError("the TensorBoard writer is closed")
        writer.add_text(EVENTS_TAG, event_line(event), global_step=event.get("step") or 0)
        writer.flush()


class MLflowEvents:
    """Events on an MLflow run: the latest stage per timeline as a tag (the run's overview) and
    every event as a JSON artifact (tags are overwritten; the artifacts keep the history)."""

    def __init__(self, client_and_run):
        self._client_and_run = client_and_run  # a callable -> (MlflowClient, run_id)

    def write(self, event: dict[str, Any]) -> None:
        client, run_id = self._client_and_run()
        step = event.get("step") or 0
        client.set_tag(run_id, f"sinkwatch/event/{event['timeline']}", f"{event['stage']} at step {step}")
        client.log_dict(run_id, event, f"sinkwatch_events/step{step:09d}_{event['timeline']}.json")


class CSVEvents:
    """Events as rows of ``sinkwatch_events.csv`` in the CSV logger's directory (appended, flushed)."""

    def __init__(self, dir_of):
        self._dir_of = dir_of  # a callable: the logger decides its version directory lazily

    def path(self) -> Path:
        return Path(self._dir_of()) / EVENT_CSV

    def write(self, event: dict[str, Any]) -> None:
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        with path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=EVENT_COLUMNS, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow({k: event.get(k) for k in EVENT_COLUMNS})
            f.flush()
            os.fsync(f.fileno())
