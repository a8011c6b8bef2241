"""The framework-free core of live monitoring (SPEC §7), shared by the Lightning and HF adapters.

``LiveMonitor`` decides when to probe (every N optimizer steps and/or log-spaced steps, once per
step whatever the micro-batching), freezes the natural probe from the first training batches,
counts tokens, runs ``Monitor.probe``, feeds records and stage events to reporters, and keeps the
state a resumed run needs. It never lets a failure reach the training loop unless asked to.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from .capture import ProbeTarget, preserved_rng, resolve_target
from .distributed import (
    DONE,
    FAIL,
    START,
    PeerFailed,
    ProbeFaultEverywhere,
    ProbeForwardBroken,
    ProbeGroup,
    ProbeNotReady,
    RankFacts,
    check_layout,
    check_probe_memory,
    config_token,
    fault_point,
    fsdp1_param_dtype,
    fsdp1_root_runner,
    fsdp_full_params,
    rank_facts,
)
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
    preflight: bool = True  # before the first probe, one sequence of each set: a deterministic error there disables sinkwatch
    # data parallelism: every rank probes its share of the sequences, one all-reduce combines them (SPEC §9);
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


def attention_mask_of(batch, ids: torch.Tensor) -> torch.Tensor | None:
    """The batch's (B, T) ``attention_mask`` (1 = real token), when it has one of the ids' shape."""
    mask = batch.get("attention_mask") if hasattr(batch, "get") else None
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        return mask
    return None


def bos_of_batch(ids: torch.Tensor, bos_token_id: int | None, *, attention_mask: torch.Tensor | None = None) -> int | None:
    """``bos_token_id`` when every row of a (B, T) batch starts with it (after any left padding): a
    run trained with a BOS at every sequence start; else None."""
    if bos_token_id is None or ids is None or ids.dim() != 2 or ids.shape[1] < 1:
        return None
    ids = ids.detach().to("cpu", torch.int64)
    if attention_mask is not None:
        first = (attention_mask.detach().to("cpu") != 0).int().argmax(dim=1)  # the first real token of each row
        starts = ids.gather(1, first[:, None])[:, 0]
    else:
        starts = ids[:, 0]
    return int(bos_token_id) if bool((starts == int(bos_token_id)).all()) else None


def natural_windows(
    ids: torch.Tensor,
    seq_len: int,
    n: int,
    *,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> torch.Tensor:
    """Up to ``n`` windows (m, seq_len) of real tokens from a (B, T) training batch, spread over its rows.

    Each row's real tokens (``attention_mask`` 1; without a mask, the row minus any leading or
    trailing run of ``pad_token_id``, i.e. left or right padding) are cut into consecutive
    non-overlapping windows; windows are then taken round-robin, row 0's first, row 1's first, ...,
    row 0's second, ..., so a (8, 2048) batch gives 32 windows from all 8 rows, not 32 from row 0.
    With ``bos_token_id`` (a run whose rows start with that BOS: ``bos_of_batch``) every window is
    the BOS followed by ``seq_len - 1`` tokens of its row after the row's own BOS, so a window cut
    mid-row starts the way the model saw every sequence start in training.
    """
    ids = ids.detach().to("cpu", torch.int64)  # (B, T)
    keep = torch.ones_like(ids, dtype=torch.bool)
    if attention_mask is not None:
        keep = attention_mask.detach().to("cpu") != 0
    elif pad_token_id is not None:
        is_pad = ids == int(pad_token_id)
        real = ~is_pad
        # a position is padding when every token before it, or every token after it, is padding
        keep = (real.cumsum(1) > 0) & (real.flip(1).cumsum(1).flip(1) > 0)
    per_row = []
    body = seq_len - (bos_token_id is not None)
    for row, ok in zip(ids, keep):
        tokens = row[ok]
        if bos_token_id is not None:
            tokens = tokens[1:] if tokens.numel() and int(tokens[0]) == int(bos_token_id) else tokens
        m = tokens.numel() // body if body > 0 else 0
        windows = tokens[: m * body].view(m, body)
        if bos_token_id is not None:
            windows = torch.cat([torch.full((m, 1), int(bos_token_id), dtype=torch.int64), windows], dim=1)
        per_row.append(windows)
    picked = []
    for j in range(max((w.shape[0] for w in per_row), default=0)):
        for w in per_row:
            if j < w.shape[0] and len(picked) < n:
                picked.append(w[j])
    return torch.stack(picked) if picked else torch.empty(0, seq_len, dtype=torch.int64)


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
        self._in_root = None
        self._compute_dtype: tuple[torch.dtype, bool] = (torch.float32, False)  # the probe's dtype, and whether autocast makes it
        self.reporter: Reporter = Reporter()
        self._probe_step = _NoProbe()
        self.natural: ProbeSet | None = None
        self.tokens_seen = 0
        self.tokens_counted = False  # whether any batch was counted (else tokens are unknown, not 0)
        self.last_probed_step: int | None = None
        self.n_probes = 0
        self.max_steps: int | None = None
        self._log_steps: set[int] = set()
        self._pending_state: dict | None = None
        self._probe_hashes: dict | None = None
        self._probe_params: dict | None = None
        self._warned: set[str] = set()
        self._ready = False
        self.disabled: str | None = None  # why sinkwatch disabled itself (the pre-flight probe), or None
        self._preflighted = False
        self._retry_pending = False  # the last scheduled probe was skipped for lack of memory (ProbeNotReady): retried each step
        self.wandb_reporter = None
        self.jsonl: JSONLReporter | None = None
        self.world_size = 1
        self.rank: RankFacts | None = None
        self.group = ProbeGroup(1)  # the ranks that run each probe together (decided at setup)
        self.config_hash: str | None = None  # probe hashes + thresholds the records are made with
        self.tracker_since_step = 0  # the step the stage tracker's current segment started at

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
        zero3: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """At fit start. Resolves the model and refuses a layout no rank can probe (tensor
        parallelism; DeepSpeed ZeRO-3: ``zero3`` when the framework's config says stage 3) — a clear
        error now, never mid-run —, picks reporters on the logging rank and a no-op elsewhere, and
        whether this rank probes (decided once, here, by ``sinkwatch.distributed``: rank 0, or every
        rank together when the parameters are sharded).

        ``model``: what is probed (the bare module under DDP, never the DDP wrapper, which would
        hang). ``wrapped``: the model as the training strategy wraps it, where FSDP shards show
        (Lightning's ``trainer.strategy.model``); None: ``model`` itself. FSDP (v1) gathers through
        it: the root wrapper sits there, outside ``model`` (an inner unit alone would leave the rest
        sharded).

        ``compute_dtype``: the dtype the trainer computes in under mixed precision (Lightning's
        ``bf16-mixed``, ``TrainingArguments(bf16=True)``, OLMo-core's ``autocast_precision``); the probe
        forwards then run under autocast in it, statistics accumulating in float32, and records say
        ``probe_dtype``. None: FSDP v1 parameter mixed precision's ``param_dtype`` if any, else the
        model's own dtype (no autocast)."""
        self.target = resolve_target(model)
        outer = wrapped if wrapped is not None else model
        check_layout(outer, zero3=zero3)
        self._full_params = fsdp_full_params(outer)
        # FSDP v1 parameter mixed precision: the whole probe runs inside the root unit's forward (as the units compute in training)
        self._in_root = fsdp1_root_runner(outer)
        self._compute_dtype = probe_compute_dtype(self.target.module, compute_dtype)
        if self._in_root is not None and compute_dtype is None:
            self._compute_dtype = (fsdp1_param_dtype(outer), False)  # the units cast their own parameters: no autocast
        self.rank = rank_facts(outer, is_global_zero=is_global_zero, world_size=world_size, split=self.config.split_probe)
        self.group = ProbeGroup.for_rank(self.rank, prefer=self.target.device)
        self.group.fault_timeout_s = float(self.config.fault_timeout_s)
        self.world_size = self.rank.world_size
        self.max_steps = max_steps if max_steps and max_steps > 0 else None
        if self.config.log_spaced:  # one schedule for the whole run: rank 0's (ranks with unequal data estimate differently)
            self.max_steps = shared_max_steps(self.max_steps, self.target.device)
        self._log_steps = log_spaced_steps(self.config.log_spaced, self.max_steps) if self.config.log_spaced and self.max_steps else set()
        if self.config.log_spaced and self.max_steps is None:
            self._warn(
                "log-spaced",
                f"sinkwatch: log_spaced={self.config.log_spaced} needs the number of optimizer steps the run will take, and the "
                "trainer cannot say (Lightning: an iterable dataset without __len__ and no max_steps, or max_epochs=-1); no "
                "log-spaced steps are probed (every_n_steps, the first and the last step still are). Set the trainer's max_steps.",
            )
        if self.rank.reports_here:
            self.reporter = self._make_reporters(wandb_run)
        self._probe_step = self._probe if self.rank.probes_here else _NoProbe()
        self._ready = True
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    def _preflight(self) -> None:
        """One sequence of each probe set through the model before the first probe (not in ``setup``:
        a model's first forward may be a collective of every rank, as composable DDP's lazy init is in
        OLMo-core), on every rank that probes, in step. A deterministic error there (every rank raising it, not an out-of-memory) would fail
        every probe of the run: sinkwatch disables itself with one error line and one warning, and
        training goes on. Probe sets that cannot be built, or that differ between ranks, are left to
        the first probe (its error line names them); a fault only some ranks raise is too."""
        with preserved_rng(), eager_forwards():
            group = self.group
            group.begin()
            one = None
            try:
                sets = self._build_monitor().probe_sets(self.target.vocab_size)
                one = Monitor([s.subset(1) for s in sets], config=self.config.monitor)
                token = config_token(config_hash(one.probe_hashes(self.target.vocab_size), one.config))
            except Exception:  # noqa: BLE001 - the first probe reports what cannot be built
                token = 0
            if not group.agree(START if one is not None else FAIL, token):
                return
            error: Exception | None = None
            with group.collective(None, "the pre-flight probe"), self._gathered() as run:
                try:
                    with self._autocast():
                        run(lambda: one.probe(group.guard(self.target, None, token), track=False, share=group.share(None, token)))
                except ProbeForwardBroken:
                    raise
                except Exception as exc:  # noqa: BLE001
                    error = exc
            if group.agree(DONE if error is None else FAIL, token):
                return
            local = None if error is None or isinstance(error, PeerFailed) else error
            deterministic = local is not None and not isinstance(local, torch.OutOfMemoryError) and "out of memory" not in str(local)
            if not all(group.gather(deterministic)):
                return  # a fault on some ranks only, or an out-of-memory: the probes themselves will say
            cause = local.__cause__ if isinstance(local, ProbeFaultEverywhere) and local.__cause__ is not None else local
            msg = (
                f"sinkwatch is disabled for this run: the pre-flight probe (one sequence of each probe set, before the first "
                f"probe) raised "
                f"{type(cause).__name__}: {cause}" + (" on every rank" if group.size > 1 else "") + "; every probe would fail "
                "the same way. Training goes on unwatched. Fix the model or the probe options (raise_on_error=True shows the "
                "traceback), or set preflight=False to try every probe anyway."
            )
            self._probe_step = _NoProbe()
            self.disabled = msg
            if self.config.raise_on_error:
                raise RuntimeError(msg) from local
            self._warn("preflight", msg)
            self.reporter.log_error(None, msg)

    def add_reporter(self, reporter: Reporter) -> None:
        """A reporter the adapter builds from the trainer (its loggers, its report_to integrations),
        added after ``setup`` and before the first probe; a no-op on ranks that do not report."""
        if isinstance(self.reporter, MultiReporter):
            self.reporter.reporters.append(reporter)

    def _make_reporters(self, wandb_run) -> Reporter:
        cfg = self.config
        # a store holds one run: unless a checkpoint's state resumes this one first, an earlier run's files move aside
        self.jsonl = JSONLReporter(cfg.out_dir, new_run=True)
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
        """Before each training micro-batch: freeze the natural probe from the first one. Ranks that
        probe together (sharded parameters) all take rank 0's windows, broadcast here: each rank's
        first batch differs, and differing windows would make the ranks run different forwards
        (the BOS-free twin runs only for windows that share their first token)."""
        if self.natural is None and self.monitor is None and self.config.natural and self.config.probes is None:
            ids = input_ids_of(batch)
            if self.group.size > 1:
                windows = self._natural_windows(ids, attention_mask_of(batch, ids)) if self.group.is_root and ids is not None else None
                windows = self.group.broadcast_windows(windows)
                self.natural = self._natural_probe(windows) if windows is not None else None
            elif ids is not None:
                windows = self._natural_windows(ids, attention_mask_of(batch, ids))
                self.natural = self._natural_probe(windows) if windows is not None else None

    def batch_end(self, batch) -> None:
        """After each training micro-batch: count its tokens (every data-parallel rank's batch,
        assumed equal; ``world_size`` is the data-parallel size, so tensor-parallel peers reading
        the same batch are not counted twice)."""
        if self.config.tokens_per_step is None:
            ids = input_ids_of(batch)
            if ids is not None:
                self.tokens_seen += ids.numel() * self.world_size
                self.tokens_counted = True

    def count_tokens_total(self, total: int) -> None:
        """A trainer's own count of the tokens seen so far, all ranks together."""
        if self.config.tokens_per_step is None and total > 0:
            self.tokens_seen = int(total)
            self.tokens_counted = True

    def _natural_windows(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """The (m, T) natural windows of a first training batch, or None (one warning) when it is too short."""
        cfg = self.config
        T = min(cfg.natural_seq_len, ids.shape[1], self.target.context or ids.shape[1])
        model_config = getattr(self.target.module, "config", None)
        pad_id = getattr(model_config, "pad_token_id", None) if attention_mask is None else None
        # a run whose rows all start with the model's BOS: every window starts with it too (SPEC §3)
        bos = bos_of_batch(ids, getattr(model_config, "bos_token_id", None), attention_mask=attention_mask)
        windows = natural_windows(ids, T, cfg.natural_n, attention_mask=attention_mask, pad_token_id=pad_id, bos_token_id=bos)
        if windows.shape[0] < 1:
            self._warn("natural", "sinkwatch: the first training batch is too short for natural windows; natural probe skipped")
            return None
        self._warn_short_windows(windows)
        return windows

    def _warn_short_windows(self, windows: torch.Tensor) -> None:
        """One warning when the first batch gives fewer or shorter windows than asked (issue 25)."""
        cfg = self.config
        m, T = windows.shape
        if m < cfg.natural_n or T < cfg.natural_seq_len:
            self._warn(
                "natural-short",
                f"sinkwatch: the first training batch gives {m} natural windows of {T} tokens where {cfg.natural_n} x "
                f"{cfg.natural_seq_len} were asked; the natural probe is frozen from it (step 0 is probed before any later "
                "batch arrives, and every record uses the same windows), so later, longer batches change nothing. Records say "
                "natural_probe {n, seq_len}. Lower natural_n / natural_seq_len, make the first batch longer, or pass "
                "probes=[..., make_natural_probe(tokens, n, seq_len)] built from your data.",
            )

    def _natural_probe(self, windows: torch.Tensor) -> ProbeSet:
        n, T = windows.shape
        bos = getattr(getattr(self.target.module, "config", None), "bos_token_id", None)
        if bos is not None and bool((windows[:, 0] == int(bos)).all()):  # BOS windows: the probe's params say so
            probe = make_natural_probe(windows[:, 1:], n=n, seq_len=T, bos_token_id=int(bos), source="first training batch")
        else:
            probe = make_natural_probe(windows, n=n, seq_len=T, source="first training batch")
        # what was asked beside what the first batch gave (n, seq_len): a short first batch shows in the record
        probe.params.update({"requested_n": self.config.natural_n, "requested_seq_len": self.config.natural_seq_len})
        return probe

    def tokens_at(self, step: int) -> int | None:
        """Tokens seen by ``step``; None (recorded as null, one warning) when no batch could be counted."""
        if self.config.tokens_per_step is not None:
            return step * self.config.tokens_per_step
        if step == 0:
            return 0  # the initial model, whatever batches were read to freeze the natural probe
        if not self.tokens_counted:
            self._warn(
                "tokens",
                "sinkwatch: no training batch held (B, T) input_ids, so tokens cannot be counted; records say tokens: null. "
                "Pass tokens_per_step=... (tokens per optimizer step, all ranks), or for the HF Trainer "
                "TrainingArguments(include_num_input_tokens_seen=True).",
            )
            return None
        return self.tokens_seen

    def is_due(self, step: int) -> bool:
        if self.last_probed_step is not None and step <= self.last_probed_step:
            return False  # once per optimizer step, whatever the micro-batching
        if self._retry_pending:
            return True  # a probe skipped for lack of memory: every step until one is written (the next scheduled one at the latest)
        cfg = self.config
        if step == 0:
            return cfg.probe_at_start
        if cfg.every_n_steps and step % cfg.every_n_steps == 0:
            return True
        return step in self._log_steps

    def _scheduled(self, step: int) -> bool:
        cfg = self.config
        if step == 0:
            return cfg.probe_at_start
        return bool(cfg.every_n_steps and step % cfg.every_n_steps == 0) or step in self._log_steps

    def step_end(self, step: int) -> None:
        """After an optimizer step (or at step 0 before training): probe if due."""
        if self._ready and self.is_due(step):
            self._probe_step(step)

    def train_end(self, step: int) -> None:
        if self._ready and self.config.probe_at_end and (self.last_probed_step is None or step > self.last_probed_step):
            self._probe_step(step)

    def _probe(self, step: int) -> None:
        with preserved_rng(), eager_forwards():  # reporters too: wandb.init draws its run id from Python's random
            if self.config.preflight and not self._preflighted:
                self._preflighted = True
                self._preflight()
                if self.disabled is not None:
                    return
            self._probe_and_report(step)

    def _probe_and_report(self, step: int) -> None:
        tokens = self.tokens_at(step)
        group = self.group
        group.begin()
        error: Exception | None = None
        tracker = None
        snap = None
        try:  # the inputs and the memory check, before any collective of the probe
            if self.monitor is None:
                self.monitor = self._build_monitor()
                self._check_probe_hashes()
            tracker = self.monitor.tracker.state_dict()
            check_probe_memory(self.target, self.monitor.probe_sets(self.target.vocab_size), self.monitor.config.batch_tokens, step)
        except Exception as exc:  # noqa: BLE001 - the monitor must never stop training
            error = exc
        token = config_token(self.config_hash)
        ok = group.agree(START if error is None else FAIL, token)  # one go/no-go, same probe sets on every rank
        if ok:
            with group.collective(step, "gathering the full parameters"), self._gathered() as run:  # FSDP v1: a collective
                try:
                    with self._autocast():
                        snap = run(
                            lambda: self.monitor.probe(
                                group.guard(self.target, step, token), step=step, tokens=tokens, share=group.share(step, token)
                            )
                        )
                    fault_point("after", step)
                except ProbeForwardBroken:
                    raise  # the other ranks wait inside a forward: never go on to training's collectives out of step
                except Exception as exc:  # noqa: BLE001
                    error = exc
            ok = group.agree(DONE if error is None else FAIL, token)  # nothing is written unless every rank succeeded
        self.last_probed_step = step
        retrying, self._retry_pending = self._retry_pending and not self._scheduled(step), False
        if not ok:
            if tracker is not None:  # the tracker never counts a probe that was not written
                self.monitor.tracker.load_state_dict(tracker)
            self._probe_failed(step, error, retrying=retrying)
            return
        self.n_probes += 1
        record = snap.to_record()
        record["config_hash"] = self.config_hash
        record["tracker_since_step"] = self.tracker_since_step
        record["probe_dtype"] = dtype_name(self._compute_dtype[0])
        if self.natural is not None:  # what the natural windows hold, beside what was asked (a short first batch)
            keys = ("n", "seq_len", "requested_n", "requested_seq_len")
            record["natural_probe"] = {k: self.natural.params[k] for k in keys if k in self.natural.params}
        if _has_non_finite(snap.values):
            self._warn(
                "nan", f"sinkwatch: non-finite attention statistics at step {step} (NaN/inf activations?); they are recorded as null"
            )
        self.reporter.log_record(record)
        for event in snap.events:
            ev = event.to_dict()
            self.reporter.log_event(ev)
            if self.config.on_event is not None and self.rank.reports_here:  # FSDP: every rank probes, one calls the hook
                try:
                    self.config.on_event(ev)
                except Exception as exc:  # noqa: BLE001
                    self._warn("hook", f"sinkwatch: the on_event hook raised {type(exc).__name__}: {exc}; ignored")

    @contextlib.contextmanager
    def _gathered(self):
        """Where the probe runs: inside the FSDP v1 root's forward (parameter mixed precision), or in
        ``summon_full_params`` on the outermost units (FSDP v1), or as is; yields ``run(fn)``."""
        if self._in_root is not None:
            yield self._in_root
        else:
            with self._full_params():
                yield lambda fn: fn()

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The probe forwards in the trainer's compute dtype (autocast), or as the model is."""
        dtype, cast = self._compute_dtype
        if not cast:
            return contextlib.nullcontext()
        return torch.autocast(self.target.device.type, dtype=dtype)

    def _probe_failed(self, step: int, error: Exception | None, *, retrying: bool = False) -> None:
        """Every rank of the group saw the same failed verdict: one error line (rank 0), one warning per
        kind of fault, ``sinkwatch/probe_skipped`` to every reporter, training goes on
        (``raise_on_error``: every rank raises). A skip for lack of memory (``ProbeNotReady`` on any
        rank: every rank decides alike from the gathered faults) is retried at each later step until a
        probe is written, the next scheduled one at the latest; a retry that fails again says nothing."""
        local = None if error is None or isinstance(error, PeerFailed) else f"{type(error).__name__}: {error}"
        # every rank's own fault (None: none here), config hash, and whether it was short of memory
        faults = self.group.gather((local, self.config_hash, isinstance(error, ProbeNotReady)))
        self._retry_pending = any(short for _, _, short in faults)
        if self.group.size == 1:
            msg = local or "the probe failed"
        else:
            named = [f"rank {r}: {m}" for r, (m, _, _) in enumerate(faults) if m is not None]
            hashes = ", ".join(f"rank {r}: {h}" for r, (_, h, _) in enumerate(faults))
            differ = f"the ranks' probe sets or thresholds differ (config_hash {hashes}); give every rank the same options"
            msg = "; ".join(named) if named else differ
            msg = f"{msg} (every rank skipped this probe; no rank wrote it)"
        if self._retry_pending:
            msg = f"{msg}; retried at each later step until one is written (the next scheduled probe at the latest)"
        if self.config.raise_on_error:
            if error is not None and not isinstance(error, PeerFailed):
                raise error
            raise RuntimeError(f"sinkwatch: probe at step {step} failed: {msg}")
        if retrying:
            return  # the skip was reported at the scheduled step
        kind = type(error).__name__ if local is not None else "peer"
        self._warn(f"probe:{kind}", f"sinkwatch: probe at step {step} failed ({msg}); training continues (raise_on_error=True to debug)")
        self.reporter.log_error(step, msg)
        self.reporter.log_skip(step, self.tokens_at(step), msg)

    def finish(self) -> None:
        with preserved_rng():
            self.reporter.finish()

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # ---- resume --------------------------------------------------------------------------------
    def _check_probe_hashes(self) -> None:
        self._probe_hashes = self.monitor.probe_hashes(self.target.vocab_size)
        # with the hashes, the parameters that rebuild each set: replay of the checkpoints probes the same sets
        self._probe_params = {s.kind: dict(s.params) for s in self.monitor.probe_sets(self.target.vocab_size)}
        self.config_hash = config_hash(self._probe_hashes, self.monitor.config)
        if self.jsonl is not None:  # the live store keeps them too, for checkpoints without a trainer state
            try:
                self.jsonl.write_probes(live_probes(self.state_dict()))
            except (OSError, TypeError, ValueError) as exc:  # never a lost probe or a stopped run over this file
                self._warn("probes.json", f"sinkwatch: could not write probes.json to {self.jsonl.dir} ({exc}); replay then needs --probe")

    def state_dict(self) -> dict:
        """JSON-able state: probe hashes, natural tokens, tracker, counters."""
        tracker = self.monitor.tracker.state_dict() if self.monitor is not None else None
        return {
            "version": STATE_VERSION,
            "probe_hashes": self._probe_hashes,
            "probe_params": self._probe_params,
            "natural_tokens": None if self.natural is None else self.natural.tokens.tolist(),
            "natural_params": None if self.natural is None else dict(self.natural.params),
            "tracker": tracker,
            "last_probed_step": self.last_probed_step,
            "tokens_seen": self.tokens_seen,
            "n_probes": self.n_probes,
            "config_hash": self.config_hash,
            "tracker_since_step": self.tracker_since_step,
            "probe_dtype": dtype_name(self._compute_dtype[0]),  # replay of a live store probes in it (--dtype not given)
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
        self.tokens_counted = self.tokens_counted or self.tokens_seen > 0
        self.last_probed_step = state.get("last_probed_step")
        self.n_probes = int(state.get("n_probes") or 0)
        if self.jsonl is not None:  # the store is this run's: settled before anything writes to it (probes.json, below)
            moved = self.jsonl.resume(self.last_probed_step)
            if moved:
                self._warn(
                    "rewind", f"sinkwatch: resumed at step {self.last_probed_step}; {moved} later log lines moved to *.superseded.jsonl"
                )
        saved_hashes = state.get("probe_hashes")
        self.monitor = self._build_monitor()
        self._check_probe_hashes()
        tracker = state.get("tracker")
        changed = []
        if saved_hashes is not None and saved_hashes != self._probe_hashes:
            changed.append(f"probes {saved_hashes} -> {self._probe_hashes}")
        if tracker is not None and tracker.get("config") != self.monitor.config.stages.to_dict():
            changed.append("stage thresholds")
        if changed:
            # the monitor never stops the run: earlier records stay as written (each carries the
            # config_hash that made it); the tracker starts over under the new configuration
            self.tracker_since_step = self.last_probed_step or 0
            self._warn(
                "resume-config",
                f"sinkwatch: resumed at step {self.last_probed_step} with changed {' and '.join(changed)}; earlier records are kept "
                f"(config_hash {state.get('config_hash')}), and the stage tracker starts a new segment at step "
                f"{self.tracker_since_step} (config_hash {self.config_hash}; records carry config_hash and tracker_since_step)",
            )
        else:
            self.tracker_since_step = int(state.get("tracker_since_step") or 0)
            if tracker is not None:
                self.monitor.tracker.load_state_dict(tracker)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the record's ``probe_dtype``)."""
    return str(dtype).removeprefix("torch.")


def probe_compute_dtype(module, compute_dtype: torch.dtype | None) -> tuple[torch.dtype, bool]:
    """(the dtype the probe forward computes in, whether autocast must make it so). The model's own
    floating dtype when no compute dtype is given or it equals that (bf16-true weights: no autocast)."""
    own = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    if compute_dtype is None or compute_dtype == own:
        return own, False
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise TypeError(f"compute_dtype must be a floating torch.dtype (torch.bfloat16, torch.float16), got {compute_dtype!r}")
    return compute_dtype, True


def shared_max_steps(max_steps: int | None, device: torch.device) -> int | None:
    """Rank 0's planned number of optimizer steps on every rank of the default process group (a
    collective every rank runs at setup; alone: ``max_steps`` itself). Each rank's trainer estimates
    the run from its own data (Lightning's ``estimated_stepping_batches``), and log-spaced steps
    computed from unequal estimates would send one rank into a probe the others never start."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return max_steps
    from .distributed import group_device

    on = group_device(str(dist.get_backend()), device)
    value = torch.tensor([max_steps if max_steps is not None else -1], dtype=torch.int64, device=on)
    dist.broadcast(value, src=0)
    steps = int(value.item())
    return steps if steps > 0 else None


def eager_forwards() -> contextlib.AbstractContextManager:
    """Probe forwards run eagerly through compiled modules (``torch.compiler.set_stance("force_eager")``):
    under per-block ``torch.compile`` (OLMo-core's ``apply_compile``, ``module.compile()``) Dynamo
    would otherwise trace each block again with sinkwatch's hooks on it (2 -> 44 graphs after one
    probe of a 2-block model), and a ``fullgraph=True`` block would fail the probe. Training's own
    graphs stay as they were; the stance is restored on the way out."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def live_probes(state: dict) -> dict:
    """What ``probes.json`` of a live store holds: the probe sets' hashes and parameters and the frozen
    natural windows (the callback state's probe keys), for ``sinkwatch replay DIR --live-store STORE``."""
    keys = ("version", "probe_hashes", "probe_params", "natural_tokens", "natural_params")
    return {**{k: state[k] for k in keys}, "probe_dtype": state.get("probe_dtype")}


def config_hash(probe_hashes: dict, monitor_config: MonitorConfig) -> str:
    """12 hex digits naming what makes records comparable: the probe sets' hashes, the stage
    thresholds and the metric settings (K, epsilon)."""
    payload = {
        "probes": dict(sorted(probe_hashes.items())),
        "stages": monitor_config.stages.to_dict(),
        "n_first": monitor_config.n_first,
        "sink_epsilon": monitor_config.sink_epsilon,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _has_non_finite(values: dict) -> bool:
    # PR is left out: a head whose output is exactly zero has an undefined PR without any fault.
    # Blocks without softmax attention (hybrid stacks) are NaN rows of the attention arrays by design.
    softmax = values.get("softmax_layers")
    for key in ("sink_alpha", "p0_norm_ratio", "induction_score"):
        v = values.get(key)
        if v is None:
            continue
        v = np.asarray(v, dtype=float)
        if key != "p0_norm_ratio" and softmax is not None:
            v = v[list(softmax)]
        if not np.all(np.isfinite(v)):
            return True
    v = values.get("sink_rate")
    return v is not None and not math.isfinite(v)
