"""transformers Trainer adapter: ``SinkWatchTrainerCallback`` (SPEC §7).

    from sinkwatch.hf import SinkWatchTrainerCallback
    trainer = transformers.Trainer(..., callbacks=[SinkWatchTrainerCallback()])

Probes after every ``every_n_steps``-th optimizer step (``on_step_end`` fires once per optimizer
step, whatever ``gradient_accumulation_steps``), at step 0 and at the end. The natural probe is
read from the first items of the training dataset (reading items draws no random numbers, so
training is unchanged). Its state rides in ``TrainerState`` (``ExportableState``) and is restored
on ``resume_from_checkpoint`` whether or not ``restore_callback_states_from_checkpoint`` is set.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, ExportableState

from .live import LiveConfig, LiveMonitor, is_fsdp

_latest: weakref.ref | None = None  # the callback the user built most recently in this process
_JSON_OPTIONS = (
    "every_n_steps",
    "log_spaced",
    "probe_at_start",
    "probe_at_end",
    "out_dir",
    "tokens_per_step",
    "natural",
    "natural_n",
    "natural_seq_len",
    "wandb",
    "wandb_project",
    "heatmap_every",
    "console",
    "raise_on_error",
)


def _dataset_ids(dataset, n_items: int) -> torch.Tensor | None:
    """(rows, T) ids from the first dataset items that hold equal-length ``input_ids``."""
    rows = []
    try:
        for i in range(min(n_items, len(dataset))):
            item = dataset[i]
            ids = item["input_ids"] if isinstance(item, dict) or hasattr(item, "keys") else item
            rows.append(torch.as_tensor(ids, dtype=torch.int64).reshape(-1))
    except Exception:  # noqa: BLE001 - an exotic dataset only loses the natural probe
        return None
    if not rows:
        return None
    T = min(r.numel() for r in rows)
    return torch.stack([r[:T] for r in rows])


class SinkWatchTrainerCallback(TrainerCallback, ExportableState):
    """Watch attention sinks and induction heads form during ``Trainer.train``.

    Every keyword is a ``sinkwatch.live.LiveConfig`` field (see the Lightning callback).
    """

    def __init__(self, **kwargs: Any):
        global _latest
        restored = kwargs.pop("_restored", False)
        if restored and _latest is not None and _latest() is not None:
            # transformers' restore_callback_states_from_checkpoint rebuilds callbacks from JSON
            # args; take the full configuration (probes, reporters, hooks) of the callback the user
            # built in this process instead, and the JSON options only when there is none.
            kwargs = dict(_latest()._kwargs)
        self._kwargs = dict(kwargs)
        self.config = LiveConfig.from_kwargs(kwargs)
        self.live = LiveMonitor(self.config)
        self.sinkwatch_state: dict | None = None  # set by transformers' own callback restore
        self._tokens_per_step: int | None = None  # estimated from the dataset at train begin
        self._integrations = None  # the report_to integrations' reporter, set at train begin
        if not restored:
            _latest = weakref.ref(self)

    # ---- ExportableState ----
    def state(self) -> dict:
        options = {k: v for k, v in self._kwargs.items() if k in _JSON_OPTIONS}
        return {"args": {"_restored": True, **options}, "attributes": {"sinkwatch_state": self.live.state_dict()}}

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self.live.setup(
            model,
            is_global_zero=state.is_world_process_zero,
            probes_here=state.is_world_process_zero or is_fsdp(model),
            max_steps=state.max_steps,
            world_size=args.world_size,
            wandb_run=None,  # the WandbCallback's run, if any, is wandb.run by now
        )
        self._report_to_integrations(args, state, control, model)
        dataset = getattr(train_dataloader, "dataset", None)
        ids = _dataset_ids(dataset, self.config.natural_n) if dataset is not None else None
        if ids is not None:
            self.live.batch_start({"input_ids": ids})  # ignored when resuming: the saved probe wins
            self._tokens_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size * ids.shape[1]
        saved = self.sinkwatch_state or _saved_state(state, type(self).__name__)
        if saved is not None:
            self.live.load_state_dict(saved)
        if state.global_step == 0:
            self.live.step_end(0)

    def on_step_end(self, args, state, control, **kwargs):
        self.live.tokens_seen = self._tokens(state)
        self.live.step_end(state.global_step)
        if control.should_training_stop:
            # the last step (the flow callbacks, which run first, said so): probe it now, while the
            # report_to integrations are open; their on_train_end, before ours, closes them
            self.live.train_end(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._integrations is not None:
            self._integrations.close()
        self.live.tokens_seen = self._tokens(state)
        self.live.train_end(state.global_step)
        self.live.finish()

    def _report_to_integrations(self, args, state, control, model) -> None:
        # the scalars go through the Trainer's own logging path to every report_to integration
        # (W&B excepted: the W&B reporter logs to that run); see sinkwatch.reporting.trainer_integrations
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

        from .reporting.trainer_integrations import TrainerIntegrationsReporter, TrainerRun

        kinds = tuple(INTEGRATION_TO_CALLBACK.values())
        integrations = [cb for cb in handler.callbacks if isinstance(cb, kinds)]
        if integrations:
            self._integrations = TrainerIntegrationsReporter(integrations, TrainerRun(args, state, control, model))
            self.live.add_reporter(self._integrations)

    def _tokens(self, state) -> int:
        seen = getattr(state, "num_input_tokens_seen", 0) or 0
        if seen:
            return int(seen)
        if self._tokens_per_step is not None:
            return state.global_step * self._tokens_per_step
        return self.live.tokens_seen


def _calling_handler(callback) -> CallbackHandler | None:
    """The CallbackHandler running ``callback``'s hook. transformers hands callbacks neither the
    Trainer nor its handler; the handler is the caller (``CallbackHandler.call_event``), found a
    frame or two up and checked to hold this very callback."""
    frame = sys._getframe(2)  # this function <- the callback's method <- call_event
    for _ in range(4):
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
