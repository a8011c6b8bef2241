"""The options of the live callbacks (Lightning, HF Trainer, Fabric, OLMo-core, torchtitan, Megatron-core): one
typed, keyword-only, validated dataclass, shared by every adapter (docs/live.md, "Options")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..probe.monitor import MonitorConfig
from ..probes import LIVE_PROBES
from ..reporters.base import Reporter
from ..reporters.wandb_run import WANDB_MODES
from ..stages import StageConfig


@dataclass(frozen=True, kw_only=True)
class LiveConfig:
    """Options of the callbacks (all keyword-only, validated)."""

    every_n_steps: int | None = 250  # probe every N optimizer steps (None: only log-spaced/start/end)
    log_spaced: int | None = None  # also ~N log-spaced steps in [1, max_steps]
    probe_at_start: bool = True  # step 0: the initial model
    probe_at_end: bool = True  # the last step, if not already probed
    out_dir: str = "./sinkwatch"  # records.jsonl and events.jsonl go here
    tokens_per_step: int | None = None  # None: counted from the batches (Lightning) or estimated (HF)
    probes: Sequence[Any] | None = None  # None: ``probes.default_probes`` fitted to the model, natural windows included
    natural: bool = True  # with default probes: freeze natural windows from the first training batches
    natural_n: int = LIVE_PROBES["natural"][0]
    natural_seq_len: int = LIVE_PROBES["natural"][1]
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    wandb: str = "auto"  # auto: the trainer's run, else an offline run; online | offline | disabled
    wandb_project: str = "sinkwatch"
    wandb_init: dict | None = None  # extra wandb.init(...) keywords when sinkwatch starts the run
    heatmap_every: int = 5  # W&B images/table every N probes
    console: bool = True
    raise_on_error: bool = False  # True: probe errors propagate (debugging); default: warn and go on
    preflight: bool = True  # before the first probe, one sequence of each set: a deterministic error there disables sinkwatch
    # data parallelism: every rank probes its share of the sequences, one all-reduce combines them (docs/design.md §9);
    # False: DDP's rank 0 probes alone, sharded ranks each run the whole probe
    split_probe: bool = True
    fault_timeout_s: float = 60.0  # ranks that probe together: how long a rank that faulted in a forward waits for the others' verdict
    on_event: Callable[[dict], None] | None = None  # user hook, called with each event dict
    reporters: Sequence[Reporter] = ()  # extra reporters

    def __post_init__(self) -> None:
        for name in ("every_n_steps", "log_spaced", "tokens_per_step"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be None or a positive int, got {v!r}")
        if self.every_n_steps is None and self.log_spaced is None and not self.probe_at_start and not self.probe_at_end:
            raise ValueError("nothing would ever be probed: set every_n_steps, log_spaced, probe_at_start or probe_at_end")
        for name in ("natural_n", "natural_seq_len", "heatmap_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.split_probe, bool):
            raise TypeError(f"split_probe must be True or False, got {self.split_probe!r}")
        if isinstance(self.fault_timeout_s, bool) or not isinstance(self.fault_timeout_s, (int, float)) or not self.fault_timeout_s > 0:
            raise ValueError(f"fault_timeout_s must be a positive number of seconds, got {self.fault_timeout_s!r}")
        if self.wandb not in WANDB_MODES:
            raise ValueError(f"wandb must be one of {WANDB_MODES}, got {self.wandb!r}")
        if not isinstance(self.monitor, MonitorConfig):
            raise TypeError("monitor must be a sinkwatch.MonitorConfig (stage thresholds: MonitorConfig(stages=StageConfig(...)))")
        if self.on_event is not None and not callable(self.on_event):
            raise TypeError("on_event must be callable (it receives each event as a dict)")
        for r in self.reporters:
            if not isinstance(r, Reporter):
                raise TypeError(f"reporters must be sinkwatch Reporter instances, got {type(r).__name__}")

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> LiveConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names - {"stages"})
        if unknown:
            raise TypeError(f"unknown sinkwatch option(s) {unknown}; valid: {sorted(names)}")
        kwargs = dict(kwargs)
        if "stages" in kwargs:  # convenience: stages=StageConfig(...) without building a MonitorConfig
            stages = kwargs.pop("stages")
            if not isinstance(stages, StageConfig):
                raise TypeError("stages must be a sinkwatch.StageConfig")
            base = kwargs.get("monitor", MonitorConfig())
            kwargs["monitor"] = MonitorConfig(**{**{f.name: getattr(base, f.name) for f in fields(base)}, "stages": stages})
        return cls(**kwargs)

    @classmethod
    def with_overrides(cls, config: LiveConfig | None, overrides: dict) -> LiveConfig:
        """What a callback's ``(config, **overrides)`` means: ``config`` (default: all defaults)
        with the keyword options replacing its fields (``stages=`` as in ``from_kwargs``)."""
        if config is None:
            return cls.from_kwargs(overrides)
        if not isinstance(config, LiveConfig):
            raise TypeError(f"config must be a sinkwatch.live.LiveConfig (or None), got {type(config).__name__}")
        if not overrides:
            return config
        return cls.from_kwargs({**{f.name: getattr(config, f.name) for f in fields(cls)}, **overrides})
