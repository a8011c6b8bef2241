"""Lightning Fabric adapter: ``SinkWatchFabricCallback`` (docs/design.md §7), for hand-written Fabric loops
such as LitGPT's ``litgpt pretrain`` (which needs no code change: see ``sinkwatch.fabric_factory``).

    fabric = lightning.Fabric(..., callbacks=[SinkWatchFabricCallback(every_n_steps=100)])

Fabric calls two hooks whatever the loop does: ``on_after_setup(fabric, module)`` at the end of
``fabric.setup`` (not ``setup_module``, which calls none: one warning then, nothing probed), and
``on_after_optimizer_step(strategy, optimizer)`` after every ``_FabricOptimizer.step()``. The callback uses
them, plus a forward pre-hook of its own on the ``_FabricModule`` ``fabric.setup`` returns (outside any
``torch.compile`` of the model, so no compiled graph sees it): every training forward (``module.training``)
hands its (B, T) token ids to the live core, which freezes the natural probe from the first one and counts
tokens (times the data-parallel ranks). The first training forward also says where the run stands, before
any backward: the optimizer holding the model's parameters (Fabric hands callbacks none; it is found among
the live optimizers) has an empty state (step 0) in a fresh run, and the initial model is probed there and
then, before its forward (never between a backward and its optimizer step, where FSDP's gathered
parameters would stand in for the updated shards); a step ``s > 0`` is a resumed run (``fabric.load``
restored the optimizer; Fabric calls no callback on ``save``/``load``), and the callback's state (probe
sets, natural windows, counters, stage tracker) is rebuilt from its own store in ``out_dir``:
``probes.json`` and the records up to step ``s`` (later lines, from a timeline that was rolled back, move
to ``*.superseded.jsonl``), and the schedule continues at ``s + 1``.

Optimizer steps are counted from there (one per ``on_after_optimizer_step``); every ``every_n_steps``-th
is probed right after the optimizer step, before the loop saves a checkpoint at it, so a record at
step N equals ``sinkwatch replay`` of the checkpoint saved at step N. With ``max_steps`` given, the
last step is probed (``probe_at_end``) and log-spaced steps are possible; Fabric has no end-of-run
hook, so without it the run ends with the last scheduled probe.

What is probed: the bare module (``_FabricModule._original_module``; never the DDP wrapper, which
would hang) on every rank under DDP, each its share of the probe's sequences; every rank together
under FSDP2 (``ModelParallelStrategy`` with ``data_parallel_size`` only: the probe forward's hooks
all-gather the shards), each its share too (``sinkwatch.probe.share``). The capture is
chosen by the model: LitGPT ``GPT`` through its attention method, transformers models through
``AttentionInterface``, ``sinkwatch.attend`` / ``sinkwatch_target()`` otherwise. Refused at setup with
a clear error: DeepSpeed (its engine owns the parameters), tensor parallelism (its plan is the user's
parallelize function's, which the strategy does not describe: docs/live.md, "Distributed training"), Fabric's ``FSDPStrategy``
of a LitGPT model is untested (it needs CUDA), explicit probes longer than the model's
``max_seq_length``. A KV-cache training forward (LitGPT ``input_pos``) is not read as a training batch.

Logging: the records go to ``out_dir`` (``records.jsonl``, ``events.jsonl``, ``probes.json``), to W&B
(the Fabric loggers' WandbLogger run when there is one, else as ``wandb=`` says) and, on global rank
0, the ``sinkwatch/*`` scalars (docs/live.md, "Logged keys") to the Fabric loggers through
``fabric.log_dict`` at the record's step (the non-W&B loggers directly when a WandbLogger is attached,
whose run the W&B reporter already logs to); stage events to TensorBoard, CSV and MLflow loggers as the
Lightning adapter writes them.
"""

from __future__ import annotations

import atexit
import warnings
from importlib import metadata
from typing import Any

import torch

from ..live import LiveConfig, LiveMonitor
from ..reporters.base import MultiReporter, Reporter

