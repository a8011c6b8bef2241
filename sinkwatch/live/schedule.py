"""When a live run probes: every N optimizer steps and/or log-spaced steps, once per step, a skipped probe retried."""

from __future__ import annotations

import numpy as np

from .config import LiveConfig


def log_spaced_steps(count: int, max_steps: int) -> set[int]:
    """~count distinct integer steps spaced evenly in log between 1 and max_steps (inclusive)."""
    if max_steps < 1:
        return set()
    return {int(round(x)) for x in np.geomspace(1, max_steps, num=count)}


class Schedule:
    """Which optimizer steps are probed: step 0 (``probe_at_start``), every ``every_n_steps``-th and the
    log-spaced ones, each once whatever the micro-batching. A probe skipped for lack of memory at step
    ``s`` is retried at ``s + 1, s + 2, s + 4, ...`` until one is written or the next scheduled step
    comes: at most log2 of the interval retries, each costing the ranks one all-reduce."""

    def __init__(self, config: LiveConfig, log_steps: set[int] = frozenset()):
        self.config, self.log_steps = config, set(log_steps)
        self.retry: tuple[int, int] | None = None  # (the scheduled step skipped for memory, the next retry)

    def scheduled(self, step: int) -> bool:
        cfg = self.config
        if step == 0:
            return cfg.probe_at_start
        return bool(cfg.every_n_steps and step % cfg.every_n_steps == 0) or step in self.log_steps

    def due(self, step: int, last_probed: int | None) -> bool:
        if last_probed is not None and step <= last_probed:
            return False  # once per optimizer step
        return self.scheduled(step) or (self.retry is not None and step >= self.retry[1])

    def delayed_from(self, step: int) -> int | None:
        """The scheduled step a probe at ``step`` stands in for (a retry), or None."""
        return self.retry[0] if self.retry is not None and not self.scheduled(step) else None

    def ran(self, step: int, *, short_of_memory: bool) -> None:
        """After the probe at ``step``: written or skipped, and whether it lacked memory (then retried)."""
        if not short_of_memory:
            self.retry = None
        elif self.retry is None or self.scheduled(step):
            self.retry = (step, step + 1)
        else:
            skipped = self.retry[0]
            self.retry = (skipped, step + max(1, step - skipped))
