"""The reporter interface, a do-nothing reporter, and a fan-out that isolates faults."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any


class Reporter:
    """Receives every record (docs/design.md §10) and every stage event. The base class does nothing: it is
    what non-logging ranks get, so the hot path never asks which rank it is on."""

    name = "null"

    def log_record(self, record: dict[str, Any]) -> None:
        pass

    def log_event(self, event: dict[str, Any]) -> None:
        pass

    def log_error(self, step: int | None, message: str) -> None:
        pass

    def log_skip(self, step: int, tokens: int | None, reason: str) -> None:
        """A scheduled probe that was not written (``reason``: its error line): trackers log
        ``sinkwatch/probe_skipped`` = 1 at ``step``, so a gap in the curves is visible where it is."""
        pass

    def finish(self) -> None:
        pass


class MultiReporter(Reporter):
    """Fans out to several reporters. A reporter that raises gets one warning and keeps being tried
    (a transient failure should not lose later records); the others are unaffected."""

    name = "multi"

    def __init__(self, reporters: Sequence[Reporter]):
        self.reporters = list(reporters)
        self._warned: set[str] = set()

    def _each(self, method: str, *args) -> None:
        for r in self.reporters:
            try:
                getattr(r, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a reporter must never stop training
                if r.name not in self._warned:
                    self._warned.add(r.name)
                    warnings.warn(
                        f"sinkwatch: the {r.name} reporter failed in {method} ({type(exc).__name__}: {exc}); "
                        "training continues and the local JSONL still gets every record",
                        RuntimeWarning,
                        stacklevel=3,
                    )

    def log_record(self, record):
        self._each("log_record", record)

    def log_event(self, event):
        self._each("log_event", event)

    def log_error(self, step, message):
        self._each("log_error", step, message)

    def log_skip(self, step, tokens, reason):
        self._each("log_skip", step, tokens, reason)

    def finish(self):
        self._each("finish")
