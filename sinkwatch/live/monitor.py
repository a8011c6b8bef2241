"""The framework-free core of live monitoring (docs/design.md §7), shared by every adapter.

``LiveMonitor`` decides when to probe (``Schedule``: every N optimizer steps and/or log-spaced steps,
once per step whatever the micro-batching, a probe skipped for lack of memory retried with a backoff),
freezes the natural probe from the first training batch, counts tokens, runs each probe through the
rank protocol (``ProbeGroup.run``) on this rank's layout (``ProbeLayout``), tracks the run's stages
(``StageTracker``), feeds records and events to reporters, and keeps the state a resumed run needs.
It never lets a failure reach the training loop unless asked to.
"""

from __future__ import annotations

import warnings

import torch

from ..capture import ProbeTarget, preserved_rng, resolve_target
from ..distributed import (
    ProbeFaultEverywhere,
    ProbeGroup,
    ProbeLayout,
    RankFacts,
    TensorParallel,
    check_layout,
    describe,
    dtype_name,
    fault_point,
    is_out_of_memory,
    shared_max_steps,
)
from ..probe.memory import check_probe_memory
from ..probe.monitor import Monitor, has_non_finite
from ..probes import ProbeSet, attention_mask_of, batch_windows, default_probes, input_ids_of, probe_of_windows, short_windows
from ..reporters import JSONLReporter, MultiReporter, Reporter, live_reporters
from ..stages import StageTracker
from .config import LiveConfig
from .resume import STATE_VERSION, last_stored_step, live_probes, on_every_rank, state_from_store
from .schedule import Schedule, log_spaced_steps


