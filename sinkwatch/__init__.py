"""sinkwatch: watch attention sinks and induction heads form while a language model trains."""

from .capture import CustomTarget, HFTarget, ProbeTarget, UnsupportedModelError, attend, find_transformers_model
from .kernels import AttentionStats, attention_stats
from .monitor import Monitor, MonitorConfig
from .probes import (
    InductionProbe,
    NaturalProbe,
    ProbeSet,
    RepeatedRandomProbe,
    make_induction_probe,
    make_natural_probe,
    make_repeated_random_probe,
)
from .snapshot import Snapshot
from .stages import StageConfig, StageEvent, StageTracker

__version__ = "0.1.0"

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
