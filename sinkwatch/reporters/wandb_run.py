"""Weights & Biases reporter: scalars on a step axis and a tokens axis, heatmaps, the head-class
table, and alerts on stage transitions. The only module of sinkwatch that imports wandb.

The logged keys, all under ``sinkwatch/``, are ``scalars``' (with ``HEADLINE`` again on the tokens
axis), the heatmaps and the head-class table; docs/live.md ("What gets logged") says what each means.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ..records import HEAD_CLASS_COLUMNS, best_induction_score, head_class_rows, n_sink_heads
from ..stages import INDUCTION_STATES, P0_STAGES
from .base import Reporter

# The ``wandb=`` option of the callbacks (LiveConfig.wandb) and of replay (--wandb). Every rule for
# it lives here, in ``wandb_reporter`` and ``WandbReporter.run``:
#   auto      the trainer's run (WandbLogger / WandbCallback) or ``wandb.run``; when there is none,
#             sinkwatch starts one offline, or leaves the mode to wandb when WANDB_MODE is set
#   online    log to ``wandb.run`` if one exists, else start an online run
#   offline   log to ``wandb.run`` if one exists, else start an offline run (no account needed)
#   disabled  no W&B reporter at all
# ``sinkwatch replay``/``demo`` without --wandb: WANDB_MODE, else offline (``wandb_mode_from_env``).
WANDB_MODES = ("auto", "online", "offline", "disabled")

HEADLINE = (
    "sink_rate",
    "n_induction_ge50",
    "n_induction_ge30",
    "induction_score_max",
    "icl_score",
    "p0_stage",
    "induction_state",
    "circuit_layer",
    "p0_concentration",
)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The flat scalar view of a record that goes to W&B (absent keys stay absent)."""
    out: dict[str, float] = {}

    def put(key, value):
        if value is not None and not (isinstance(value, float) and not math.isfinite(value)):
            out[f"sinkwatch/{key}"] = value

    for key in (
        "sink_rate",
        "sink_center",
        "sink_positions",
        "circuit_layer",
        "bos_fraction_raw",
        "bos_fraction_bestclass",
        "n_induction_ge30",
        "n_induction_ge50",
        "icl_score",
        "probe_seconds",
        "rho_max",
        "p0_emergence_block",
        "p0_persistence",
        "p0_concentration",
    ):
        put(key, record.get(key))
    put("n_sink_heads", n_sink_heads(record))  # over softmax blocks (hybrid stacks: the others are null)
    if record.get("induction_score") is not None:
        put("induction_score_max", best_induction_score(record))
    if isinstance(record.get("induction_target"), dict):
        put("induction_target_top1", record["induction_target"].get("top1"))
    for k, v in enumerate(record.get("sink_profile") or []):
        put(f"sink_profile/k{k}", v)
    per_layer = ("sink_rate_per_layer", "p0_norm_ratio", "p0_direction_consistency", "p0_direction_consistency_centered")
    for name in (*per_layer, "p0_attn_norm_ratio", "p0_mlp_norm_ratio"):
        for l, v in enumerate(record.get(name) or []):
            put(f"{name}/L{l}", v)
    if record.get("p0_stage") in P0_STAGES:
        put("p0_stage", P0_STAGES.index(record["p0_stage"]))
    if record.get("induction_state") in INDUCTION_STATES:
        put("induction_state", INDUCTION_STATES.index(record["induction_state"]))
    for key in HEADLINE:
        if f"sinkwatch/{key}" in out:
            out[f"sinkwatch/by_tokens/{key}"] = out[f"sinkwatch/{key}"]
    return out


WANDB_ENV_MODES = {"online": "online", "offline": "offline", "disabled": "disabled", "dryrun": "offline", "run": "online"}


def wandb_mode_from_env(flag: str | None, default: str = "offline") -> str:
    """The W&B mode of a run sinkwatch starts itself (``replay``, ``demo``): the explicit flag when
    given, else ``WANDB_MODE`` (W&B's own switch, honoured as W&B honours it), else ``default``."""
    if flag is not None:
        return flag
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if not env:
        return default
    if env not in WANDB_ENV_MODES:
        raise ValueError(f"WANDB_MODE={env!r} is not one of {', '.join(WANDB_ENV_MODES)}; fix or unset it, or pass --wandb")
    return WANDB_ENV_MODES[env]


def wandb_reporter(
    option: str,
    *,
    trainer_run=None,
    project: str = "sinkwatch",
    dir: str | None = None,
    heatmap_every: int = 5,
    init_kwargs: dict | None = None,
) -> WandbReporter | None:
    """The reporter for ``wandb=option`` (None when disabled). ``trainer_run``: the run the training
    framework already logs to, used only with "auto". Raises ImportError without wandb installed."""
    if option not in WANDB_MODES:
        raise ValueError(f"wandb must be one of {WANDB_MODES}, got {option!r}")
    if option == "disabled":
        return None
    if option == "auto":
        # "auto" as WandbReporter's mode: wandb.init without mode=, so WANDB_MODE decides
        mode = "auto" if os.environ.get("WANDB_MODE") else "offline"
        run = trainer_run
    else:
        mode, run = option, None
    return WandbReporter(run, mode=mode, project=project, dir=dir, heatmap_every=heatmap_every, init_kwargs=init_kwargs)


