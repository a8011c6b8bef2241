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

import weakref
from dataclasses import fields
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .live import LiveConfig, LiveMonitor

_latest: weakref.ref | None = None  # the callback the user built most recently in this process
# transformers saves a callback's arguments as JSON: the options typed with plain scalars survive
_JSON_TYPES = {"int", "float", "bool", "str", "None"}
_JSON_OPTIONS = tuple(f.name for f in fields(LiveConfig) if {part.strip() for part in str(f.type).split("|")} <= _JSON_TYPES)

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

    Args:
        config: a ``sinkwatch.live.LiveConfig`` (default: all defaults); keyword options override its fields.
        every_n_steps: probe after every N-th optimizer step (default 250; None: only log-spaced/start/end).
        log_spaced: also ~N log-spaced steps in [1, max_steps] (default None).
        probe_at_start: probe the initial model at step 0 (default True).
        probe_at_end: probe the last step if not already probed (default True).
        out_dir: where ``records.jsonl`` and ``events.jsonl`` go (default ``./sinkwatch``).
        tokens_per_step: tokens per optimizer step (default None: ``num_input_tokens_seen``, else batch size x
            accumulation x world size x sequence length).
        probes: probe recipes or ``ProbeSet``s (default None: induction 100 x 256, repeated 32 x 128 and
            natural windows, fitted to the model).
        natural: with the default probes, freeze natural windows from the first training dataset items (default True).
        natural_n: natural windows (default 32).
        natural_seq_len: tokens per natural window (default 64).
        monitor: a ``MonitorConfig`` (probe micro-batch, K, backend, stage thresholds).
        stages: shortcut for ``monitor=MonitorConfig(stages=StageConfig(...))``.
        wandb: "auto" (the trainer's run, else one started offline or as WANDB_MODE says), "online",
            "offline" or "disabled" (default "auto").
        wandb_project: project of a run sinkwatch starts (default "sinkwatch").
        wandb_init: extra ``wandb.init`` keywords when sinkwatch starts the run (default None).
        heatmap_every: W&B heatmaps and head-class table every N probes (default 5).
        console: one line per probe and per event (default True).
        raise_on_error: let probe errors propagate, for debugging (default False: warn once, train on).
        on_event: your hook, called with each event dict (default None).
        reporters: extra ``sinkwatch.reporting.Reporter`` instances (default ()).
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
        self._tokens_per_step: int | None = None  # estimated from the dataset at train begin
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
            world_size=args.world_size,
            wandb_run=None,  # the WandbCallback's run, if any, is wandb.run by now
        )
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

    def on_train_end(self, args, state, control, **kwargs):
        self.live.tokens_seen = self._tokens(state)
        self.live.train_end(state.global_step)
        self.live.finish()

    def _tokens(self, state) -> int:
        seen = getattr(state, "num_input_tokens_seen", 0) or 0
        if seen:
            return int(seen)
        if self._tokens_per_step is not None:
            return state.global_step * self._tokens_per_step
        return self.live.tokens_seen


def _saved_state(state, name: str) -> dict | None:
    entry = (getattr(state, "stateful_callbacks", None) or {}).get(name)
    if isinstance(entry, list):
        entry = entry[0] if entry else None
    if not entry:
        return None
    return (entry.get("attributes") or {}).get("sinkwatch_state")
