"""Helpers shared by everything that reads or writes records (docs/design.md §10): one place per idea.

``jsonable`` (what a record value becomes in JSON), ``best_induction_score`` (the headline of the
prefix-matching heatmap), the head-class table (``HEAD_CLASS_COLUMNS``, ``head_class_rows``)
whose class columns follow ``metrics.SELECTIVITY_CLASSES``, and the counts over softmax blocks
(``softmax_layers_of``, ``softmax_heads``, ``n_sink_heads``) that hybrid stacks need: their records
hold null entries for blocks without softmax attention; ``versions`` and ``device_of``: where a
record was made (every record, live or replayed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .metrics import SELECTIVITY_CLASSES

HEAD_CLASS_COLUMNS = ("layer", "head", "best_class", *SELECTIVITY_CLASSES)


def jsonable(x: Any) -> Any:
    """Nested lists of plain Python numbers; NaN and infinities become None."""
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    return x


def best_induction_score(record: Mapping[str, Any]) -> float | None:
    """The largest prefix-matching score over heads (None without the repeated-random probe)."""
    if not record.get("induction_score"):
        return None
    return max((v for row in record["induction_score"] for v in row if v is not None), default=None)


def head_class_rows(record: Mapping[str, Any]) -> list[list]:
    """Rows of ``HEAD_CLASS_COLUMNS`` (layer, head, best class, one selectivity per class) of the
    screen, for the heads of softmax blocks (a hybrid stack's other blocks have no class)."""
    sel = record.get("selectivity")
    best = record.get("best_class")
    if sel is None or best is None:
        return []
    softmax = record.get("softmax_layers")
    rows = []
    for l, row in enumerate(best):
        if softmax is not None and l not in softmax:
            continue
        for h, cls in enumerate(row):
            rows.append([l, h, cls] + [sel[c][l][h] for c in SELECTIVITY_CLASSES])
    return rows


def softmax_layers_of(record: Mapping[str, Any]) -> list[int]:
    """The blocks with softmax attention (records written before hybrid support: all of them)."""
    layers = record.get("softmax_layers")
    return list(range(record["n_layers"])) if layers is None else list(layers)


def softmax_heads(record: Mapping[str, Any]) -> int:
    """Query heads in softmax blocks: the denominator of every head fraction."""
    return len(softmax_layers_of(record)) * record["n_heads"]


def n_sink_heads(record: Mapping[str, Any]) -> int | None:
    """Heads with first-token selectivity >= 30x over the softmax blocks (None without the screen)."""
    per_layer = record.get("sink_heads_per_layer")
    return None if per_layer is None else int(sum(n for n in per_layer if n is not None))


VERSION = "0.1.0"  # sinkwatch's (``sinkwatch.__version__``, the package metadata's): every record says it


# ---- where a record was made (docs/design.md §10: every record, live, probe and replay) ----------------------------------
def versions() -> dict[str, str]:
    """The versions a record was made with (docs/design.md §10)."""
    import huggingface_hub
    import torch
    import transformers

    return {
        "sinkwatch": VERSION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "huggingface_hub": huggingface_hub.__version__,
    }


def device_of(model) -> str:
    """Where the model's weights sit: ``cpu``, ``cuda:0 (NVIDIA H200)``, ``cuda:0,cuda:1`` when split."""
    import torch

    devices = sorted({str(p.device) for p in model.parameters()})
    names = []
    for d in devices:
        dev = torch.device(d)
        if dev.type == "cuda" and torch.cuda.is_available():
            names.append(f"{d} ({torch.cuda.get_device_name(dev)})")
        else:
            names.append(d)
    return ",".join(names) if names else "none"