class WandbReporter(Reporter):
    """Logs to ``run`` (the trainer's own run when there is one), else starts one.

    mode: "offline" (default when starting a run: no account needed), "online", or "auto" (wandb's
    own default, honouring WANDB_MODE). ``heatmap_every``: images and the table every N probes.
    """

    name = "wandb"

    def __init__(
        self,
        run=None,
        *,
        mode: str = "offline",
        project: str = "sinkwatch",
        dir: str | None = None,
        heatmap_every: int = 5,
        init_kwargs: dict | None = None,
    ):
        import wandb  # ImportError here is reported once by the caller; training goes on

        self.wandb = wandb
        self._given_run = run
        self.mode = mode
        self.project = project
        self.dir = dir
        self.heatmap_every = max(1, int(heatmap_every))
        self.init_kwargs = dict(init_kwargs or {})
        self._run = None
        self._owns_run = False
        self._init_error: str | None = None
        self._n = 0
        self.alerts: list[dict] = []  # what was sent, for inspection
        self._skips = 0  # probes skipped (log_skip): one alert for the first
        self.final_summary: dict = {}

    @property
    def run(self):
        if self._init_error is not None:  # one failed init is enough: do not stall every probe
            raise RuntimeError(f"wandb is off for this run after wandb.init failed: {self._init_error}")
        if self._run is None:
            run = self._given_run or self.wandb.run
            if run is None:
                kw = {"project": self.project, "dir": self.dir, **self.init_kwargs}
                if self.mode in ("offline", "online", "disabled"):
                    kw["mode"] = self.mode
                try:
                    run = self.wandb.init(**kw)
                except Exception as exc:
                    self._init_error = f"{type(exc).__name__}: {exc}"
                    raise
                self._owns_run = True
            run.define_metric("sinkwatch/step")
            run.define_metric("sinkwatch/tokens")
            run.define_metric("sinkwatch/*", step_metric="sinkwatch/step")
            run.define_metric("sinkwatch/by_tokens/*", step_metric="sinkwatch/tokens")
            self._run = run
        return self._run

    def log_record(self, record: dict[str, Any]) -> None:
        run = self.run
        data = scalars(record)
        data["sinkwatch/step"] = record.get("step") or 0
        if record.get("tokens") is not None:
            data["sinkwatch/tokens"] = record["tokens"]
        if self._n % self.heatmap_every == 0:
            data.update(self._media(record))
        self._n += 1
        run.log(data)

    def _media(self, record) -> dict:
        from .figures import close, record_heatmaps

        figs = record_heatmaps(record)
        media = {f"sinkwatch/heatmap/{k}": self.wandb.Image(f) for k, f in figs.items()}
        close(figs)
        rows = head_class_rows(record)
        if rows:
            media["sinkwatch/head_classes"] = self.wandb.Table(columns=list(HEAD_CLASS_COLUMNS), data=rows)
        return media

    def log_event(self, event: dict[str, Any]) -> None:
        level = getattr(self.wandb.AlertLevel, event.get("level", "INFO"), self.wandb.AlertLevel.INFO)
        title = f"sinkwatch: {event['timeline']} {event['previous']} -> {event['stage']}"
        self.run.alert(title=title, text=event["message"] + f"\nevidence: {event.get('evidence')}", level=level, wait_duration=0)
        self.alerts.append({"title": title, "level": event.get("level")})
        self.run.summary[f"sinkwatch/event/{event['timeline']}"] = event["stage"]
        self.run.summary["sinkwatch/alerts"] = len(self.alerts)

    def log_skip(self, step: int, tokens: int | None, reason: str) -> None:
        """``sinkwatch/probe_skipped`` at the step; one W&B alert per run (the first skip), a summary count."""
        run = self.run
        data = {"sinkwatch/probe_skipped": 1, "sinkwatch/step": step}
        if tokens is not None:
            data["sinkwatch/tokens"] = tokens
        self._log_skip_scalars(run, data)
        self._skips += 1
        run.summary["sinkwatch/probes_skipped"] = self._skips
        if self._skips == 1:
            title = "sinkwatch: a probe was skipped"
            text = f"step {step}: {reason}\n(one alert per run; every skip logs sinkwatch/probe_skipped)"
            run.alert(title=title, text=text, level=self.wandb.AlertLevel.WARN, wait_duration=0)
            self.alerts.append({"title": title, "level": "WARN"})

    def _log_skip_scalars(self, run, data: dict) -> None:
        run.log(data)

    def finish(self) -> None:
        if self._run is not None:
            self.final_summary = dict(self._run.summary)  # what reached the run, readable after finish
            if self._owns_run:
                self._run.finish()
