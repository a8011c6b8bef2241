"""Snapshot: one probe of one model at one point in training, and its stable record (docs/design.md §10)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..records import jsonable

# Keys of docs/design.md §10 in the order records are written. Values that the configured probes cannot
# produce are absent from a record, never zero. Hybrid stacks: every attention-derived [L] / [L][H]
# array keeps all L blocks, with null entries (a row of H nulls) for blocks without softmax
# attention; ``softmax_layers`` lists the others. Models with learned sinks add
# ``sink_learned_alpha`` / ``sink_learned_rate``, gated attention ``attn_gate_mean`` (extras, sorted).
RECORD_KEYS = (
    "model", "revision", "step", "tokens", "probe", "probe_hash", "n_layers", "n_heads", "softmax_layers",
    "sink_rate", "sink_profile", "sink_rate_per_layer", "sink_alpha", "sink_center",
    "selectivity", "best_class", "sink_heads_per_layer", "bos_fraction_raw", "bos_fraction_bestclass",
    "induction_heads", "n_induction_ge30", "n_induction_ge50", "pr", "induction_score", "icl_score",
    "p0_norm_ratio", "p0_direction_consistency", "circuit_layer", "p0_anchor",
    "p0_stage", "induction_state", "p0_stage_now", "induction_state_now",
)  # fmt: skip


def combined_probe_hash(hashes: Mapping[str, str]) -> str:
    """One hash for several probe sets (the single set's own hash when there is one)."""
    if len(hashes) == 1:
        return next(iter(hashes.values()))
    text = ";".join(f"{k}:{hashes[k]}" for k in sorted(hashes))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Snapshot:
    """Metrics of one probe. ``values`` maps record keys (and extras) to arrays or scalars."""

    model: str
    n_layers: int
    n_heads: int
    probe_hashes: dict[str, str]
    values: dict[str, Any] = field(default_factory=dict)
    revision: str | None = None
    step: int | None = None
    tokens: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __contains__(self, key: str) -> bool:
        return key in self.values

    @property
    def probe(self) -> str:
        return "+".join(self.probe_hashes)

    def to_record(self) -> dict:
        """The JSON record of docs/design.md §10 (keys in spec order, then extras), ready for ``json.dumps``."""
        base = {
            "model": self.model,
            "revision": self.revision,
            "step": self.step,
            "tokens": self.tokens,
            "probe": self.probe,
            "probe_hash": combined_probe_hash(self.probe_hashes),
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
        }
        record = {k: base[k] for k in base}
        for k in RECORD_KEYS:
            if k in self.values:
                record[k] = jsonable(self.values[k])
        for k in sorted(self.values):
            if k not in record:
                record[k] = jsonable(self.values[k])
        record["probe_hashes"] = dict(self.probe_hashes)
        return record
