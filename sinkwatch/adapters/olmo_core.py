"""OLMo-core adapter: ``SinkWatchCallback`` (docs/design.md §7). Imports olmo_core; nothing else in sinkwatch does.

    from sinkwatch.olmo_core import SinkWatchCallback
    trainer = TrainerConfig(..., callbacks={"sinkwatch": SinkWatchCallback(every_n_steps=250)}).build(train_module, data_loader)

The same ``LiveConfig`` options and the same ``LiveMonitor`` as the Lightning and HF adapters; this
module only maps OLMo-core's hooks onto it:

- ``pre_train``: resolve ``trainer.train_module.model`` (an unsupported parallelism is a clear error
  here, before any step), pick the reporters, apply a checkpoint's sinkwatch state.
- ``pre_step(batch)``: freeze the natural probe from the first batch; on a fresh run, probe the
  initial model (step 0) before the first optimizer step.
- ``post_train_batch`` (after the optimizer step, before the checkpointer saves at this step):
  probe if due, and the final probe at the last step. The callback's priority (2) puts it after
  the W&B/Comet callbacks (3, whose runs then exist) and before the checkpointer (1), so a
  checkpoint at step N holds the state after the probe at N: a resumed run neither repeats nor loses
  a record or an event.

Scalars go through ``trainer.record_metric`` under ``sinkwatch/`` (OLMo-core's W&B and Comet
callbacks log them with the trainer's step; the step-0 probe is logged at step 1, the first step
OLMo-core logs). Stage events go to the W&B run of OLMo-core's ``WandBCallback`` when it is enabled
(alerts and summary; its scalars already arrive through ``record_metric``) and to the webhook of
its ``SlackNotifierCallback`` when one is configured. Every data-parallel rank probes its share of
the sequences (``sinkwatch.probe.share``; under FSDP2/HSDP each block's shards all-gather in the
probe forward, which every rank must run alike); only rank 0 reports.
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.request
from dataclasses import dataclass, field
from typing import Any, ClassVar

from olmo_core.distributed.utils import get_rank, get_world_size
from olmo_core.train.callbacks import Callback, SlackNotifierCallback, WandBCallback
from olmo_core.train.callbacks.slack_notifier import SLACK_WEBHOOK_URL_ENV_VAR

from ..live import LiveConfig, LiveMonitor
from ..reporters.base import Reporter
from ..reporters.wandb_run import scalars

SLACK_TIMEOUT_S = 10.0


class TrainerMetricsReporter(Reporter):
    """Each record's scalars into ``trainer.record_metric`` (namespace ``sinkwatch/``), so every
    metrics callback of the run (W&B, Comet, console) logs them with the trainer's own step."""

    name = "olmo-core-metrics"

    def __init__(self, trainer):
        self.trainer = trainer

    def log_record(self, record: dict[str, Any]) -> None:
        from olmo_core.train.common import MetricMergeStrategy

        values = {k: v for k, v in scalars(record).items() if not k.startswith("sinkwatch/by_tokens/")}
        values["sinkwatch/step"] = record.get("step") or 0
        if record.get("tokens") is not None:
            values["sinkwatch/tokens"] = record["tokens"]
        for name, value in values.items():
            self.trainer.record_metric(name, float(value), reduce_type=None, merge_strategy=MetricMergeStrategy.latest)

    def log_skip(self, step: int, tokens: int | None, reason: str) -> None:
        from olmo_core.train.common import MetricMergeStrategy

        self.trainer.record_metric("sinkwatch/probe_skipped", 1.0, reduce_type=None, merge_strategy=MetricMergeStrategy.latest)