TESTED_LITGPT = "0.5.13"  # the litgpt release the LitGPT capture and this adapter were tested with


def _check_litgpt_version() -> None:
    try:
        installed = metadata.version("litgpt")
    except metadata.PackageNotFoundError:
        return
    if installed != TESTED_LITGPT:
        warnings.warn(
            f"sinkwatch: litgpt {installed} is installed; sinkwatch's LitGPT capture was tested with litgpt {TESTED_LITGPT} "
            "(its attention method, scale and masks are read as that version wrote them)",
            RuntimeWarning,
            stacklevel=3,
        )


_check_litgpt_version()

SCALAR_OPTIONS = LiveConfig.scalar_options()  # the options the entry point's environment variable may set


class SinkWatchFabricCallback:
    """Watch attention sinks and induction heads form in a Lightning Fabric loop.

    ``SinkWatchFabricCallback(config=None, *, max_steps=None, **overrides)``: the options are
    ``sinkwatch.live.LiveConfig``'s (its docstring lists them), and ``max_steps``, the optimizer steps the
    run will take (default None: unknown; then the last step is probed only if scheduled, and
    ``log_spaced`` is refused). A resumed run's state comes from its store (the module's docstring).
    """

    def __init__(self, config: LiveConfig | None = None, *, max_steps: int | None = None, **overrides: Any):
        if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
            raise ValueError(f"max_steps must be None or a positive int, got {max_steps!r}")
        self.config = LiveConfig.with_overrides(config, overrides)
        if self.config.log_spaced and max_steps is None:
            raise ValueError("log_spaced needs max_steps: Fabric cannot say how many optimizer steps the loop will take")
        self.max_steps = max_steps
        self.live = LiveMonitor(self.config)
        self.step: int | None = None  # optimizer steps taken (None until the first one says where the run stands)
        self.resumed_from: int | None = None
        self._fabric_module = None
        self._litgpt = False
        self._params: set[int] = set()
        self._batch_hook = None
        self._tokens_at_start: int | None = None  # a resumed run's token count as stored (the first step adds to it)
        self._finished = False

    # ---- Fabric hooks ------------------------------------------------------------------------
    def on_after_setup(self, fabric, module) -> None:
        if self._fabric_module is not None:
            return  # one model per callback: the first one set up (a second fabric.setup is another model)
        strategy = fabric.strategy
        _refuse_strategy(strategy)
        bare = getattr(module, "_original_module", module)
        wrapped = getattr(module, "_forward_module", module)
        self.live.setup(
            bare,
            is_global_zero=fabric.is_global_zero,
            wrapped=wrapped,
            max_steps=self.max_steps,
            world_size=_data_parallel_size(strategy),
            wandb_run=_wandb_run(fabric) if fabric.is_global_zero else None,
        )
        _refuse_long_probes(self.config.probes, self.live.target.context)
        if fabric.is_global_zero:
            self.live.add_reporter(fabric_reporter(fabric))
        self._fabric_module = module
        self._litgpt = type(self.live.target).__name__ == "LitGPTTarget"  # GPT.forward(idx, input_pos, ...)
        self._params = {id(p) for p in bare.parameters()}
        self._batch_hook = module.register_forward_pre_hook(self._read_batch, with_kwargs=True, prepend=True)
        atexit.register(self.finish)

    def on_after_optimizer_step(self, strategy, optimizer) -> None:
        if self._fabric_module is None:
            self.live._warn(
                "no-setup",
                "sinkwatch: Fabric never called on_after_setup, so nothing is probed: set the model up with fabric.setup(model[, "
                "optimizer]) (fabric.setup_module calls no callback)",
            )
            return
        if self.step is None:  # no training forward went through the module fabric.setup returned
            self._start(optimizer, before_backward=False)
        if self._tokens_at_start is not None:  # a resumed run's first step: tokens per step are known now
            per_step, self._tokens_at_start = self.live.tokens_seen - self._tokens_at_start, None
            if self.config.tokens_per_step is None and per_step > 0:
                self.live.tokens_seen = per_step * (self.step + 1)  # constant tokens per step (LitGPT: fixed-length batches)
        self.step += 1
        self.live.step_end(self.step)
        if self.max_steps is not None and self.step >= self.max_steps:
            self.live.train_end(self.step)
            self.finish()

    # ---- batches and the first step ----------------------------------------------------------
    def _read_batch(self, module, args, kwargs):
        if not module.training:  # validation, generation (sinkwatch's own probe never calls this module)
            return None
        if kwargs.get("input_pos") is not None or (self._litgpt and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            self.live._warn("kv-cache", "sinkwatch: a training forward with a KV cache (input_pos) is not read as a training batch")
            return None
        ids = kwargs.get("input_ids", kwargs.get("idx"))
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        if isinstance(ids, torch.Tensor):
            batch = {"input_ids": ids, "attention_mask": kwargs.get("attention_mask")}
            self.live.batch_start(batch)
            if self.step is None:  # the first training forward: where the run stands, before any backward
                self._start(self._optimizer(), before_backward=True)
            self.live.batch_end(batch)
        return None

    def _optimizer(self):
        """The optimizer holding the model's parameters (None: none found): Fabric hands callbacks no
        optimizer, so it is looked up once, at the first training forward, among the live objects."""
        import gc

        for obj in gc.get_objects():  # type(), not isinstance(): a weak proxy to a dead object raises on its __class__
            if issubclass(type(obj), torch.optim.Optimizer) and any(id(p) in self._params for g in obj.param_groups for p in g["params"]):
                return obj
        return None

    def _start(self, optimizer, *, before_backward: bool) -> None:
        """Where the run stands, at its first training forward in this process (``before_backward``; else
        after its first optimizer step, when no forward went through the module: step 0 is not probed)."""
        done = optimizer_steps(optimizer) if optimizer is not None else None
        if done is None:
            done = self.live.last_stored_step() or 0
            self.live._warn(
                "step",
                f"sinkwatch: the optimizer's state holds no step count; counting from step {done} (the store's last record)",
            )
        self.step = done
        if done == 0:
            if before_backward:
                self.live.step_end(0)  # the initial model, with the natural probe the first batch froze
            else:
                self.live._warn(
                    "step0", "sinkwatch: no training forward went through the module fabric.setup returned; step 0 is not probed"
                )
            return
        self.resumed_from = done
        state = self.live.resume_from_store(done)
        if state is not None:
            since = state.get("last_probed_step") or 0
            stored = state.get("config_hash")
            if stored is not None and stored != self.live.config_hash and self.live.tracker_since_step != since:
                # thresholds changed (the probe sets' change is handled by load_state_dict): a new tracker segment
                self.live.restart_tracker(since)
                self.live._warn(
                    "resume-config",
                    f"sinkwatch: resumed at step {done} with changed options (config_hash {stored} -> {self.live.config_hash}); "
                    f"the stage tracker starts a new segment at step {since}",
                )
        self._tokens_at_start = self.live.tokens_seen

    def finish(self) -> None:
        """Close the reporters (W&B); called at ``max_steps``, at interpreter exit, or by you."""
        if self._finished or self._fabric_module is None:
            return
        self._finished = True
        if self._batch_hook is not None:
            self._batch_hook.remove()
            self._batch_hook = None
        self.live.finish()

    # for loops that call it themselves: fabric.call("on_train_end")
    def on_train_end(self, *args, **kwargs) -> None:
        if self.step is not None:
            self.live.train_end(self.step)
        self.finish()


# ---- helpers -------------------------------------------------------------------------------------
def optimizer_steps(optimizer) -> int | None:
    """Optimizer steps taken, from its state: 0 when it holds none (a fresh optimizer), the largest
    ``step`` of its parameter states (Adam, AdamW, RMSprop, ...), None when the state says nothing of steps (SGD)."""
    state = getattr(optimizer, "state", None) or {}
    if not state:
        return 0
    steps = [s["step"] for s in state.values() if isinstance(s, dict) and "step" in s]
    if not steps:
        return None
    return int(max(float(s) for s in steps))


def _refuse_strategy(strategy) -> None:
    names = {c.__name__ for c in type(strategy).__mro__}
    if "DeepSpeedStrategy" in names:
        raise ValueError(
            "sinkwatch cannot probe a DeepSpeed model live under Fabric: the DeepSpeed engine owns the parameters and the optimizer. "
            "Use DDP or ModelParallelStrategy (FSDP2), or probe the checkpoints afterwards with `sinkwatch replay`"
        )
    tp = getattr(strategy, "_tensor_parallel_size", 1)
    if isinstance(tp, int) and tp > 1:
        raise ValueError(
            f"sinkwatch cannot probe a tensor-parallel model live (ModelParallelStrategy tensor_parallel_size={tp}): each rank holds "
            "only some heads, and where they sit at the attention call, whether the residual stream is split over the positions "
            "(a sequence-parallel plan) and how the output layer is sharded are what your parallelize function chose, which "
            "the strategy does not say (sinkwatch gathers each rank's heads where the framework defines the plan: "
            "sinkwatch.megatron, sinkwatch.torchtitan). Use tensor_parallel_size=1 (FSDP2 over every rank), or probe the "
            "checkpoints afterwards"
        )


def _refuse_long_probes(probes, context: int | None) -> None:
    if probes is None or context is None:
        return
    for p in probes:
        T = getattr(p, "seq_len", None)
        if T is None and isinstance(getattr(p, "tokens", None), torch.Tensor):
            T = p.tokens.shape[1]
        if isinstance(T, int) and T > context:
            raise ValueError(
                f"sinkwatch: the probe {type(p).__name__} has seq_len {T}, longer than the model's max_seq_length {context}; "
                "the model cannot run it. Give probes of at most max_seq_length tokens (the default probes are fitted to it)"
            )


def _data_parallel_size(strategy) -> int:
    try:
        kwargs = strategy.distributed_sampler_kwargs or {}
    except Exception:  # noqa: BLE001 - a strategy without a device mesh yet
        kwargs = {}
    return max(1, int(kwargs.get("num_replicas", getattr(strategy, "world_size", 1)) or 1))


def _wandb_run(fabric):
    for logger in getattr(fabric, "loggers", []) or []:
        if any(c.__name__ == "WandbLogger" for c in type(logger).__mro__):
            return logger.experiment
    return None


class FabricReporter(Reporter):
    """The ``sinkwatch/*`` scalars of each record through ``fabric.log_dict(metrics, step=record step)``."""

    name = "Fabric log_dict"

    def __init__(self, fabric):
        self.fabric = fabric

    def log_record(self, record: dict[str, Any]) -> None:
        from ..reporters.trackers import tracker_scalars

        metrics = tracker_scalars(record)
        if metrics:
            self.fabric.log_dict(metrics, step=record.get("step") or 0)


def fabric_reporter(fabric) -> Reporter:
    """Scalars to the Fabric loggers (``fabric.log_dict``; the non-W&B loggers one by one when a WandbLogger
    is attached, whose run the W&B reporter logs to), events to the loggers that can hold text."""
    from ..reporters.lightning_loggers import LoggerReporter, event_writer, is_wandb_logger

    loggers = list(getattr(fabric, "loggers", []) or [])
    if not loggers:
        return Reporter()
    if any(is_wandb_logger(lg) for lg in loggers):
        return MultiReporter([LoggerReporter(lg) for lg in loggers if not is_wandb_logger(lg)])
    parts: list[Reporter] = [FabricReporter(fabric)]
    parts += [_EventsOnly(lg, w) for lg in loggers if (w := event_writer(lg)) is not None]
    return MultiReporter(parts)


class _EventsOnly(Reporter):
    def __init__(self, logger, writer):
        self.name = f"Fabric {type(logger).__name__} events"
        self.writer = writer

    def log_event(self, event: dict[str, Any]) -> None:
        self.writer.write(event)
