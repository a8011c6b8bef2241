"""The store as the report reads it: one record per revision, in training order, the duplicate groups taken
from the store's manifest, and the stages derived over the whole trajectory."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..reporters.jsonl import read_jsonl
from ..stages import StageTracker
from .manifest import read_manifest
from .provenance import Weights
from .revisions import lineage, runs_of, training_order
from .store import stage_config_of, stored_records


def merged_records(store_dir: str | os.PathLike) -> list[dict]:
    """A store's successful records, one per revision (the latest written), in training order, with ``p0_stage`` and
    ``induction_state`` derived over the sequence with the replay's StageConfig, as replay derives them per record:
    per run, a parallel run (an OLMo-2 ingredient) over the main run before it, then its own. Revisions the manifest
    flags as duplicates (``duplicate_groups``) are no trajectory points: left out (the report lists them)."""
    d = Path(store_dir)
    latest = {r["revision"]: r for r in stored_records(d)}
    if not latest:
        rows = [r for r in read_jsonl(d / "records.jsonl") if "n_layers" in r]  # a live run's store: records keyed by step
        return sorted(rows, key=lambda r: (r.get("step") is None, r.get("step") or 0))
    flagged = duplicate_groups(d, list(latest.values()))
    records = training_order([r for r in latest.values() if r["revision"] not in flagged])
    config = stage_config_of(records)
    for run, own in runs_of(records).items():
        tracker = StageTracker(config)
        mine = {id(r) for r in own}
        for r in lineage(records, run):
            tracker.update(r if id(r) in mine else dict(r))  # the main run's records keep their own stages
    return records


def duplicate_groups(store_dir: str | os.PathLike, records: Sequence[dict] | None = None) -> dict[str, dict]:
    """revision -> ``{"duplicate_of", "duplicate_group", "duplicate_kind"}`` of every flagged revision: the manifest's
    groups over the whole listing (with weights tasks learned later: records' ``weight_files``), whatever a record was
    stamped with. A store without a manifest (older, or a live store), or a record whose group holds a ref the
    manifest could not read, keeps the record's stamp."""
    records = stored_records(store_dir) if records is None else records
    latest = {r["revision"]: r for r in records if r.get("revision") is not None}
    m = read_manifest(store_dir) if (Path(store_dir) / "manifest.json").is_file() else None
    out = {}
    if m is not None:
        learned = {n: Weights(dict(r["weight_files"])) for n, r in latest.items() if n in m.entries and r.get("weight_files")}
        for name, g in m.groups(extra={n: w for n, w in learned.items() if not m.entries[n].get("weights")}).items():
            kind = "identical" if g.identical else "shared files: " + ", ".join(g.shared_files)
            out[name] = {"duplicate_of": g.duplicate_of, "duplicate_group": list(g.members), "duplicate_kind": kind}
    for name, r in latest.items():  # stamped by a task that read weights the manifest could not (main's, a tag's): kept
        unread = m is not None and any(not (m.entries.get(x) or {}).get("weights") for x in r.get("duplicate_group") or ())
        if (m is None or name not in m.entries or unread) and name not in out and r.get("duplicate_of"):
            out[name] = {k: r.get(k) for k in ("duplicate_of", "duplicate_group", "duplicate_kind")}
    return out
