"""Helpers shared by everything that reads or writes records (SPEC §10): one place per idea.

``jsonable`` (what a record value becomes in JSON), ``best_induction_score`` (the headline of the
prefix-matching heatmap), and the head-class table (``HEAD_CLASS_COLUMNS``, ``head_class_rows``)
whose class columns follow ``metrics.SELECTIVITY_CLASSES``.
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
    """Rows of ``HEAD_CLASS_COLUMNS`` (layer, head, best class, one selectivity per class) of the screen."""
    sel = record.get("selectivity")
    best = record.get("best_class")
    if sel is None or best is None:
        return []
    rows = []
    for l, row in enumerate(best):
        for h, cls in enumerate(row):
            rows.append([l, h, cls] + [sel[c][l][h] for c in SELECTIVITY_CLASSES])
    return rows
