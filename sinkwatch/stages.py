"""Developmental stages: sinkwatch's own operational rules, and a tracker with hysteresis.

Two timelines (docs/stages.md has every rule, threshold and the measurements behind them):
- the P0-sink circuit: ``none -> early -> {deep, transitional, shifted} -> final``: after ``early`` the
  sink is established, and three readings say how it is not (yet) final: its circuit amplifies deeper
  than blocks 0-1 (``deep``, where a run may also settle), several sink positions (``transitional``),
  a single sink off position 0 held by a shallow circuit (``shifted``); they rank alike;
- the induction circuit: ``absent -> forming -> formed``.

``classify`` applies the rules to one record alone (the ``*_now`` keys). ``StageTracker`` declares
stages from a sequence of records with hysteresis, a Schmitt trigger: a stage is entered when a
probe meets its rule and the next ``patience - 1`` probes meet its weaker *hold* rule (every
threshold moved in the stage's favour by ``p0_hold_factor`` / ``hold_factor``, each set from its
keys' measured noise), and a declared stage is left only after ``patience`` probes in a row fail
its hold rule — on the P0 timeline for any change, on the ordered induction timeline for a
regression. One noisy probe neither declares nor undoes a stage; each event names the probe where
the rule was first met and carries that probe's evidence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from . import metrics
from .records import jsonable, softmax_layers_of

P0_STAGES = ("none", "early", "deep", "transitional", "shifted", "final")
# Development order. The three ways an established sink is not (yet) final rank alike: a circuit still deep,
# several sink positions, a single sink off position 0. The P0 paper's path runs through them (a circuit first
# deeper, then several sinks, the centre on position 1 for a while) before it concentrates in blocks 0-1, so a
# move among them is lateral (INFO), never a regression; leaving `final` for any of them is one (WARN).
P0_RANK = {"none": 0, "early": 1, "deep": 2, "transitional": 2, "shifted": 2, "final": 3}
P0_END_STATES = ("final",)
INDUCTION_STATES = ("absent", "forming", "formed")
INDUCTION_RULES = ("any", "selectivity", "prefix")
TIMELINES = ("p0", "induction")


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """Every threshold of the stage rules; defaults and their margins are in docs/stages.md."""

    # P0 circuit (metrics.p0_circuit): the block where position 0's norm jumps most (the emergence block) ...
    circuit_min_norm_ratio: float = 2.0  # ... amplifies it (rho >= R) ...
    circuit_min_persistence: float = 0.5  # ... in at least this share of the blocks after it ...
    circuit_min_consistency: float = 0.8  # ... along one direction (centred consistency >= C)
    bos_min_norm_ratio: float = 4.0  # R for the BOS anchor (one shared first token: no direction test)
    final_max_circuit_layer: int = 1  # "final": the circuit sits in blocks 0-1 ...
    final_min_concentration: float = 0.5  # ... i.e. at least this share of log rho_max is gained there (p0_concentration)
    # P0 sinks (Gu et al.'s Sink_k profile)
    sink_rate_floor: float = 0.02  # sinks present: the largest Sink_k >= this
    established_sink_rate: float = 0.3  # an established sink: the largest Sink_k >= this
    second_sink_ratio: float = 0.25  # a second sink position: Sink_k >= this x the largest Sink_k (and >= the floor)
    # induction (paper rule on the induction probe)
    min_heads: int | None = None  # None: 3 for >= 72 heads (the paper's 1B models), fewer for tiny models
    formed_min_selectivity: float = metrics.INDUCTION_CIRCUIT_MIN_SELECTIVITY  # 50x
    forming_min_selectivity: float = metrics.INDUCTION_HEAD_MIN_SELECTIVITY  # 30x
    # induction (prefix-matching rule on the repeated-random probe)
    prefix_min_score: float = 0.3  # a head is an induction head when its prefix-matching score >= this
    prefix_max_icl: float = -0.3  # ... and the model's ICL score (nats) <= this
    prefix_forming_score: float = 0.1  # forming: some head's score >= this, or ICL <= forming ICL
    prefix_forming_icl: float = -0.1
    induction_rule: str = "any"  # which probe's rule decides: any | selectivity | prefix
    # hysteresis (a Schmitt trigger)
    patience: int = 2  # the probe that meets a stage's rule, then patience - 1 probes that meet its hold rule
    hold_factor: float = 0.45  # induction's hold rule: each threshold t becomes t x f in the stage's favour (t / f against)
    p0_hold_factor: float = 0.8  # the same for the P0 rules, whose keys are far less noisy (docs/stages.md, noise)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "induction_rule":
                if v not in INDUCTION_RULES:
                    raise ValueError(f"induction_rule must be one of {INDUCTION_RULES}, got {v!r}")
            elif f.name == "min_heads":
                if v is not None and (not isinstance(v, int) or v < 1):
                    raise ValueError(f"min_heads must be None (auto) or a positive int, got {v!r}")
            elif f.name == "patience":
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"patience must be a positive int (probes), got {v!r}")
            elif f.name == "final_max_circuit_layer":
                if not isinstance(v, int) or v < 0:
                    raise ValueError(f"final_max_circuit_layer must be an int >= 0, got {v!r}")
            elif not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise TypeError(f"{f.name} must be a finite number, got {v!r}")
        for name in ("sink_rate_floor", "established_sink_rate", "second_sink_ratio", "circuit_min_persistence", "final_min_concentration"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} is a fraction in [0, 1], got {getattr(self, name)!r}")
        if self.established_sink_rate < self.sink_rate_floor:
            raise ValueError("established_sink_rate must be at least sink_rate_floor (an established sink is present)")
        for name in ("hold_factor", "p0_hold_factor"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1] (1: no hysteresis beyond patience), got {getattr(self, name)!r}")
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


# ---- thresholds that lean --------------------------------------------------------------------------
class _Lean:
    """Threshold comparisons, exact or leaning towards an answer (a hold rule).

    ``at_least(x, t, want)`` is whether "x >= t" comes out as ``want``: exactly when not leaning;
    leaning, the threshold moves in ``want``'s favour by ``hold_factor`` f: t x f when ``want`` is
    True, t / f when it is False (for an ICL ceiling, t < 0, t x f is likewise the weaker one). A norm
    ratio moves on its excess over 1 (1 + (R-1) f), since 1 is "not amplified"; a fraction (sink
    rates, ratios of them, persistence, a cosine) by the smaller of that move and the same move of
    its distance to 1, so it stays inside [0, 1] (C = 0.8 leans to 0.67 and 0.88, not 0.48 and 1.33)."""

    def __init__(self, factor: float | None):
        self.f = factor  # None: exact

    def move(self, t: float, want: bool, *, ratio: bool = False, unit: bool = False) -> float:
        if self.f is None:
            return t
        k = self.f if want else 1 / self.f
        if ratio:
            return 1 + (t - 1) * k
        if unit:
            near_one = 1 - (1 - t) / k
            return max(t * k, near_one) if want else min(t * k, near_one)
        return t * k

    def at_least(self, x: float, t: float, want: bool, *, unit: bool = False) -> bool:
        return (x >= self.move(t, want, unit=unit)) == want


# ---- the P0 circuit and its stage ------------------------------------------------------------------
def circuit(view: Mapping[str, Any], config: StageConfig, *, bos: bool, lean: _Lean | None = None, want: bool = True) -> dict:
    """``metrics.p0_circuit`` of one anchor's numbers (``p0_norm_ratio``, ``p0_norm_ratio_embeddings``,
    ``p0_direction_consistency_centered``) under ``config``; ``bos``: the BOS anchor (its own R, no
    direction test). ``lean``/``want``: the thresholds lean towards a circuit being found or not."""
    lean = lean or _Lean(None)
    consistency = None if bos else view.get("p0_direction_consistency_centered")
    if consistency is not None:
        consistency = np.asarray([np.nan if c is None else c for c in consistency], dtype=float)
    rho = np.asarray([np.nan if r is None else r for r in view["p0_norm_ratio"]], dtype=float)
    emb = view.get("p0_norm_ratio_embeddings")
    return metrics.p0_circuit(
        rho,
        None if emb is None else float(emb),
        consistency,
        min_ratio=lean.move(config.bos_min_norm_ratio if bos else config.circuit_min_norm_ratio, want, ratio=True),
        min_consistency=lean.move(config.circuit_min_consistency, want, unit=True),
        min_persistence=lean.move(config.circuit_min_persistence, want, unit=True),
        shallow_blocks=config.final_max_circuit_layer + 1,
    )


class _P0Facts:
    """The predicates of the P0 rules on one anchor's view, answered exactly or leaning."""

    def __init__(self, view: Mapping[str, Any], config: StageConfig, *, bos: bool, lean: _Lean):
        self.view, self.config, self.bos, self.lean = view, config, bos, lean
        self.profile = np.nan_to_num(np.asarray(view["sink_profile"], dtype=float), nan=0.0)
        self.top = float(self.profile.max()) if self.profile.size else 0.0

    def circuit(self, want_found: bool) -> dict:
        """The circuit's layer and concentration, the thresholds leaning towards a circuit (not) found."""
        if "p0_norm_ratio" not in self.view:  # a record that carries only its circuit keys
            layer = self.view.get("circuit_layer")
            concentration = self.view.get("p0_concentration")
            if concentration is None:  # only a layer: blocks 0..final_max_circuit_layer hold all of it, or none
                concentration = float(layer is not None and layer <= self.config.final_max_circuit_layer)
            return {"circuit_layer": layer, "p0_concentration": concentration}
        return circuit(self.view, self.config, bos=self.bos, lean=self.lean, want=want_found)

    def layer(self, want_found: bool) -> int | None:
        return self.circuit(want_found)["circuit_layer"]

    def shallow(self, want: bool) -> bool:
        """A circuit concentrated in blocks 0..final_max_circuit_layer: found, and at least
        ``final_min_concentration`` of log rho_max gained there. The concentration, not the emergence
        block: when two blocks amplify alike the block flips with every probe, the share moves smoothly."""
        found = self.circuit(want)
        share = found["p0_concentration"]
        share = 0.0 if share is None or not math.isfinite(share) else float(share)
        return found["circuit_layer"] is not None and share >= self.lean.move(self.config.final_min_concentration, want, unit=True)

    def __call__(self, name: str, want: bool) -> bool:
        c, lean = self.config, self.lean
        if name == "present":
            return lean.at_least(self.top, c.sink_rate_floor, want, unit=True)
        if name == "established":
            return lean.at_least(self.top, c.established_sink_rate, want, unit=True)
        if name == "second":
            n = metrics.sink_positions(self.profile, lean.move(c.second_sink_ratio, want, unit=True), c.sink_rate_floor)
            return (n >= 2) == want
        if name == "centre0":
            return (self.view["sink_center"] == 0) == want
        if name == "circuit":
            return (self.layer(want) is not None) == want
        if name == "shallow":
            return self.shallow(want) == want
        raise KeyError(name)


