"""The record helpers (sinkwatch/records.py) are the one place their ideas live, and everyone uses them."""

import json
import math

import numpy as np

from sinkwatch import cli, records, snapshot, stages
from sinkwatch.metrics import SELECTIVITY_CLASSES
from sinkwatch.probes import PROBE_KINDS
from sinkwatch.reporting import console, wandb_run


def test_best_induction_score_is_the_largest_defined_cell():
    """The best score skips nulls; no score (absent, None or empty) gives None."""
    assert records.best_induction_score({"induction_score": [[0.1, None], [0.7, 0.3]]}) == 0.7
    assert records.best_induction_score({"induction_score": [[None]]}) is None
    for rec in ({}, {"induction_score": None}, {"induction_score": []}):
        assert records.best_induction_score(rec) is None


def test_consumers_report_the_same_best_score():
    """Console and W&B show the helper's value."""
    rec = {"induction_score": [[0.25, 0.5]], "icl_score": -1.0}
    assert "prefix 0.5" in console.one_line(rec)
    assert wandb_run.scalars(rec)["sinkwatch/induction_score_max"] == 0.5


def test_head_class_table_follows_the_canonical_class_order():
    """Columns and row values follow metrics.SELECTIVITY_CLASSES."""
    assert records.HEAD_CLASS_COLUMNS == ("layer", "head", "best_class", *SELECTIVITY_CLASSES)
    sel = {c: [[float(i)]] for i, c in enumerate(SELECTIVITY_CLASSES)}
    rows = records.head_class_rows({"selectivity": sel, "best_class": [["first"]]})
    assert rows == [[0, 0, "first", *[float(i) for i in range(len(SELECTIVITY_CLASSES))]]]
    assert records.head_class_rows({"selectivity": sel}) == []


def test_one_jsonable_everywhere():
    """Snapshot records and stage events use the same jsonable, which writes plain JSON."""
    assert snapshot.jsonable is records.jsonable and stages.jsonable is records.jsonable
    value = {1: np.array([[1.5, np.nan]]), "b": (np.int64(3), np.bool_(True), math.inf)}
    assert json.loads(json.dumps(records.jsonable(value))) == {"1": [[1.5, None]], "b": [3, True, None]}


def test_cli_probe_choices_are_the_probe_kinds():
    """The CLI's --probe accepts exactly the probe kinds."""
    assert cli._probe_kinds(",".join(PROBE_KINDS)) == list(PROBE_KINDS)
