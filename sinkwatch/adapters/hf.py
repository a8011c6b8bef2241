"""transformers Trainer adapter: ``SinkWatchTrainerCallback`` (docs/design.md §7).

    from sinkwatch.hf import SinkWatchTrainerCallback
    trainer = transformers.Trainer(..., callbacks=[SinkWatchTrainerCallback()])

Probes after every ``every_n_steps``-th optimizer step (``on_step_end`` fires once per optimizer
step, whatever ``gradient_accumulation_steps``), at step 0 and at the last step (in its ``on_step_end``,
while the ``report_to`` integrations, which get the scalars too, are still open). Trainer callbacks never
see the batches, so a forward pre-hook on the model reads each training forward's ``input_ids``
(and ``attention_mask``): the natural probe is frozen from the first micro-batch the trainer
actually feeds — map-style or streaming (``IterableDataset``) data alike; sinkwatch never reads
dataset items itself — and tokens are counted from every batch fed (or taken from the Trainer's own
``num_input_tokens_seen`` when ``include_num_input_tokens_seen`` is on). The step-0 probe runs in that
same pre-hook of the first training forward, before any weight changed and before any backward (a
probe between a backward and its optimizer step would leave FSDP's gathered parameters standing in for
the updated shards; under DeepSpeed the optimizer steps inside ``backward``). With
``load_best_model_at_end``, the last trained weights are probed just before the best checkpoint is
loaded over them (a ``load_state_dict`` pre-hook), whatever stopped the run (epoch evaluation with
``EarlyStoppingCallback``). Its state rides in ``TrainerState`` (``ExportableState``) and is restored on
``resume_from_checkpoint`` whether or not ``restore_callback_states_from_checkpoint`` is set.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from dataclasses import fields
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, ExportableState

from ..live import LiveConfig, LiveMonitor

_latest: weakref.ref | None = None  # the callback the user built most recently in this process
_JSON_OPTIONS = LiveConfig.scalar_options()  # transformers saves a callback's arguments as JSON: these survive


class SinkWatchTrainerCallback(TrainerCallback, ExportableState):
    """Watch attention sinks and induction heads form during ``Trainer.train``.

    ``SinkWatchTrainerCallback(config=None, **overrides)``: the options are ``sinkwatch.live.LiveConfig``'s
    (its docstring lists them). What the Trainer changes: ``tokens_per_step`` None reads the Trainer's
    ``num_input_tokens_seen`` when ``include_num_input_tokens_seen`` is on; ``log_spaced`` reads
    ``state.max_steps``; the options given as plain scalars are saved with the Trainer's state and restored
    with its checkpoint (transformers' ``restore_callback_states_from_checkpoint``).
    """

    def __init__(self, config: LiveConfig | None = None, **overrides: Any):
        global _latest
        restored = overrides.pop("_restored", False)
        latest = _latest() if restored and _latest is not None else None
        if latest is not None:
            # transformers' restore_callback_states_from_checkpoint rebuilds callbacks from JSON
            # args; take the full configuration (probes, reporters, hooks) of the callback the user
            # built in this process instead, and the JSON options only when there is none.
            config, overrides, given = latest.config, {}, latest._given
        else:
            given = {f.name for f in fields(LiveConfig)} if config is not None else set(overrides)
        self.config = LiveConfig.with_overrides(config, overrides)
        self._given = set(given)  # the options the user set: the ones saved with the state
        self.live = LiveMonitor(self.config)
        self.sinkwatch_state: dict | None = None  # set by transformers' own callback restore
        self._hook = None  # the forward pre-hook that reads training batches
        self._reload_hook = None  # load_best_model_at_end: the last trained weights are probed before they are replaced
        self._state = None  # the Trainer's state (the reload hook reads its step)
        self._step0_pending = False  # the step-0 probe waits for the first training forward
        self._integrations = None  # the report_to integrations' reporter, set at train begin
        if not restored:
            _latest = weakref.ref(self)

    # ---- ExportableState ----
    def state(self) -> dict:
        options = {k: getattr(self.config, k) for k in _JSON_OPTIONS if k in self._given}
        return {"args": {"_restored": True, **options}, "attributes": {"sinkwatch_state": self.live.state_dict()}}

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self.live.setup(
            model,
            is_global_zero=state.is_world_process_zero,
            max_steps=state.max_steps,
            world_size=data_parallel_size(args),
            wandb_run=None,  # the WandbCallback's run, if any, is wandb.run by now
            zero3=zero3_configured(args),  # refused at setup, as are a ZeRO-3 model and a tensor-parallel one
            compute_dtype=mixed_precision_dtype(args),  # bf16=True / fp16=True: the probe runs under autocast in it
        )
        self._report_to_integrations(args, state, control, model)
        self._trainer_counts_tokens = getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False, None)
        self._remove_hooks()
        # first in line: before FSDP2's own pre-forward all-gather (and FSDP's root forward), so a probe here runs on a model at rest
        # never traced: under the Trainer's torch_compile the model's hooks run inside the compiled module's call
        self._hook = model.register_forward_pre_hook(torch.compiler.disable(self._read_batch), with_kwargs=True, prepend=True)
        self._state = state
        if getattr(args, "load_best_model_at_end", False):
            self._reload_hook = model.register_load_state_dict_pre_hook(self._before_reload)
        saved = self.sinkwatch_state or _saved_state(state, type(self).__name__)
        # a resumed run (global_step > 0) or transformers' own restore: the checkpoint's state, even one saved
        # before the first probe (its token count and natural probe); never the fresh state TrainerState collects at init
        if saved is not None and (self.sinkwatch_state is not None or state.global_step > 0):
            self.live.load_state_dict(saved)
        # the step-0 probe, with the natural probe the first batch freezes, runs in the first training forward's pre-hook
        self._step0_pending = state.global_step == 0

    def _read_batch(self, module, args, kwargs):
        """Forward pre-hook: the first training batch freezes the natural probe; every one is counted."""
        if not module.training:  # evaluation, generation, or sinkwatch's own probe (eval mode)
            return None
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        if isinstance(ids, torch.Tensor):
            batch = {"input_ids": ids, "attention_mask": kwargs.get("attention_mask")}
            self.live.batch_start(batch)
            if self._step0_pending:  # the first batch is read; no weight has changed yet, no backward has run
                self._step0_pending = False
                self.live.step_end(0)
            if not self._trainer_counts_tokens:
                self.live.batch_end(batch)
        return None

    def _before_reload(self, *args, **kwargs):
        """``load_state_dict`` pre-hook (``load_best_model_at_end``): the Trainer is about to load the best
        checkpoint over the last trained weights; probe those first, at the step they were trained to."""
        if self._state is not None and self._state.global_step > 0:
            self._sync_tokens(self._state)
            self.live.train_end(self._state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self._step0_pending:  # no training forward went through the model's own forward: step 0 cannot be probed now
            self._step0_pending = False
            self.live._warn(
                "step0", "sinkwatch: no training forward reached the model's forward before the first step; step 0 is not probed"
            )
        self._sync_tokens(state)
        self.live.step_end(state.global_step)
        if control.should_training_stop:
            # the last step (the flow callbacks, which run first, said so): probe it now, while the
            # report_to integrations are open; their on_train_end, before ours, closes them
            self.live.train_end(state.global_step)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_training_stop:
            # a stop decided after on_step_end (EarlyStoppingCallback in on_evaluate, a callback in on_save or on_log):
            # probe the last trained weights now, before _finalize_training reloads the best checkpoint
            # (load_best_model_at_end) and while the report_to integrations are open
            self._sync_tokens(state)
            self.live.train_end(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._integrations is not None:
            self._integrations.close()
        self._sync_tokens(state)
        if reloaded_best_model(args, state) and (self.live.last_probed_step is None or self.live.last_probed_step < state.global_step):
            # the weights now are the best checkpoint's, not step global_step's: never record them under that step
            warnings.warn(
                f"sinkwatch: the Trainer reloaded the best checkpoint ({state.best_model_checkpoint}) before the end of training, "
                f"so step {state.global_step} is not probed at the end (its weights are gone); probe that checkpoint with "
                "`sinkwatch probe` if you need it",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            self.live.train_end(state.global_step)
        self.live.finish()
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for name in ("_hook", "_reload_hook"):
            hook = getattr(self, name)
            if hook is not None:
                hook.remove()
                setattr(self, name, None)
        self._state = None

    def _report_to_integrations(self, args, state, control, model) -> None:
        # the scalars go through the Trainer's own logging path to every report_to integration
        # (W&B excepted: the W&B reporter logs to that run); see sinkwatch.reporters.trainer_integrations
        self._integrations = None
        if not state.is_world_process_zero:
            return
        handler = _calling_handler(self)
        if handler is None:
            warnings.warn(
                "sinkwatch: could not find the Trainer's CallbackHandler calling on_train_begin; the report_to "
                "integrations will not get sinkwatch scalars (records.jsonl and W&B still do)",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

        from ..reporters.trainer_integrations import TrainerIntegrationsReporter, TrainerRun

        kinds = tuple(INTEGRATION_TO_CALLBACK.values())
        integrations = [cb for cb in handler.callbacks if isinstance(cb, kinds)]
        if integrations:
            self._integrations = TrainerIntegrationsReporter(integrations, TrainerRun(args, state, control, model))
            self.live.add_reporter(self._integrations)

    def _sync_tokens(self, state) -> None:
        if self._trainer_counts_tokens:  # the Trainer's own count, gathered over ranks (restored on resume)
            self.live.count_tokens_total(int(getattr(state, "num_input_tokens_seen", 0) or 0))


def reloaded_best_model(args, state) -> bool:
    """Whether the Trainer reloaded its best checkpoint before ``on_train_end``
    (``load_best_model_at_end`` with a best checkpoint recorded)."""
    return bool(getattr(args, "load_best_model_at_end", False)) and getattr(state, "best_model_checkpoint", None) is not None


def data_parallel_size(args) -> int:
    """Ranks that read distinct batches: the world size divided by the tensor- (and context-)
    parallel degrees of ``TrainingArguments.parallelism_config`` (accelerate's ParallelismConfig),
    when set. Ranks of one tensor-parallel group read the same batch, so counting them would
    multiply the tokens by the TP degree."""
    world = max(1, int(getattr(args, "world_size", 1) or 1))
    pc = getattr(args, "parallelism_config", None)
    split = 1
    for name in ("tp_size", "cp_size"):
        split *= max(1, int(getattr(pc, name, 1) or 1)) if pc is not None else 1
    return max(1, world // split)


def mixed_precision_dtype(args):
    """The autocast dtype of ``TrainingArguments(bf16=True)`` / ``fp16=True`` (None: full precision);
    a model whose weights are already in it is probed as it is, without autocast."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def zero3_configured(args) -> bool:
    """Whether the Trainer's DeepSpeed config (``hf_deepspeed_config`` or accelerate's plugin) says ZeRO
    stage 3; ``sinkwatch.distributed.check_layout`` refuses it (and a model carrying ZeRO-3's ``ds_id``)."""
    ds_config = getattr(args, "hf_deepspeed_config", None)
    if ds_config is not None and hasattr(ds_config, "is_zero3") and ds_config.is_zero3():
        return True
    plugin = getattr(getattr(getattr(args, "_accelerator_state", None), "deepspeed_plugin", None), "zero_stage", None)
    return plugin == 3


def _calling_handler(callback) -> CallbackHandler | None:
    """The CallbackHandler running ``callback``'s hook. transformers hands callbacks neither the
    Trainer nor its handler; the handler is the caller (``CallbackHandler.call_event``), found a
    frame or two up and checked to hold this very callback."""
    frame = sys._getframe(1)  # our caller; call_event is a few frames up (on_train_begin's caller)
    for _ in range(6):
        if frame is None:
            break
        obj = frame.f_locals.get("self")
        if isinstance(obj, CallbackHandler) and any(cb is callback for cb in obj.callbacks):
            return obj
        frame = frame.f_back
    return None


def _saved_state(state, name: str) -> dict | None:
    entry = (getattr(state, "stateful_callbacks", None) or {}).get(name)
    if isinstance(entry, list):
        entry = entry[0] if entry else None
    if not entry:
        return None
    return (entry.get("attributes") or {}).get("sinkwatch_state")
