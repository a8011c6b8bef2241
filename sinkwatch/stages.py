"""Developmental stages (SPEC §6): sinkwatch's own operational rules, and a tracker with hysteresis.

Two timelines:
- P0-sink circuit: ``none -> early -> transitional -> final``;
- induction circuit: ``absent -> forming -> formed``.

``classify_p0``/``classify_induction`` apply the rules to one record alone (the ``*_now`` keys).
``StageTracker`` turns a sequence of records into declared stages: a stage is declared once it
(or a later stage) has held for ``patience`` consecutive probes; stages only move forward, so
noise around a threshold cannot make a declared stage flap, and every transition fires once.
The rules and their defaults are explained in docs/stages.md.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from . import metrics
from .records import jsonable, softmax_layers_of

P0_STAGES = ("none", "early", "transitional", "final")
INDUCTION_STATES = ("absent", "forming", "formed")
INDUCTION_RULES = ("any", "selectivity", "prefix")


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """Every threshold of the stage rules, with defaults explained in docs/stages.md."""

    # P0 circuit: where position 0's state is amplified (circuit layer, SPEC §5)
    # calibrated on SmolLM2-135M, Gemma 3 270M, random-init and planted models (docs/stages.md's table)
    circuit_min_norm_ratio: float = 2.0  # rho_l >= R (and rho_{l+1} >= R): a positional circuit
    circuit_min_consistency: float = 0.8  # c_l >= C
    bos_min_norm_ratio: float = 4.0  # the BOS anchor: the shared BOS's rho_l >= this (and rho_{l+1}); c is undefined
    final_max_circuit_layer: int = 1  # "final": the circuit sits in blocks 0-1
    # P0 sinks
    sink_rate_floor: float = 0.02  # sinks present: some Sink_k >= this ("sink rate ~ 0" below it)
    secondary_sink_floor: float = 0.05  # a position k counts as a sink when Sink_k >= this
    # induction (paper rule on the induction probe)
    min_heads: int | None = None  # None: 3 for >= 72 heads (the paper's 1B models), fewer for tiny models
    formed_min_selectivity: float = metrics.INDUCTION_CIRCUIT_MIN_SELECTIVITY  # 50x
    forming_min_selectivity: float = metrics.INDUCTION_HEAD_MIN_SELECTIVITY  # 30x
    pr_lead_factor: float = 1.5  # forming: a head's PR rose this much over its first probe ...
    pr_lead_min_selectivity: float = 10.0  # ... while its induction selectivity is at least this
    # induction (prefix-matching rule on the repeated-random probe)
    prefix_min_score: float = 0.3  # a head is an induction head when its prefix-matching score >= this
    prefix_max_icl: float = -0.3  # ... and the model's ICL score (nats) <= this
    prefix_forming_score: float = 0.1  # forming: some head's score >= this, or ICL <= forming ICL
    prefix_forming_icl: float = -0.1
    induction_rule: str = "any"  # which probe's rule decides: any | selectivity | prefix
    # hysteresis
    patience: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "induction_rule":
                if v not in INDUCTION_RULES:
                    raise ValueError(f"induction_rule must be one of {INDUCTION_RULES}, got {v!r}")
            elif f.name == "min_heads":
                if v is not None and (not isinstance(v, int) or v < 1):
                    raise ValueError(f"min_heads must be None (auto) or a positive int, got {v!r}")
            elif f.name in ("patience",):
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"patience must be a positive int (consecutive probes), got {v!r}")
            elif f.name == "final_max_circuit_layer":
                if not isinstance(v, int) or v < 0:
                    raise ValueError(f"final_max_circuit_layer must be an int >= 0, got {v!r}")
            elif not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise TypeError(f"{f.name} must be a finite number, got {v!r}")
        if not 0 <= self.sink_rate_floor <= 1 or not 0 <= self.secondary_sink_floor <= 1:
            raise ValueError("sink_rate_floor and secondary_sink_floor are fractions in [0, 1]")
        if self.forming_min_selectivity > self.formed_min_selectivity:
            raise ValueError("forming_min_selectivity must not exceed formed_min_selectivity")
        if self.prefix_forming_score > self.prefix_min_score or self.prefix_forming_icl < self.prefix_max_icl:
            raise ValueError("the prefix 'forming' thresholds must be weaker than the 'formed' ones")

    def heads_needed(self, n_layers: int, n_heads: int) -> int:
        """min_heads, or the default: 3 for models with >= 72 heads (Pythia-1B has 128), 1 per 24 below."""
        if self.min_heads is not None:
            return self.min_heads
        return min(3, max(1, (n_layers * n_heads) // 24))

    def to_dict(self) -> dict:
        return asdict(self)


# ---- per-record rules -------------------------------------------------------------------------------
def classify_p0(record: Mapping[str, Any], config: StageConfig) -> tuple[str, dict]:
    """P0 stage of one record alone, and the evidence used. Needs the sink keys of SPEC §10.

    "Sinks present" means some early position k < K has Sink_k >= sink_rate_floor (a sink on
    position 1 is still a sink); the circuit layer is the first block with amplified, direction-
    stable position-0 state.
    """
    if record.get("sink_rate") is None or record.get("sink_profile") is None or record.get("sink_center") is None:
        return "none", {"reason": "no (finite) sink statistics"}
    profile = np.nan_to_num(np.asarray(record["sink_profile"], dtype=float), nan=0.0)
    centre = record["sink_center"]
    layer = record.get("circuit_layer")
    n_sink_positions = metrics.multi_sink_positions(profile, config.secondary_sink_floor)
    sinks = float(profile.max()) >= config.sink_rate_floor
    evidence = {
        "sink_rate": record["sink_rate"],
        "max_sink_k": float(profile.max()),
        "sink_center": centre,
        "circuit_layer": layer,
        "sink_positions": n_sink_positions,
    }
    if not sinks and layer is None:
        stage = "none"
    elif sinks and (centre != 0 or n_sink_positions >= 2):
        stage = "transitional"
    elif sinks and layer is not None and layer <= config.final_max_circuit_layer:
        stage = "final"
    else:
        stage = "early"
    return stage, evidence


def classify_induction(record: Mapping[str, Any], config: StageConfig, pr_initial: np.ndarray | None = None) -> tuple[str, dict]:
    """Induction state of one record, the evidence, and which rule decided (``evidence['rule']``).

    ``pr_initial`` (L, H), the PR at the first probe, enables the PR-lead forming signal.
    """
    # hybrid stacks: the heads of softmax blocks only (the others have no softmax to form a circuit)
    need = config.heads_needed(len(softmax_layers_of(record)), record["n_heads"])
    results = []  # (state, evidence) per applicable rule
    if config.induction_rule in ("any", "selectivity") and "selectivity" in record:
        sel = np.nan_to_num(np.asarray(record["selectivity"]["induction"], dtype=float), nan=-np.inf)
        n50 = int((sel >= config.formed_min_selectivity).sum())
        n30 = int((sel >= config.forming_min_selectivity).sum())
        lead = []
        if pr_initial is not None and record.get("pr") is not None:
            pr = np.asarray(record["pr"], dtype=float)
            rising = (pr >= config.pr_lead_factor * pr_initial) & (sel >= config.pr_lead_min_selectivity)
            lead = metrics.head_names(np.nan_to_num(rising, nan=False).astype(bool))
        state = "formed" if n50 >= need else "forming" if (n30 >= 1 or n50 >= 1 or lead) else "absent"
        results.append((state, {"rule": "selectivity", "heads_ge50": n50, "heads_ge30": n30, "pr_lead_heads": lead, "min_heads": need}))
    if config.induction_rule in ("any", "prefix") and "induction_score" in record:
        score = np.nan_to_num(np.asarray(record["induction_score"], dtype=float), nan=-np.inf)
        icl = record.get("icl_score")
        icl = math.inf if icl is None else icl
        n_heads = int((score >= config.prefix_min_score).sum())
        best = float(score.max()) if score.size else 0.0
        if n_heads >= need and icl <= config.prefix_max_icl:
            state = "formed"
        elif best >= config.prefix_forming_score or icl <= config.prefix_forming_icl:
            state = "forming"
        else:
            state = "absent"
        results.append(
            (
                state,
                {
                    "rule": "prefix",
                    "heads_above_score": n_heads,
                    "best_score": best,
                    "icl_score": record.get("icl_score"),
                    "min_heads": need,
                },
            )
        )
    if not results:
        return "absent", {"rule": None, "reason": "no induction statistics"}
    return max(results, key=lambda r: INDUCTION_STATES.index(r[0]))


# ---- events and the tracker -------------------------------------------------------------------------
@dataclass(frozen=True)
class StageEvent:
    """A declared transition. ``step``/``tokens``: the probe that confirmed it; ``since_*``: the
    first probe of the confirming run (where the rule first held)."""

    timeline: str  # "p0" or "induction"
    stage: str
    previous: str
    step: int | None
    tokens: int | None
    since_step: int | None
    since_tokens: int | None
    evidence: dict = field(default_factory=dict)

    @property
    def level(self) -> str:
        """W&B alert level: the end states are WARN (worth a look), intermediate ones INFO."""
        return "WARN" if self.stage in ("final", "formed") else "INFO"

    @property
    def key(self) -> str:
        return f"{self.timeline}:{self.previous}->{self.stage}"

    def message(self) -> str:
        where = f"step {self.step}" if self.step is not None else "this probe"
        if self.tokens is not None:
            where += f" ({self.tokens:,} tokens)"
        name = "P0-sink circuit" if self.timeline == "p0" else "induction circuit"
        return f"{name}: {self.previous} -> {self.stage} at {where}"

    def to_dict(self) -> dict:
        return {**asdict(self), "level": self.level, "message": self.message()}


class StageTracker:
    """Stateful, forward-only stage declaration with patience; serialisable for resume."""

    def __init__(self, config: StageConfig | None = None):
        self.config = config or StageConfig()
        self.p0_stage = P0_STAGES[0]
        self.induction_state = INDUCTION_STATES[0]
        self._recent: dict[str, deque] = {"p0": deque(maxlen=self.config.patience), "induction": deque(maxlen=self.config.patience)}
        self.fired: list[dict] = []
        self.pr_initial: np.ndarray | None = None
        self.last_step: int | None = None
        self.n_updates = 0

    def classify(self, record: Mapping[str, Any]) -> tuple[tuple[str, dict], tuple[str, dict]]:
        pr0 = self.pr_initial if self.pr_initial is not None else None
        return classify_p0(record, self.config), classify_induction(record, self.config, pr0)

    def update(self, record: dict) -> list[StageEvent]:
        """Consume one record; set its ``p0_stage``/``induction_state`` (and ``*_now``) keys; return new events."""
        if self.pr_initial is None and record.get("pr") is not None:
            self.pr_initial = np.asarray(record["pr"], dtype=float)
        (p0_now, p0_ev), (ind_now, ind_ev) = self.classify(record)
        record["p0_stage_now"], record["induction_state_now"] = p0_now, ind_now
        step, tokens = record.get("step"), record.get("tokens")
        events = []
        for timeline, now, evidence, order in (("p0", p0_now, p0_ev, P0_STAGES), ("induction", ind_now, ind_ev, INDUCTION_STATES)):
            recent = self._recent[timeline]
            recent.append({"stage": now, "step": step, "tokens": tokens})
            current = self.p0_stage if timeline == "p0" else self.induction_state
            if len(recent) < self.config.patience:
                continue
            held = min(order.index(r["stage"]) for r in recent)  # the highest stage every recent probe reached
            if held <= order.index(current):
                continue
            new = order[held]
            since = next(r for r in recent if order.index(r["stage"]) >= held)
            event = StageEvent(timeline, new, current, step, tokens, since["step"], since["tokens"], jsonable(evidence))
            if timeline == "p0":
                self.p0_stage = new
            else:
                self.induction_state = new
            if event.key not in {e["key"] for e in self.fired}:
                self.fired.append({"key": event.key, **event.to_dict()})
                events.append(event)
        record["p0_stage"], record["induction_state"] = self.p0_stage, self.induction_state
        self.last_step = step
        self.n_updates += 1
        return events

    # ---- resume ----
    def state_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "p0_stage": self.p0_stage,
            "induction_state": self.induction_state,
            "recent": {k: list(v) for k, v in self._recent.items()},
            "fired": list(self.fired),
            "pr_initial": None if self.pr_initial is None else self.pr_initial.tolist(),
            "last_step": self.last_step,
            "n_updates": self.n_updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = StageConfig(**state["config"])
        if saved != self.config:
            raise ValueError("the saved stage tracker used different thresholds; resume with the same StageConfig or start a new run")
        self.p0_stage = state["p0_stage"]
        self.induction_state = state["induction_state"]
        self._recent = {k: deque(v, maxlen=self.config.patience) for k, v in state["recent"].items()}
        self.fired = list(state["fired"])
        self.pr_initial = None if state["pr_initial"] is None else np.asarray(state["pr_initial"], dtype=float)
        self.last_step = state["last_step"]
        self.n_updates = state["n_updates"]

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> StageTracker:
        tracker = cls(StageConfig(**state["config"]))
        tracker.load_state_dict(state)
        return tracker
