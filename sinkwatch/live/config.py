"""The options of the live callbacks (Lightning, HF Trainer, Fabric, OLMo-core, torchtitan, Megatron-core): one
typed, keyword-only, validated dataclass, shared by every adapter (docs/live.md, "Options")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..distributed.protocol import FAULT_TIMEOUT_S
from ..probe.config import MonitorConfig
from ..probes import LIVE_PROBES
from ..reporters.base import Reporter
from ..reporters.wandb_run import WANDB_MODES
from ..stages import StageConfig


@dataclass(frozen=True, kw_only=True)
class LiveConfig:
    """The options of every live callback (keyword-only, validated), written once here: each adapter takes
    ``(config=None, **overrides)``, a ``LiveConfig`` and/or these fields as keywords, and says only what it
    does differently.

    Args:
        every_n_steps: probe after every N-th optimizer step (default 250; None: only log-spaced/start/end).
        log_spaced: also ~N log-spaced steps in [1, the run's optimizer steps] (default None); the adapter
            reads the run's steps off its framework, and without them warns once and probes none.
        probe_at_start: probe the initial model at step 0 (default True).
        probe_at_end: probe the last step if not already probed, before the checkpoint saved at it (default True).
        out_dir: where ``records.jsonl``, ``events.jsonl`` and ``probes.json`` go (default ``./sinkwatch``).
        tokens_per_step: tokens per optimizer step, all ranks (default None: the framework's own count where it
            keeps one, else counted from the batches fed, times the data-parallel ranks).
        probes: probe recipes or ``ProbeSet``s (default None: ``sinkwatch.probes.default_probes`` fitted to the
            model, natural windows included).
        natural: with the default probes, freeze natural windows from the first training batch (default True).
        natural_n: natural windows (default: ``sinkwatch.probes.LIVE_PROBES``).
        natural_seq_len: tokens per natural window (default: ``sinkwatch.probes.LIVE_PROBES``).
        monitor: a ``MonitorConfig`` (probe micro-batch, K, backend, stage thresholds).
        stages: a keyword only, shortcut for ``monitor=MonitorConfig(stages=StageConfig(...))``.
        wandb: "auto" (the trainer's run, else one started offline or as WANDB_MODE says), "online",
            "offline" or "disabled" (default "auto").
        wandb_project: project of a run sinkwatch starts (default "sinkwatch").
        wandb_init: extra ``wandb.init`` keywords when sinkwatch starts the run (default None).
        heatmap_every: W&B heatmaps and head-class table every N probes (default 5).
        console: one line per probe and per event (default True).
        raise_on_error: let probe errors propagate, for debugging (default False: warn once, train on).
        preflight: one sequence of each probe set just before the first probe; a deterministic error there
            disables sinkwatch for the run with one error line (default True).
        split_probe: under data parallelism every rank probes its share of the sequences, one all-reduce
            combines them (default True; False: DDP's rank 0 probes alone, sharded ranks each run the whole
            probe; refused under tensor parallelism). docs/design.md §9.
        fault_timeout_s: ranks that probe together (FSDP, tensor parallelism): how long a rank that faulted
            inside a probe forward waits for the others' verdict before it stops the run (default 60).
        on_event: your hook, called with each event dict (default None).
        reporters: extra ``sinkwatch.reporters.Reporter`` instances (default ()).
    """

    every_n_steps: int | None = 250
    log_spaced: int | None = None
    probe_at_start: bool = True
    probe_at_end: bool = True
    out_dir: str = "./sinkwatch"
    tokens_per_step: int | None = None
    probes: Sequence[Any] | None = None
    natural: bool = True
    natural_n: int = LIVE_PROBES["natural"][0]
    natural_seq_len: int = LIVE_PROBES["natural"][1]
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    wandb: str = "auto"
    wandb_project: str = "sinkwatch"
    wandb_init: dict | None = None
    heatmap_every: int = 5
    console: bool = True
    raise_on_error: bool = False
    preflight: bool = True
    split_probe: bool = True
    fault_timeout_s: float = FAULT_TIMEOUT_S
    on_event: Callable[[dict], None] | None = None
    reporters: Sequence[Reporter] = ()

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
    def scalar_options(cls) -> tuple[str, ...]:
        """The options typed with plain scalars (int, float, bool, str, None): what survives as JSON (the HF
        Trainer's saved callback arguments) and what text can set (Fabric's ``SINKWATCH_FABRIC``)."""
        plain = {"int", "float", "bool", "str", "None"}
        return tuple(f.name for f in fields(cls) if {part.strip() for part in str(f.type).split("|")} <= plain)

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
