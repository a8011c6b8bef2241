"""The framework-free core of live monitoring (SPEC §7), shared by the Lightning and HF adapters.

``LiveMonitor`` decides when to probe (every N optimizer steps and/or log-spaced steps, once per
step whatever the micro-batching), freezes the natural probe from the first training batches,
counts tokens, runs ``Monitor.probe``, feeds records and stage events to reporters, and keeps the
state a resumed run needs. It never lets a failure reach the training loop unless asked to.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from .capture import ProbeTarget, preserved_rng, resolve_target
from .distributed import RankFacts, fsdp_full_params, rank_facts
from .monitor import Monitor, MonitorConfig
from .probes import MIN_INDUCTION_SEQ_LEN, InductionProbe, ProbeSet, RepeatedRandomProbe, make_natural_probe
from .reporting.base import MultiReporter, Reporter
from .reporting.console import ConsoleReporter
from .reporting.jsonl import JSONLReporter
from .reporting.wandb_run import WANDB_MODES
from .stages import StageConfig

STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class LiveConfig:
    """Options of the callbacks (all keyword-only, validated)."""

    every_n_steps: int | None = 250  # probe every N optimizer steps (None: only log-spaced/start/end)
    log_spaced: int | None = None  # also ~N log-spaced steps in [1, max_steps]
    probe_at_start: bool = True  # step 0: the initial model
    probe_at_end: bool = True  # the last step, if not already probed
    out_dir: str = "./sinkwatch"  # records.jsonl and events.jsonl go here
    tokens_per_step: int | None = None  # None: counted from the batches (Lightning) or estimated (HF)
    probes: Sequence[Any] | None = None  # None: induction (100 x 256) + repeated (32 x 128) + natural, fitted to the model
    natural: bool = True  # with default probes: freeze natural windows from the first training batches
    natural_n: int = 32
    natural_seq_len: int = 64
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    wandb: str = "auto"  # auto: the trainer's run, else an offline run; online | offline | disabled
    wandb_project: str = "sinkwatch"
    wandb_init: dict | None = None  # extra wandb.init(...) keywords when sinkwatch starts the run
    heatmap_every: int = 5  # W&B images/table every N probes
    console: bool = True
    raise_on_error: bool = False  # True: probe errors propagate (debugging); default: warn and go on
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



def log_spaced_steps(count: int, max_steps: int) -> set[int]:
    """~count distinct integer steps spaced evenly in log between 1 and max_steps (inclusive)."""
    if max_steps < 1:
        return set()
    return {int(round(x)) for x in np.geomspace(1, max_steps, num=count)}


def input_ids_of(batch) -> torch.Tensor | None:
    """The (B, T) token ids in a training batch: a tensor, dict["input_ids"], or the first item of a tuple/list."""
    if isinstance(batch, torch.Tensor):
        ids = batch
    elif isinstance(batch, dict) or hasattr(batch, "keys"):
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
    elif isinstance(batch, (tuple, list)) and batch:
        ids = batch[0] if isinstance(batch[0], torch.Tensor) else None
    else:
        ids = None
    if ids is None or ids.dtype.is_floating_point or ids.dim() != 2:
        return None
    return ids


class _NoProbe:
    """What non-probing ranks do at a probe step (decided once, at setup)."""

    def __call__(self, step: int) -> None:
        return None


class LiveMonitor:
    """Framework-free live monitor. Adapters call: ``setup`` (fit start), ``batch_start`` and
    ``batch_end`` (every micro-batch), ``step_end`` (after each optimizer step), ``train_end`` and
    ``finish``; ``state_dict``/``load_state_dict`` for checkpoints."""

    def __init__(self, config: LiveConfig):
        self.config = config
        self.monitor: Monitor | None = None
        self.target: ProbeTarget | None = None
        self._full_params = contextlib.nullcontext
        self.reporter: Reporter = Reporter()
        self._probe_step = _NoProbe()
        self.natural: ProbeSet | None = None
        self.tokens_seen = 0
        self.last_probed_step: int | None = None
        self.n_probes = 0
        self.max_steps: int | None = None
        self._log_steps: set[int] = set()
        self._pending_state: dict | None = None
        self._probe_hashes: dict | None = None
        self._warned: set[str] = set()
        self._ready = False
        self.wandb_reporter = None
        self.jsonl: JSONLReporter | None = None
        self.world_size = 1
        self.rank: RankFacts | None = None

    # ---- setup -------------------------------------------------------------------------------
    def setup(
        self,
        model,
        *,
        is_global_zero: bool,
        wrapped=None,
        max_steps: int | None = None,
        world_size: int = 1,
        wandb_run=None,
    ) -> None:
        """At fit start. Resolves the model (a clear error now, never mid-run), picks reporters on
        the logging rank and a no-op elsewhere, and whether this rank probes (decided once, here,
        by ``sinkwatch.distributed``: rank 0, or every rank when the parameters are sharded).

        ``model``: what is probed (the bare module under DDP, never the DDP wrapper, which would
        hang). ``wrapped``: the model as the training strategy wraps it, where FSDP shards show
        (Lightning's ``trainer.strategy.model``); None: ``model`` itself."""
        self.target = resolve_target(model)
        self._full_params = fsdp_full_params(model)
        self.rank = rank_facts(wrapped if wrapped is not None else model, is_global_zero=is_global_zero, world_size=world_size)
        self.world_size = self.rank.world_size
        self.max_steps = max_steps if max_steps and max_steps > 0 else None
        self._log_steps = log_spaced_steps(self.config.log_spaced, self.max_steps) if self.config.log_spaced and self.max_steps else set()
        if self.rank.reports_here:
            self.reporter = self._make_reporters(wandb_run)
        self._probe_step = self._probe if self.rank.probes_here else _NoProbe()
        self._ready = True
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    def _make_reporters(self, wandb_run) -> Reporter:
        cfg = self.config
        self.jsonl = JSONLReporter(cfg.out_dir)
        reporters: list[Reporter] = [self.jsonl]
        if cfg.console:
            reporters.append(ConsoleReporter())
        if cfg.wandb != "disabled":
            try:
                from .reporting.wandb_run import wandb_reporter

                self.wandb_reporter = wandb_reporter(
                    cfg.wandb,
                    trainer_run=wandb_run,
                    project=cfg.wandb_project,
                    dir=cfg.out_dir,
                    heatmap_every=cfg.heatmap_every,
                    init_kwargs=cfg.wandb_init,
                )
                reporters.append(self.wandb_reporter)
            except ImportError:
                self._warn("no-wandb", "sinkwatch: wandb is not installed (pip install wandb); logging to the local JSONL only")
        reporters.extend(cfg.reporters)
        return MultiReporter(reporters)

    def _build_monitor(self) -> Monitor:
        cfg = self.config
        if cfg.probes is not None:
            probes = list(cfg.probes)
        else:
            ctx = self.target.context or 2048
            probes = []
            T = min(256, ctx)
            if T >= MIN_INDUCTION_SEQ_LEN:
                probes.append(InductionProbe(n=100, seq_len=T))
            R = min(128, ctx) // 2 * 2
            if R >= 4:
                probes.append(RepeatedRandomProbe(n=32, seq_len=R))
            if self.natural is not None:
                probes.append(self.natural)
        return Monitor(probes, config=cfg.monitor)

    # ---- the hot path --------------------------------------------------------------------------
    def batch_start(self, batch) -> None:
        """Before each training micro-batch: freeze the natural probe from the first one."""
        if self.natural is None and self.monitor is None and self.config.natural and self.config.probes is None:
            ids = input_ids_of(batch)
            if ids is not None:
                self.natural = self._freeze_natural(ids)

    def batch_end(self, batch) -> None:
        """After each training micro-batch: count its tokens (all ranks' batches, assumed equal)."""
        if self.config.tokens_per_step is None:
            ids = input_ids_of(batch)
            if ids is not None:
                self.tokens_seen += ids.numel() * self.world_size

    def _freeze_natural(self, ids: torch.Tensor) -> ProbeSet | None:
        cfg = self.config
        T = min(cfg.natural_seq_len, ids.shape[1], self.target.context or ids.shape[1])
        stream = ids.detach().to("cpu", torch.int64).reshape(-1)
        n = min(cfg.natural_n, stream.numel() // T)
        if n < 1:
            self._warn("natural", "sinkwatch: the first training batch is too short for natural windows; natural probe skipped")
            return None
        return make_natural_probe(stream, n=n, seq_len=T, source="first training batch")

    def tokens_at(self, step: int) -> int:
        if self.config.tokens_per_step is not None:
            return step * self.config.tokens_per_step
        return self.tokens_seen

    def is_due(self, step: int) -> bool:
        if self.last_probed_step is not None and step <= self.last_probed_step:
            return False  # once per optimizer step, whatever the micro-batching
        cfg = self.config
        if step == 0:
            return cfg.probe_at_start
        if cfg.every_n_steps and step % cfg.every_n_steps == 0:
            return True
        return step in self._log_steps

    def step_end(self, step: int) -> None:
        """After an optimizer step (or at step 0 before training): probe if due."""
        if self._ready and self.is_due(step):
            self._probe_step(step)

    def train_end(self, step: int) -> None:
        if self._ready and self.config.probe_at_end and (self.last_probed_step is None or step > self.last_probed_step):
            self._probe_step(step)

    def _probe(self, step: int) -> None:
        with preserved_rng():  # reporters too: wandb.init draws its run id from Python's random
            self._probe_and_report(step)

    def _probe_and_report(self, step: int) -> None:
        tokens = self.tokens_at(step)
        try:
            if self.monitor is None:
                self.monitor = self._build_monitor()
                self._check_probe_hashes()
            with self._full_params():
                snap = self.monitor.probe(self.target, step=step, tokens=tokens)
        except Exception as exc:  # noqa: BLE001 - the monitor must never stop training
            self.last_probed_step = step
            if self.config.raise_on_error:
                raise
            msg = f"{type(exc).__name__}: {exc}"
            self._warn(
                f"probe:{type(exc).__name__}",
                f"sinkwatch: probe at step {step} failed ({msg}); training continues (raise_on_error=True to debug)",
            )
            self.reporter.log_error(step, msg)
            return
        self.last_probed_step = step
        self.n_probes += 1
        record = snap.to_record()
        if _has_non_finite(snap.values):
            self._warn(
                "nan", f"sinkwatch: non-finite attention statistics at step {step} (NaN/inf activations?); they are recorded as null"
            )
        self.reporter.log_record(record)
        for event in snap.events:
            ev = event.to_dict()
            self.reporter.log_event(ev)
            if self.config.on_event is not None:
                try:
                    self.config.on_event(ev)
                except Exception as exc:  # noqa: BLE001
                    self._warn("hook", f"sinkwatch: the on_event hook raised {type(exc).__name__}: {exc}; ignored")

    def finish(self) -> None:
        with preserved_rng():
            self.reporter.finish()

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # ---- resume --------------------------------------------------------------------------------
    def _check_probe_hashes(self) -> None:
        hashes = self.monitor.probe_hashes(self.target.vocab_size)
        if self._probe_hashes is not None and self._probe_hashes != hashes:
            raise ValueError(f"probe sets changed on resume ({self._probe_hashes} -> {hashes}); records would not be comparable")
        self._probe_hashes = hashes

    def state_dict(self) -> dict:
        """JSON-able state: probe hashes, natural tokens, tracker, counters."""
        tracker = self.monitor.tracker.state_dict() if self.monitor is not None else None
        return {
            "version": STATE_VERSION,
            "probe_hashes": self._probe_hashes,
            "natural_tokens": None if self.natural is None else self.natural.tokens.tolist(),
            "natural_params": None if self.natural is None else dict(self.natural.params),
            "tracker": tracker,
            "last_probed_step": self.last_probed_step,
            "tokens_seen": self.tokens_seen,
            "n_probes": self.n_probes,
        }

    def load_state_dict(self, state: dict) -> None:
        if not self._ready:
            self._pending_state = dict(state)  # applied at setup, once the model is known
            return
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"sinkwatch state version {state.get('version')} is not {STATE_VERSION}; start a new run directory")
        if state.get("natural_tokens") is not None:
            self.natural = ProbeSet("natural", torch.tensor(state["natural_tokens"]), {}, state["natural_params"])
        self.tokens_seen = int(state.get("tokens_seen") or 0)
        self.last_probed_step = state.get("last_probed_step")
        self.n_probes = int(state.get("n_probes") or 0)
        self._probe_hashes = state.get("probe_hashes")
        self.monitor = self._build_monitor()
        self._check_probe_hashes()
        if state.get("tracker") is not None:
            self.monitor.tracker.load_state_dict(state["tracker"])
        if self.jsonl is not None:
            moved = self.jsonl.rewind(self.last_probed_step)
            if moved:
                self._warn(
                    "rewind", f"sinkwatch: resumed at step {self.last_probed_step}; {moved} later log lines moved to *.superseded.jsonl"
                )


def _has_non_finite(values: dict) -> bool:
    # PR is left out: a head whose output is exactly zero has an undefined PR without any fault
    for key in ("sink_alpha", "p0_norm_ratio", "induction_score"):
        v = values.get(key)
        if v is not None and not np.all(np.isfinite(np.asarray(v, dtype=float))):
            return True
    v = values.get("sink_rate")
    return v is not None and not math.isfinite(v)