class SlackReporter(Reporter):
    """Stage events to a Slack incoming webhook (the one OLMo-core's Slack notifier posts to)."""

    name = "slack"

    def __init__(self, webhook_url: str, run_name: str | None = None, timeout: float = SLACK_TIMEOUT_S):
        self.webhook_url = webhook_url
        self.run_name = run_name
        self.timeout = timeout

    def log_event(self, event: dict[str, Any]) -> None:
        run = f"Run `{self.run_name}`" if self.run_name else "Run"
        text = (
            f"{run} sinkwatch: {event['timeline']} {event['previous']} -> {event['stage']} at step {event.get('step')}\n{event['message']}"
        )
        body = json.dumps({"text": text}).encode()
        request = urllib.request.Request(self.webhook_url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - the user's webhook
            response.read()


def _wandb_alerts_reporter(run, heatmap_every: int) -> Reporter:
    """Events (alerts, summary) and figures into the W&B callback's run; no scalars: those reach
    the run through ``record_metric`` at the trainer's step, and a second, stepless ``run.log`` of
    them would push W&B's step past the trainer's."""
    from ..reporters.wandb_run import WandbReporter

    class WandbAlertsReporter(WandbReporter):
        def log_record(self, record: dict[str, Any]) -> None:
            pass

        def _log_skip_scalars(self, run, data: dict) -> None:
            pass  # the scalar reaches the run through record_metric (TrainerMetricsReporter.log_skip)

        def finish(self) -> None:
            pass  # the W&B callback finishes its own run

    return WandbAlertsReporter(run, heatmap_every=heatmap_every)


@dataclass(init=False)
class SinkWatchCallback(Callback):
    """Watch attention sinks and induction heads form during an OLMo-core ``Trainer.fit``.

    ``SinkWatchCallback(config=None, **overrides)``: the options are ``sinkwatch.live.LiveConfig``'s (its
    docstring lists them).
    ``slack``: also post stage events to the Slack notifier's webhook when the run has an enabled
    ``SlackNotifierCallback`` (its ``webhook_url`` or ``SLACK_WEBHOOK_URL``).
    """

    priority: ClassVar[int] = 2  # after W&B/Comet (3) start their runs; before the checkpointer (1) saves
    config: LiveConfig = field(default_factory=LiveConfig)
    slack: bool = True
    enabled: bool = True

    def __init__(self, config: LiveConfig | None = None, *, slack: bool = True, enabled: bool = True, **overrides: Any):
        config = LiveConfig.with_overrides(config, overrides)
        self.config = config
        self.slack = bool(slack)
        self.enabled = bool(enabled)
        self.live: LiveMonitor | None = None
        self._pending_state: dict | None = None
        self._finished = False

    # ---- setup ---------------------------------------------------------------------------------
    def pre_train(self) -> None:
        if not self.enabled:
            return
        trainer = self.trainer
        rank0 = get_rank() == 0
        self.live = LiveMonitor(self._run_config(trainer) if rank0 else self.config)
        # FSDP2/HSDP shards show on the model itself: setup then has every rank probe together
        self.live.setup(
            trainer.train_module.model, is_global_zero=rank0, max_steps=trainer.max_steps, world_size=get_world_size(),
            compute_dtype=getattr(trainer.train_module, "autocast_precision", None),  # the probe runs under autocast in it
        )  # fmt: skip
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.live.load_state_dict(state)
        self._finished = False

    def _run_config(self, trainer) -> LiveConfig:
        """The configuration with this run's W&B callback and Slack webhook wired in (rank 0)."""
        cfg = self.config
        extra: list[Reporter] = [TrainerMetricsReporter(trainer)]
        wandb_cb = _enabled(trainer, WandBCallback)
        if wandb_cb is not None and cfg.wandb in ("auto", "online", "offline"):
            extra.append(_wandb_alerts_reporter(wandb_cb.run, cfg.heatmap_every))
            cfg = dataclasses.replace(cfg, wandb="disabled")  # no second run
        slack_cb = _enabled(trainer, SlackNotifierCallback) if self.slack else None
        if slack_cb is not None:
            url = slack_cb.webhook_url or os.environ.get(SLACK_WEBHOOK_URL_ENV_VAR)
            if url:
                extra.append(SlackReporter(url, run_name=slack_cb.name))
        return dataclasses.replace(cfg, reporters=(*cfg.reporters, *extra))

    # ---- the loop ------------------------------------------------------------------------------
    def pre_step(self, batch: dict[str, Any]) -> None:
        if self.live is None:
            return
        self.live.batch_start(batch)
        if self.trainer.global_step == 1:  # a fresh run's first step: the initial model, once
            self.live.tokens_seen = 0
            self.live.step_end(0)

    def post_train_batch(self) -> None:
        if self.live is None:
            return
        trainer = self.trainer
        # the trainer's own count, all ranks together (restored on resume); through count_tokens_total so
        # the monitor knows tokens were counted (a bare assignment left every record's tokens null)
        self.live.count_tokens_total(int(trainer.global_train_tokens_seen))
        self.live.step_end(trainer.global_step)
        # the last step: probe now, while its metrics can still be logged (not ``training_complete``:
        # that property runs the trainer's cancel check; a hard stop or a cancel ends in post_train)
        if trainer.max_steps is not None and trainer.global_step >= trainer.max_steps:
            self.live.train_end(trainer.global_step)

    def post_train(self) -> None:
        if self.live is None:
            return
        self.live.count_tokens_total(int(self.trainer.global_train_tokens_seen))
        self.live.train_end(self.trainer.global_step)
        self._finish()

    def on_error(self, exc: BaseException) -> None:
        del exc
        self._finish()

    def _finish(self) -> None:
        if self.live is not None and not self._finished:
            self._finished = True
            self.live.finish()

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.live is None:
            return dict(self._pending_state or {})
        return self.live.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.live is None:
            self._pending_state = dict(state_dict)  # checkpoints load before pre_train builds the monitor
        else:
            self.live.load_state_dict(state_dict)


def _enabled(trainer, kind):
    for cb in trainer.callbacks.values():
        if isinstance(cb, kind) and getattr(cb, "enabled", True):
            return cb
    return None
