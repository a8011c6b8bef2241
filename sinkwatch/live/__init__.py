"""The framework-free live core (docs/design.md §7), shared by every adapter: ``LiveMonitor`` (when to probe,
the natural probe, tokens, the rank protocol's verdicts, the stage tracker, the reporters), its options
(``LiveConfig``), the schedule and resume from a store."""

from .config import LiveConfig
from .monitor import LiveMonitor
from .resume import STATE_VERSION, live_probes, state_from_store
from .schedule import Schedule, log_spaced_steps

__all__ = ["STATE_VERSION", "LiveConfig", "LiveMonitor", "Schedule", "live_probes", "log_spaced_steps", "state_from_store"]
