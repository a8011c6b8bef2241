"""Loading records: a store (replay or live) read into the series a report draws.

A store's merged records become its trajectory; a live store is cut where its ``config_hash`` changes
or its steps restart (``Store.segments``), and a store of parallel runs gives one series per run
(``Store.series``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path

from ..replay import duplicate_groups, failed_revisions, merged_records, read_ablation
from ..replay.provenance import moved_branches
from ..replay.revisions import order_key
from ..replay.store import stored_records
from ..reporters.jsonl import read_jsonl
from . import findings as F


class Store:
    def __init__(self, path: str | os.PathLike, reference: dict | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"no store at {self.path} (a directory with records.jsonl)")
        merged = merged_records(self.path)
        if not merged:
            raise ValueError(f"{self.path} holds no successful records yet")
        # a revision named without a step (main, a tag) is measured but is no point of the trajectory:
        # listed apart, never drawn at step 0 (which cost the whole store its token axis)
        self.outside = [r for r in merged if r.get("step") is None and r.get("tokens") is None and r.get("revision")]
        self.records = [r for r in merged if r not in self.outside] or merged
        if self.records is merged:
            self.outside = []
        stored = stored_records(self.path)
        # duplicates, by the store's manifest (the groups over the whole listing, not each record's stamp): listed, not drawn
        latest = {r["revision"]: r for r in stored}
        groups = duplicate_groups(self.path, stored)
        self.flagged = sorted(({**latest[n], **g} for n, g in groups.items() if n in latest), key=order_key)
        self.unverified = [r for r in self.records if r.get("weights_unverified")]  # drawn, their weights never checked
        self.moved = moved_branches(stored)  # branches measured at more than one commit
        self.run = None  # a parallel run's name when this is one series of a store (``series``)
        self.model = self.records[-1]["model"]
        self.label = self.model if self.model not in ("", None) else self.path.name
        self.failed = failed_revisions(self.path)
        self.events = read_jsonl(self.path / "events.jsonl")
        self.is_replay = any(r.get("revision") for r in self.records)
        self.reference_key = F.reference_key(self.model, reference)
        # records from before sinkwatch named the protocol were made with sinkwatch's
        self.protocols = sorted({r.get("protocol", "sinkwatch") for r in self.records})
        self.protocol = self.protocols[0] if len(self.protocols) == 1 else "mixed: " + ", ".join(self.protocols)
        self.ablation = read_ablation(self.path)  # DIR/ablation.json: the group ablation, when the replay ran it
        self.segment_note = ""

    def segments(self) -> list[Store]:
        """One series per run and configuration in this store, each drawn as its own line.

        A live store read in file order is cut where ``config_hash`` changes (a resume with other
        probes or stage thresholds: the numbers are not comparable across it) and where the step does
        not increase (a run appended to an earlier run's file, as sinkwatch did before each new run
        moved the old store aside). Replay stores, and a live store that is one segment, are themselves.
        """
        if self.is_replay:
            return [self]
        rows = [r for r in read_jsonl(self.path / "records.jsonl") if "n_layers" in r]  # file order, not sorted by step
        runs = split_segments(rows)
        if len(runs) < 2:
            return [self]
        hashes = [seg[0].get("config_hash") for seg in runs]
        out = []
        for i, (seg, events) in enumerate(zip(runs, _events_by_segment(self.events, runs))):
            part = copy.copy(self)
            part.records = seg
            part.events = events
            tag = hashes[i] or "no config_hash"
            part.label = f"{self.label} [{tag}]" if hashes.count(hashes[i]) == 1 else f"{self.label} [{tag} run {i + 1}]"
            part.segment_note = (
                f"segment {i + 1} of {len(runs)} in this store: config_hash {hashes[i]}, steps {seg[0].get('step')}-{seg[-1].get('step')}"
            )
            out.append(part)
        return out

    def series(self) -> list[Store]:
        """One view per run (OLMo-2's stage-2 ingredients are parallel runs): the main run, then each
        parallel run as its own series, labelled ``label [run]``; a store with one run is itself."""
        runs = list(dict.fromkeys(r.get("run") for r in self.records))
        if len(runs) <= 1:
            return [self]
        out = []
        for run in runs:
            view = copy.copy(self)
            view.records = [r for r in self.records if r.get("run") == run]
            view.run = run
            view.label = self.label if run is None else f"{self.label} [{run}]"
            if run is not None:  # what belongs to the store as a whole is reported once, with the main run
                view.outside, view.flagged, view.moved, view.failed, view.events, view.ablation = [], [], {}, {}, [], None
            out.append(view)
        return out

    @property
    def has_tokens(self) -> bool:
        """Whether every record knows its tokens seen (else the x axis is the training step)."""
        return all(r.get("tokens") is not None for r in self.records)

    def x(self) -> list[float]:
        """Tokens seen (the step when tokens are unknown: ``has_tokens`` says which)."""
        return [float(r["tokens"]) if r.get("tokens") is not None else float(r.get("step") or 0) for r in self.records]

    def column(self, key: str, fn=lambda v: v) -> list:
        return [fn(r[key]) if r.get(key) is not None else None for r in self.records]


def split_segments(records: Sequence[dict]) -> list[list[dict]]:
    """Live records in file order, cut into runs of one ``config_hash`` and increasing steps."""
    runs: list[list[dict]] = []
    for r in records:
        prev = runs[-1][-1] if runs else None
        step, prev_step = r.get("step"), (prev or {}).get("step")
        if (
            prev is None
            or r.get("config_hash") != prev.get("config_hash")
            or (step is not None and prev_step is not None and step <= prev_step)
        ):
            runs.append([])
        runs[-1].append(r)
    return runs


def _events_by_segment(events: Sequence[dict], runs: Sequence[Sequence[dict]]) -> list[list[dict]]:
    """Each event under the segment whose steps hold its step. Segments whose step ranges overlap
    (runs appended to one file) cannot be told apart by step: their events stay with the last such
    segment, which says so."""
    spans = [(seg[0].get("step") or 0, seg[-1].get("step") or 0) for seg in runs]
    out: list[list[dict]] = [[] for _ in runs]
    for e in events:
        step = e.get("step") or 0
        hits = [i for i, (a, b) in enumerate(spans) if a <= step <= b]
        out[hits[-1] if hits else len(runs) - 1].append({**e, "ambiguous": True} if len(hits) > 1 else e)
    return out