# ---- the monitor ---------------------------------------------------------------------------------------
class LiveMonitor:
    """Framework-free live monitor. Adapters call: ``setup`` (fit start), ``batch_start`` and
    ``batch_end`` (every micro-batch), ``step_end`` (after each optimizer step, and at step 0 once the
    first batch is read, before its forward), ``train_end`` and ``finish``; ``state_dict`` /
    ``load_state_dict`` for checkpoints. A probe never runs between a backward and its optimizer step."""

    def __init__(self, config: LiveConfig):
        self.config = config
        self.monitor: Monitor | None = None
        self.target: ProbeTarget | None = None
        # the ranks that run each probe together, and this rank's layout (``self.layout``): decided at setup
        self.group = ProbeGroup(1, layout=ProbeLayout(RankFacts(is_global_zero=True, world_size=1, sharding=None)))
        self.schedule = Schedule(config)
        self.tracker = StageTracker(config.monitor.stages)
        self.tracker_since_step = 0  # the step the stage tracker's current segment started at
        self.reporter: Reporter = Reporter()
        self.wandb_reporter = None
        self.jsonl: JSONLReporter | None = None
        self.natural: ProbeSet | None = None
        self.tokens_seen = 0
        self.tokens_counted = False  # whether any batch was counted (else tokens are unknown, not 0)
        self.last_probed_step: int | None = None
        self.n_probes = 0
        self.max_steps: int | None = None
        self.config_hash: str | None = None  # probe hashes + thresholds the records are made with
        self.disabled: str | None = None  # why sinkwatch disabled itself (the pre-flight probe), or None
        self._probe_hashes: dict | None = None
        self._probe_params: dict | None = None
        self._pending_state: dict | None = None
        self._warned: set[str] = set()
        self._ready = False
        self._preflighted = False

    @property
    def layout(self) -> ProbeLayout:
        """This rank's layout: the group's, which runs each probe on it."""
        return self.group.layout

    @property
    def rank(self) -> RankFacts:
        return self.layout.facts

    @property
    def world_size(self) -> int:
        return self.layout.facts.world_size

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
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        """At fit start. Resolves the model and refuses a layout no rank can probe (tensor parallelism no adapter described;
        DeepSpeed ZeRO-3: ``zero3`` when the framework's config says stage 3) — a clear error now, never
        mid-run —, decides how this rank probes (``ProbeLayout``: rank 0, or every rank together when the
        parameters are sharded or the probe split) and picks reporters on the logging rank.

        ``model``: what is probed (the bare module under DDP, never the DDP wrapper, which would hang).
        ``wrapped``: the model as the training strategy wraps it, where FSDP shards show (Lightning's
        ``trainer.strategy.model``); None: ``model`` itself. ``compute_dtype``: the trainer's autocast
        dtype under mixed precision (``ProbeLayout.of``); records say ``probe_dtype``. ``tensor_parallel``:
        this rank's place under tensor parallelism (the adapter reads it off the framework's mesh): every
        rank computes its own heads, the probe split over the data-parallel replicas
        (``sinkwatch.distributed.tensor_parallel``); ``world_size`` is then ``tensor_parallel.dp_size``."""
        cfg = self.config
        self.target = resolve_target(model)
        outer = wrapped if wrapped is not None else model
        check_layout(outer, zero3=zero3, tensor_parallel=tensor_parallel)
        if tensor_parallel is not None and not cfg.split_probe and tensor_parallel.size > 1 and tensor_parallel.dp_size > 1:
            raise ValueError(
                "sinkwatch: split_probe=False cannot apply under tensor parallelism: the ranks of every tensor-parallel group "
                "must run each probe forward together (its all-reduces), so every data-parallel replica probes its share; "
                "leave split_probe at True"
            )
        layout = ProbeLayout.of(
            self.target.module, outer, is_global_zero=is_global_zero, world_size=world_size, split=cfg.split_probe,
            compute_dtype=compute_dtype, tp=tensor_parallel,
        )  # fmt: skip
        self.group = ProbeGroup.for_layout(layout, prefer=self.target.device, fault_timeout_s=float(cfg.fault_timeout_s))
        self.max_steps = max_steps if max_steps and max_steps > 0 else None
        if cfg.log_spaced:  # one schedule for the whole run: rank 0's (ranks with unequal data estimate differently)
            self.max_steps = shared_max_steps(self.max_steps, self.target.device)
        log_steps = log_spaced_steps(cfg.log_spaced, self.max_steps) if cfg.log_spaced and self.max_steps else set()
        self.schedule = Schedule(cfg, log_steps)
        if cfg.log_spaced and self.max_steps is None:
            self._warn(
                "log-spaced",
                f"sinkwatch: log_spaced={cfg.log_spaced} needs the number of optimizer steps the run will take, and the "
                "trainer cannot say (Lightning: an iterable dataset without __len__ and no max_steps, or max_epochs=-1); no "
                "log-spaced steps are probed (every_n_steps, the first and the last step still are). Set the trainer's max_steps.",
            )
        if self.rank.reports_here:
            self.reporter, self.jsonl, self.wandb_reporter = live_reporters(cfg, wandb_run=wandb_run, warn=self._warn)
        self._ready = True
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    def add_reporter(self, reporter: Reporter) -> None:
        """A reporter the adapter builds from the trainer (its loggers, its report_to integrations),
        added after ``setup`` and before the first probe; a no-op on ranks that do not report."""
        if isinstance(self.reporter, MultiReporter):
            self.reporter.reporters.append(reporter)

    def _build_monitor(self) -> Monitor:
        cfg = self.config
        probes = list(cfg.probes) if cfg.probes is not None else default_probes(self.target.context, natural=self.natural)
        return Monitor(probes, config=cfg.monitor)

    # ---- batches -------------------------------------------------------------------------------
    def batch_start(self, batch) -> None:
        """Before each training micro-batch: freeze the natural probe from the first one. Ranks that
        probe together all take rank 0's windows, broadcast here: each rank's first batch differs, and
        differing windows would make the ranks run different forwards (the BOS-free twin runs only for
        windows that share their first token)."""
        cfg = self.config
        if self.natural is not None or self.monitor is not None or not cfg.natural or cfg.probes is not None:
            return
        ids = input_ids_of(batch)
        windows = None
        if ids is not None and (self.group.size == 1 or self.group.is_root):
            windows = batch_windows(
                ids, attention_mask_of(batch, ids), n=cfg.natural_n, seq_len=cfg.natural_seq_len, context=self.target.context,
                config=getattr(self.target.module, "config", None),
            )  # fmt: skip
            if windows.shape[0] < 1:
                self._warn("natural", "sinkwatch: the first training batch is too short for natural windows; natural probe skipped")
                windows = None
        if self.group.size > 1:
            windows = self.group.broadcast_windows(windows)
        elif ids is None:
            return  # alone, a batch without ids: the next one may have them
        if windows is not None:
            short = short_windows(windows, cfg.natural_n, cfg.natural_seq_len)
            if short:
                self._warn("natural-short", short)
            bos = getattr(getattr(self.target.module, "config", None), "bos_token_id", None)
            self.natural = probe_of_windows(windows, bos_token_id=bos, requested=(cfg.natural_n, cfg.natural_seq_len))

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

    # ---- probes --------------------------------------------------------------------------------
    def is_due(self, step: int) -> bool:
        return self.schedule.due(step, self.last_probed_step)

    def step_end(self, step: int) -> None:
        """After an optimizer step (or at step 0, before the first forward): probe if due."""
        if self._ready and self.is_due(step):
            self._probe(step)

    def train_end(self, step: int) -> None:
        if self._ready and self.config.probe_at_end and (self.last_probed_step is None or step > self.last_probed_step):
            self._probe(step)

    def _probe(self, step: int) -> None:
        if not self.rank.probes_here or self.disabled is not None:
            return
        with preserved_rng():  # reporters too: wandb.init draws its run id from Python's random
            if self.config.preflight and not self._preflighted:
                self._preflighted = True
                self._preflight()
                if self.disabled is not None:
                    return
            self._probe_and_report(step)

    def _preflight(self) -> None:
        """One sequence of each probe set through the model before the first probe (not in ``setup``:
        a model's first forward may be a collective of every rank, as composable DDP's lazy init is in
        OLMo-core), on every rank that probes, in step: one call of the rank protocol. A deterministic
        error there (every rank raising one, not an out-of-memory) would fail every probe of the run:
        sinkwatch disables itself with one error line and one warning, and training goes on. Probe sets
        that cannot be built, or that differ between ranks, are left to the first probe (its error line
        names them); a fault only some ranks raise is too."""
        try:
            sets = self._build_monitor().probe_sets(self.target.vocab_size)
            one = Monitor([s.subset(1) for s in sets], config=self.config.monitor)
            label = one.config_hash(self.target.vocab_size)
        except Exception:  # noqa: BLE001 - the first probe reports what cannot be built
            one = label = None

        def check() -> str:
            if one is None:
                raise ValueError("the probe sets cannot be built (the first probe says why)")
            return label

        outcome = self.group.run(None, lambda target, share: one.probe(target, share=share), target=self.target, check=check)
        faults = outcome.faults or []
        if outcome.ok or one is None or not all(m is not None and not is_out_of_memory(m) for m, _ in faults):
            return  # healthy, or a fault on some ranks only, or an out-of-memory: the probes themselves will say
        error = outcome.error
        cause = error.__cause__ if isinstance(error, ProbeFaultEverywhere) and error.__cause__ is not None else error
        msg = (
            f"sinkwatch is disabled for this run: the pre-flight probe (one sequence of each probe set, before the first "
            f"probe) raised {type(cause).__name__}: {cause}" + (" on every rank" if self.group.size > 1 else "") + "; every "
            "probe would fail the same way. Training goes on unwatched. Fix the model or the probe options (raise_on_error=True "
            "shows the traceback), or set preflight=False to try every probe anyway."
        )
        self.disabled = msg
        if self.config.raise_on_error:
            raise RuntimeError(msg) from error
        self._warn("preflight", msg)
        self.reporter.log_error(None, msg)

    def _probe_and_report(self, step: int) -> None:
        tokens = self.tokens_at(step)
        delayed_from = self.schedule.delayed_from(step)

        def check() -> str:  # this rank's inputs and memory, before any collective of the probe
            if self.monitor is None:
                self.monitor = self._build_monitor()
                self._check_probe_hashes()
            fault_point("memory", step)
            check_probe_memory(
                self.target, self.monitor.probe_sets(self.target.vocab_size), self.monitor.config.batch_tokens,
                ranks=self._shares(), dtype=self.layout.dtype, outer=self.layout.outer,
            )  # fmt: skip
            return self.config_hash

        def probe(target, share):
            return self.monitor.probe(target, share=share, step=step, tokens=tokens)

        outcome = self.group.run(step, probe, target=self.target, check=check, quiet=delayed_from is not None)
        self.last_probed_step = step
        self.schedule.ran(step, short_of_memory=outcome.short)
        if not outcome.ok:
            self._probe_failed(step, outcome, retrying=delayed_from is not None)
            return
        self.n_probes += 1
        events = self.tracker.track(outcome.value)  # only written probes reach the tracker
        record = outcome.value.to_record()
        record["config_hash"] = self.config_hash
        record["tracker_since_step"] = self.tracker_since_step
        record["probe_dtype"] = dtype_name(self.layout.dtype)
        if delayed_from is not None:
            record["scheduled_step"] = delayed_from  # skipped there for lack of memory; these are the weights at ``step``
        if self.natural is not None:  # what the natural windows hold, beside what was asked (a short first batch)
            keys = ("n", "seq_len", "requested_n", "requested_seq_len")
            record["natural_probe"] = {k: self.natural.params[k] for k in keys if k in self.natural.params}
        if has_non_finite(outcome.value.values):
            self._warn(
                "nan", f"sinkwatch: non-finite attention statistics at step {step} (NaN/inf activations?); they are recorded as null"
            )
        self.reporter.log_record(record)
        for event in events:
            ev = event.to_dict()
            self.reporter.log_event(ev)
            if self.config.on_event is not None and self.rank.reports_here:  # every rank of a group sees the events; one calls the hook
                try:
                    self.config.on_event(ev)
                except Exception as exc:  # noqa: BLE001
                    self._warn("hook", f"sinkwatch: the on_event hook raised {type(exc).__name__}: {exc}; ignored")

    def _shares(self) -> int:
        """How many shares each probe's sequences are split into (data-parallel replicas under tensor parallelism)."""
        if not self.rank.split:
            return 1
        return self.rank.tp.dp_size if self.rank.tp is not None else self.group.size

    def _probe_failed(self, step: int, outcome, *, retrying: bool) -> None:
        """Every rank of the group saw the same failed verdict: one error line (rank 0), one warning per
        kind of fault, ``sinkwatch/probe_skipped`` to every reporter, training goes on (``raise_on_error``:
        every rank raises). A skip for lack of memory is retried (``Schedule``); a retry that fails again
        says nothing."""
        msg = outcome.explain()
        if outcome.short:
            msg = f"{msg}; retried with a backoff (1, 2, 4, ... steps later) until one is written, the next scheduled probe at the latest"
        if self.config.raise_on_error:
            if outcome.error is not None:
                raise outcome.error
            raise RuntimeError(f"sinkwatch: probe at step {step} failed: {msg}")
        if retrying:
            return  # the skip was reported at the scheduled step
        kind = type(outcome.error).__name__ if describe(outcome.error) is not None else "peer"
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

    # ---- state ---------------------------------------------------------------------------------
    def resume_from_store(self, step: int) -> dict | None:
        """For a framework that saves none of our state (Fabric, torchtitan, Megatron): the state at optimizer
        step ``step`` rebuilt from this run's store (``resume.state_from_store``: rank 0 reads, every rank takes
        its reading), loaded and returned; None when the store holds nothing."""
        cfg = self.config
        state = on_every_rank(state_from_store(cfg.out_dir, step, cfg.monitor.stages) if self.rank.reports_here else None)
        if state is not None:
            self.load_state_dict(state)
        return state

    def last_stored_step(self) -> int | None:
        """The last step this run's store holds a record of (rank 0's store, on every rank)."""
        return on_every_rank(last_stored_step(self.config.out_dir) if self.rank.reports_here else None)

    def restart_tracker(self, since_step: int) -> None:
        """A new stage-tracker segment from ``since_step`` (options changed on resume); earlier records stay."""
        self.tracker = StageTracker(self.config.monitor.stages)
        self.tracker_since_step = since_step

    def _check_probe_hashes(self) -> None:
        self._probe_hashes = self.monitor.probe_hashes(self.target.vocab_size)
        # with the hashes, the parameters that rebuild each set: replay of the checkpoints probes the same sets
        self._probe_params = {s.kind: dict(s.params) for s in self.monitor.probe_sets(self.target.vocab_size)}
        self.config_hash = self.monitor.config_hash(self.target.vocab_size)
        if self.jsonl is not None:  # the live store keeps them too, for checkpoints without a trainer state
            try:
                self.jsonl.write_probes(live_probes(self.state_dict()))
            except (OSError, TypeError, ValueError) as exc:  # never a lost probe or a stopped run over this file
                self._warn("probes.json", f"sinkwatch: could not write probes.json to {self.jsonl.dir} ({exc}); replay then needs --probe")

    def state_dict(self) -> dict:
        """JSON-able state: probe hashes, natural tokens, tracker, counters."""
        return {
            "version": STATE_VERSION,
            "probe_hashes": self._probe_hashes,
            "probe_params": self._probe_params,
            "natural_tokens": None if self.natural is None else self.natural.tokens.tolist(),
            "natural_params": None if self.natural is None else dict(self.natural.params),
            "tracker": self.tracker.state_dict(),
            "last_probed_step": self.last_probed_step,
            "tokens_seen": self.tokens_seen,
            "n_probes": self.n_probes,
            "config_hash": self.config_hash,
            "tracker_since_step": self.tracker_since_step,
            "probe_dtype": dtype_name(self.layout.dtype),  # replay of a live store probes in it (--dtype not given)
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
            self.restart_tracker(self.last_probed_step or 0)
            self._warn(
                "resume-config",
                f"sinkwatch: resumed at step {self.last_probed_step} with changed {' and '.join(changed)}; earlier records are kept "
                f"(config_hash {state.get('config_hash')}), and the stage tracker starts a new segment at step "
                f"{self.tracker_since_step} (config_hash {self.config_hash}; records carry config_hash and tracker_since_step)",
            )
        else:
            self.tracker_since_step = int(state.get("tracker_since_step") or 0)
            if tracker is not None:
                self.tracker.load_state_dict(tracker)
