"""Human-readable summaries of a record (docs/design.md §10)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..records import best_induction_score, n_sink_heads, softmax_heads, softmax_layers_of
from .base import Reporter


def _fmt(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def _mean(rows) -> float | None:
    values = [v for row in rows for v in (row or []) if v is not None]
    return sum(values) / len(values) if values else None


def one_line(record: Mapping[str, Any]) -> str:
    """One console line per probe: where, sinks, induction, stages."""
    parts = []
    if record.get("step") is not None:
        parts.append(f"step {record['step']}")
    if record.get("tokens") is not None:
        parts.append(f"{record['tokens']:,} tok")
    if record.get("revision"):
        parts.append(str(record["revision"]))
    if "sink_rate" in record:
        layer = record.get("circuit_layer")
        circuit = f"circuit L{layer}" if layer is not None else "no circuit"
        parts.append(f"sink {_fmt(record['sink_rate'])} (centre {record['sink_center']}, {circuit})")
    if "n_induction_ge50" in record:
        parts.append(f"ind>=50x {record['n_induction_ge50']} >=30x {record['n_induction_ge30']}")
    if "induction_score" in record:
        best = best_induction_score(record)
        parts.append(f"prefix {_fmt(best)} icl {_fmt(record.get('icl_score'), '+.2f')}")
    stage = record.get("p0_stage", record.get("p0_stage_now"))
    state = record.get("induction_state", record.get("induction_state_now"))
    parts.append(f"P0 {stage} | induction {state}")
    return "sinkwatch: " + " | ".join(parts)


def summary(record: Mapping[str, Any]) -> str:
    """A short multi-line summary for ``sinkwatch probe``."""
    L, H = record["n_layers"], record["n_heads"]
    softmax = softmax_layers_of(record)
    hybrid = f", softmax attention in blocks {softmax}" if len(softmax) < L else ""
    lines = [
        f"{record['model']}"
        + (f" @ {record['revision']}" if record.get("revision") else "")
        + f"  ({L} layers x {H} heads{hybrid}; probe {record['probe']} {record['probe_hash']})"
    ]
    if "sink_rate" in record:
        lines.append(
            f"  attention sinks : rate {_fmt(record['sink_rate'])} (Gu Sink_0, eps 0.3), centre position {record['sink_center']}, "
            f"per layer {[None if x is None else round(x, 2) for x in record['sink_rate_per_layer']]}"
        )
        rho = record.get("p0_norm_ratio") or []
        lines.append(
            f"  P0 circuit      : circuit layer {record.get('circuit_layer')}, "
            f"max norm ratio {_fmt(max((r for r in rho if r is not None), default=None), '.2f')}"
        )
    if "sink_heads_per_layer" in record:
        lines.append(
            f"  sink heads      : {n_sink_heads(record)} of {softmax_heads(record)} (first-token >= 30x), "
            f"per layer {record['sink_heads_per_layer']}"
        )
        lines.append(
            f"  induction heads : {record['n_induction_ge50']} at >= 50x {record['induction_heads'][:8]}, "
            f"{record['n_induction_ge30']} at >= 30x"
        )
    if record.get("sink_learned_alpha") is not None:
        lines.append(
            f"  learned sinks   : rate {_fmt(record.get('sink_learned_rate'))} (heads whose learned sink takes > 0.3 of a row), "
            f"mean mass {_fmt(_mean(record['sink_learned_alpha']))}"
        )
    if record.get("attn_gate_mean") is not None:
        lines.append(f"  attention gates : mean gate {_fmt(_mean(record['attn_gate_mean']))} over gated heads")
    if "induction_score" in record:
        best = best_induction_score(record)
        lines.append(f"  prefix matching : best head {_fmt(best)}, ICL score {_fmt(record.get('icl_score'), '+.3f')} nats")
    lines.append(f"  stages (this probe alone): P0 {record.get('p0_stage_now')}, induction {record.get('induction_state_now')}")
    return "\n".join(lines)


class ConsoleReporter(Reporter):
    """One line per probe and one per event, through ``print`` (or a given callable)."""

    name = "console"

    def __init__(self, write=print):
        self.write = write

    def log_record(self, record):
        self.write(one_line(record))

    def log_event(self, event):
        self.write(f"sinkwatch EVENT [{event['level']}]: {event['message']}")

    def log_error(self, step, message):
        self.write(f"sinkwatch: probe at step {step} failed: {message}")

    def finish(self):
        pass
