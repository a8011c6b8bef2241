"""sinkwatch: watch attention sinks and induction heads form while a language model trains."""

from . import _moved  # noqa: F401 - first: it installs the old and short import paths (sinkwatch.monitor, sinkwatch.hf, ...)
from .capture import CustomTarget, HFTarget, ProbeTarget, UnsupportedModelError, attend, find_transformers_model
from .kernels import AttentionStats, attention_stats
from .probe.monitor import Monitor, MonitorConfig
from .probe.snapshot import Snapshot
from .probes import (
    InductionProbe,
    NaturalProbe,
    ProbeSet,
    RepeatedRandomProbe,
    make_induction_probe,
    make_natural_probe,
    make_repeated_random_probe,
)
from .records import VERSION
from .stages import StageConfig, StageEvent, StageTracker

__version__ = VERSION

__all__ = [
    "AttentionStats",
    "CustomTarget",
    "HFTarget",
    "ProbeTarget",
    "attend",
    "InductionProbe",
    "Monitor",
    "MonitorConfig",
    "NaturalProbe",
    "ProbeSet",
    "RepeatedRandomProbe",
    "Snapshot",
    "StageConfig",
    "StageEvent",
    "StageTracker",
    "UnsupportedModelError",
    "attention_stats",
    "find_transformers_model",
    "make_induction_probe",
    "make_natural_probe",
    "make_repeated_random_probe",
]