# Each stage's rule over the predicates; exactly one holds for any record (tests/test_stages.py)
P0_RULES: dict[str, Callable[[Callable[[str, bool], bool]], bool]] = {
    "none": lambda q: q("present", False) and q("circuit", False),
    "early": lambda q: q("established", False) and (q("present", True) or q("circuit", True)),
    "transitional": lambda q: q("established", True) and (q("second", True) or (q("centre0", False) and q("shallow", False))),
    "final": lambda q: q("established", True) and q("centre0", True) and q("second", False) and q("shallow", True),
    "deep": lambda q: q("established", True) and q("centre0", True) and q("second", False) and q("shallow", False),
    "shifted": lambda q: q("established", True) and q("centre0", False) and q("second", False) and q("shallow", True),
}


def p0_views(record: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """anchor -> the numbers its stage is judged on: windows that start with one shared BOS carry both
    anchors (``p0_anchor_views``: the BOS on the windows as fed, position 0 on their BOS-free twin);
    other windows are the positional anchor themselves."""
    return dict(record["p0_anchor_views"]) if record.get("p0_anchor_views") else {"position": record}


def judged_view(record: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """(anchor, the numbers the P0 stage is judged on): the anchor the record names, else the BOS view when the
    windows start with one, else the record itself."""
    views = p0_views(record)
    anchor = record.get("p0_anchor") or ("bos" if "bos" in views else "position")  # no circuit: the windows as fed
    return anchor, views[anchor]


def _p0_usable(view: Mapping[str, Any]) -> bool:
    return all(view.get(k) is not None for k in ("sink_rate", "sink_profile", "sink_center"))


def classify_p0(record: Mapping[str, Any], config: StageConfig) -> tuple[str, dict]:
    """P0 stage of one record alone, judged on the anchor the record names, and the evidence."""
    anchor, view = judged_view(record)
    if not _p0_usable(view):
        return "none", {"reason": "no (finite) sink statistics"}
    facts = _P0Facts(view, config, bos=anchor == "bos", lean=_Lean(None))
    stage = next(s for s, rule in P0_RULES.items() if rule(facts))
    profile = facts.profile
    found = facts.circuit(True)  # with this config's thresholds, as the rules read it
    evidence = {
        "anchor": anchor,
        "sink_rate": view["sink_rate"],
        "max_sink_k": facts.top,
        "sink_center": view["sink_center"],
        "sink_positions": metrics.sink_positions(profile, config.second_sink_ratio, config.sink_rate_floor),
        "circuit_layer": found["circuit_layer"],
    }
    for key in ("p0_emergence_block", "p0_concentration"):
        if key in found:
            evidence[key] = found[key]
    if "rho_max" in view:
        evidence["rho_max"] = view["rho_max"]
    return stage, evidence


def p0_holds(record: Mapping[str, Any], stage: str, config: StageConfig) -> bool:
    """Whether ``record`` meets ``stage``'s hold rule: its rule with every threshold leaning its way."""
    anchor, view = judged_view(record)
    if not _p0_usable(view):
        return stage == "none"
    return P0_RULES[stage](_P0Facts(view, config, bos=anchor == "bos", lean=_Lean(config.p0_hold_factor)))


def p0_stage_by_anchor(record: Mapping[str, Any], config: StageConfig) -> dict[str, str] | None:
    """The stage each anchor reads, for windows that carry both (a BOS first); else None."""
    if not record.get("p0_anchor_views"):
        return None
    out = {}
    for anchor, view in p0_views(record).items():
        facts = _P0Facts(view, config, bos=anchor == "bos", lean=_Lean(None))
        out[anchor] = next(s for s, rule in P0_RULES.items() if rule(facts)) if _p0_usable(view) else "none"
    return out


# ---- induction ------------------------------------------------------------------------------------
def _induction_levels(record: Mapping[str, Any], config: StageConfig, lean: _Lean | None):
    """Per applicable rule: (the state it reads, its evidence). With ``lean``, the state is the highest
    one whose rule holds with the thresholds leaning its way (the hold reading)."""
    need = config.heads_needed(len(softmax_layers_of(record)), record["n_heads"])
    exact = _Lean(None)
    out = []
    if config.induction_rule in ("any", "selectivity") and "selectivity" in record:
        sel = np.nan_to_num(np.asarray(record["selectivity"]["induction"], dtype=float), nan=-np.inf)

        def formed(lv: _Lean) -> bool:
            return int((sel >= lv.move(config.formed_min_selectivity, True)).sum()) >= need

        def signal(lv: _Lean) -> bool:
            return bool((sel >= lv.move(config.forming_min_selectivity, True)).any())

        state = _ordered_state(formed, signal, lean or exact)
        n50 = int((sel >= config.formed_min_selectivity).sum())
        n30 = int((sel >= config.forming_min_selectivity).sum())
        out.append((state, {"rule": "selectivity", "heads_ge50": n50, "heads_ge30": n30, "min_heads": need}))
    if config.induction_rule in ("any", "prefix") and "induction_score" in record:
        score = np.nan_to_num(np.asarray(record["induction_score"], dtype=float), nan=-np.inf)
        icl = record.get("icl_score")
        icl = math.inf if icl is None else icl
        best = float(score.max()) if score.size else 0.0

        def formed(lv: _Lean) -> bool:
            heads = int((score >= lv.move(config.prefix_min_score, True)).sum()) >= need
            return heads and icl <= lv.move(config.prefix_max_icl, True)

        def signal(lv: _Lean) -> bool:
            return best >= lv.move(config.prefix_forming_score, True) or icl <= lv.move(config.prefix_forming_icl, True)

        state = _ordered_state(formed, signal, lean or exact)
        n_heads = int((score >= config.prefix_min_score).sum())
        evidence = {"rule": "prefix", "heads_above_score": n_heads, "best_score": best, "min_heads": need}
        evidence["icl_score"] = record.get("icl_score")
        out.append((state, evidence))
    return out


def _ordered_state(formed: Callable[[_Lean], bool], signal: Callable[[_Lean], bool], lean: _Lean) -> str:
    """formed if its rule holds; else forming if a forming signal does; else absent. Leaning, each
    threshold is the weaker one, so the state read is the highest one the probe holds."""
    if formed(lean):
        return "formed"
    return "forming" if signal(lean) else "absent"


def classify_induction(record: Mapping[str, Any], config: StageConfig) -> tuple[str, dict]:
    """Induction state of one record, the evidence, and which rule decided (``evidence['rule']``):
    the most advanced of the configured rules."""
    levels = _induction_levels(record, config, None)
    if not levels:
        return "absent", {"rule": None, "reason": "no induction statistics"}
    return max(levels, key=lambda r: INDUCTION_STATES.index(r[0]))


def induction_holds(record: Mapping[str, Any], stage: str, config: StageConfig) -> bool:
    """Whether ``record`` holds ``stage`` or a later one, each rule's thresholds leaning its way."""
    levels = _induction_levels(record, config, _Lean(config.hold_factor))
    held = max((INDUCTION_STATES.index(s) for s, _ in levels), default=0)
    return held >= INDUCTION_STATES.index(stage)


def classify(record: Mapping[str, Any], config: StageConfig) -> dict:
    """The stage rules applied to one record alone: ``p0_stage_now``, ``induction_state_now`` (and
    ``p0_stage_by_anchor`` for windows that start with a BOS)."""
    out = {"p0_stage_now": classify_p0(record, config)[0], "induction_state_now": classify_induction(record, config)[0]}
    by_anchor = p0_stage_by_anchor(record, config)
    if by_anchor is not None:
        out["p0_stage_by_anchor"] = by_anchor
    return out


# ---- events and the tracker -------------------------------------------------------------------------
@dataclass(frozen=True)
class StageEvent:
    """A declared transition. ``step``/``tokens``: the probe that confirmed it; ``first_met_*``: the
    probe where the stage's rule was first met in the run of probes that confirmed it; ``evidence``:
    that probe's numbers (the probe that met the rule, so the evidence never contradicts the event)."""

    timeline: str  # "p0" or "induction"
    stage: str
    previous: str
    step: int | None
    tokens: int | None
    first_met_step: int | None
    first_met_tokens: int | None
    evidence: dict = field(default_factory=dict)

    @property
    def regression(self) -> bool:
        rank = P0_RANK if self.timeline == "p0" else {s: i for i, s in enumerate(INDUCTION_STATES)}
        return rank[self.stage] < rank[self.previous]

    @property
    def level(self) -> str:
        """W&B alert level: the milestones (P0 ``final``, induction ``formed``) and regressions are WARN
        (worth a look); progress towards them and lateral moves (deep / transitional / shifted) are INFO."""
        return "WARN" if self.stage in (*P0_END_STATES, "formed") or self.regression else "INFO"

    @property
    def key(self) -> str:
        return f"{self.timeline}:{self.previous}->{self.stage}"

    def message(self) -> str:
        where = f"step {self.step}" if self.step is not None else "this probe"
        if self.tokens is not None:
            where += f" ({self.tokens:,} tokens)"
        name = "P0-sink circuit" if self.timeline == "p0" else "induction circuit"
        text = f"{name}: {self.previous} -> {self.stage} at {where}"
        if (self.first_met_step, self.first_met_tokens) != (self.step, self.tokens):
            first = f"step {self.first_met_step}" if self.first_met_step is not None else "an earlier probe"
            if self.first_met_tokens is not None:
                first += f" ({self.first_met_tokens:,} tokens)"
            text += f"; rule first met at {first}"
        if self.timeline == "p0" and self.stage == "deep" and self.evidence.get("circuit_layer") is None:
            text += ", with no circuit found there (the sink established on position 0, no block amplifying it persistently)"
        return text

    def to_dict(self) -> dict:
        return {**asdict(self), "level": self.level, "message": self.message()}


class StageTracker:
    """Declared stages with hysteresis (a Schmitt trigger per timeline); serialisable for resume.

    Per timeline it keeps the declared stage, the *runs* of candidate stages (the probe where a
    stage's rule was met, and how many probes since have met its hold rule), how many probes in a
    row have failed the declared stage's hold rule, and every stage a single probe read (``visited``).
    """

    def __init__(self, config: StageConfig | None = None):
        self.config = config or StageConfig()
        self.declared = {"p0": P0_STAGES[0], "induction": INDUCTION_STATES[0]}
        self.runs: dict[str, dict[str, dict]] = {t: {} for t in TIMELINES}
        self.failing = {t: 0 for t in TIMELINES}
        self.visited: dict[str, list[dict]] = {t: [] for t in TIMELINES}
        self.fired: list[dict] = []
        self.last_step: int | None = None
        self.n_updates = 0

    @property
    def p0_stage(self) -> str:
        return self.declared["p0"]

    @property
    def induction_state(self) -> str:
        return self.declared["induction"]

    def classify(self, record: Mapping[str, Any]) -> tuple[tuple[str, dict], tuple[str, dict]]:
        """Both timelines' per-record stage and evidence."""
        return classify_p0(record, self.config), classify_induction(record, self.config)

    def _holds(self, timeline: str, record: Mapping[str, Any], stage: str) -> bool:
        if timeline == "p0":
            return p0_holds(record, stage, self.config)
        return induction_holds(record, stage, self.config)

    @staticmethod
    def _rank(timeline: str, stage: str) -> int:
        return P0_RANK[stage] if timeline == "p0" else INDUCTION_STATES.index(stage)

    def update(self, record: dict) -> list[StageEvent]:
        """Consume one record; set its stage keys (declared, ``*_now``, ``stages_visited``); return new events."""
        (p0_now, p0_ev), (ind_now, ind_ev) = self.classify(record)
        record.update(classify(record, self.config))
        here = {"step": record.get("step"), "tokens": record.get("tokens")}
        events = []
        for timeline, now, evidence in (("p0", p0_now, p0_ev), ("induction", ind_now, ind_ev)):
            self._visit(timeline, now, here)
            event = self._advance(timeline, record, now, here, evidence)
            if event is not None:  # every declared change is an event: a stage re-entered after a regression alerts again
                self.fired.append({"key": event.key, **event.to_dict()})
                events.append(event)
        record["p0_stage"], record["induction_state"] = self.p0_stage, self.induction_state
        record["stages_visited"] = {t: [dict(v) for v in self.visited[t]] for t in TIMELINES}
        self.last_step = here["step"]
        self.n_updates += 1
        return events

    # the keys ``update`` writes into a record
    RECORD_KEYS = ("p0_stage", "induction_state", "p0_stage_now", "induction_state_now", "p0_stage_by_anchor", "stages_visited")

    def track(self, snapshot) -> list[StageEvent]:
        """``update`` for a probe's ``Snapshot``: its values gain the keys ``update`` writes, so its record
        holds them in the record's key order; returns the new events."""
        record = snapshot.to_record()
        events = self.update(record)
        snapshot.values.update({k: record[k] for k in self.RECORD_KEYS if k in record})
        return events

    def _visit(self, timeline: str, now: str, here: dict) -> None:
        seen = next((v for v in self.visited[timeline] if v["stage"] == now), None)
        if seen is None:
            first = {"first_step": here["step"], "first_tokens": here["tokens"]}
            self.visited[timeline].append({"stage": now, **first, "last_step": here["step"], "last_tokens": here["tokens"], "probes": 1})
        else:
            seen.update(last_step=here["step"], last_tokens=here["tokens"], probes=seen["probes"] + 1)

    def _advance(self, timeline: str, record: Mapping[str, Any], now: str, here: dict, evidence: dict) -> StageEvent | None:
        """One probe through the timeline's Schmitt trigger; the event if the declared stage changes."""
        declared, runs = self.declared[timeline], self.runs[timeline]
        rank = self._rank
        for stage in list(runs):  # runs already open: this probe must meet the stage's hold rule
            if self._holds(timeline, record, stage):
                runs[stage]["count"] += 1
            else:
                del runs[stage]
        # a probe that meets a stage's rule opens its run; on the ordered induction timeline meeting a
        # later state's rule also meets every state between (formed's heads are forming's signal)
        opening = [now]
        if timeline == "induction" and rank(timeline, now) > rank(timeline, declared):
            opening = list(INDUCTION_STATES[rank(timeline, declared) + 1 : rank(timeline, now) + 1])
        for stage in opening:  # a run keeps the evidence of the probe that met the rule: the event reports it
            if stage != declared and stage not in runs:
                runs[stage] = {"count": 1, "first_step": here["step"], "first_tokens": here["tokens"], "evidence": jsonable(evidence)}
        self.failing[timeline] = 0 if self._holds(timeline, record, declared) else self.failing[timeline] + 1
        confirmed = [s for s, r in runs.items() if r["count"] >= self.config.patience]
        left = self.failing[timeline] >= self.config.patience  # the declared stage failed its hold rule `patience` times in a row
        # The P0 timeline is a Schmitt trigger both ways: any change, up or down, needs the declared stage left
        # (its stages are not a line: an established sink can be deep, spread or shifted, and a reading that sits
        # on a boundary, such as an emergence-block tie, must not promote itself on noise). The induction timeline
        # is ordered and `absent` has no hold rule: a later state replaces the declared one once it is confirmed,
        # an earlier one only once the declared state is left.
        if timeline == "p0":
            pick = confirmed if left else []
        else:
            pick = [s for s in confirmed if rank(timeline, s) > rank(timeline, declared)] or (confirmed if left else [])
        if not pick:
            return None
        new = max(pick, key=lambda s: (rank(timeline, s), runs[s]["first_step"] or 0))
        run = runs[new]
        self.declared[timeline] = new
        self.failing[timeline] = 0
        for stage in list(runs):  # a run of a later stage than the new one stays open
            if rank(timeline, stage) <= rank(timeline, new):
                del runs[stage]
        return StageEvent(timeline, new, declared, here["step"], here["tokens"], run["first_step"], run["first_tokens"], run["evidence"])

    # ---- resume ----
    def state_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "declared": dict(self.declared),
            "runs": {t: {s: dict(r) for s, r in runs.items()} for t, runs in self.runs.items()},
            "failing": dict(self.failing),
            "visited": {t: [dict(v) for v in vs] for t, vs in self.visited.items()},
            "fired": list(self.fired),
            "last_step": self.last_step,
            "n_updates": self.n_updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "declared" not in state:
            raise ValueError(
                "this stage tracker state was saved by an earlier sinkwatch (forward-only stages); start a new tracker "
                "segment, or re-derive the stages offline with StageTracker(config).update(record) over the stored records"
            )
        if state["config"] != self.config.to_dict():
            raise ValueError("the saved stage tracker used different thresholds; resume with the same StageConfig or start a new run")
        self.declared = dict(state["declared"])
        self.runs = {t: {s: dict(r) for s, r in runs.items()} for t, runs in state["runs"].items()}
        self.failing = dict(state["failing"])
        self.visited = {t: [dict(v) for v in vs] for t, vs in state["visited"].items()}
        self.fired = list(state["fired"])
        self.last_step = state["last_step"]
        self.n_updates = state["n_updates"]

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> StageTracker:
        names = {f.name for f in fields(StageConfig)}
        unknown = sorted(set(state["config"]) - names)
        if unknown:
            raise ValueError(
                f"this stage tracker state was saved with thresholds this sinkwatch does not know ({unknown}); start a new tracker segment"
            )
        tracker = cls(StageConfig(**state["config"]))
        tracker.load_state_dict(state)
        return tracker
