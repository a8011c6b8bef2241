"""A live run's state and its store: what ``probes.json`` holds, and the state rebuilt from the store when a
framework saves none of ours (Fabric, torchtitan, Megatron resume from their own checkpoints: docs/live.md, "Resume").

The store is the logging rank's; every other rank takes rank 0's reading (``on_every_rank``), so the ranks that
probe together resume alike.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..reporters.jsonl import PROBES_FILE, read_jsonl
from ..stages import StageTracker

STATE_VERSION = 1


def live_probes(state: dict) -> dict:
    """What ``probes.json`` of a live store holds: the probe sets' hashes and parameters and the frozen
    natural windows (the callback state's probe keys), for ``sinkwatch replay DIR --live-store STORE``."""
    keys = ("version", "probe_hashes", "probe_params", "natural_tokens", "natural_params")
    return {**{k: state[k] for k in keys}, "probe_dtype": state.get("probe_dtype")}


def state_from_store(out_dir, step: int, stages) -> dict | None:
    """The live callback's state at optimizer step ``step``, rebuilt from its store (``probes.json`` and
    the records up to ``step``), or None when the store holds nothing. The stage tracker is re-fed the
    stored records of the current segment (same ``config_hash``, from ``tracker_since_step`` on)."""

    root = Path(out_dir)
    probes_file = root / PROBES_FILE
    probes = json.loads(probes_file.read_text()) if probes_file.is_file() else {}
    records = [r for r in read_jsonl(root / "records.jsonl") if r.get("step") is not None and "error" not in r]
    if not probes and not records:
        return None
    kept = sorted((r for r in records if r["step"] <= step), key=lambda r: r["step"])
    last = kept[-1] if kept else None
    tracker = None
    if last is not None:
        since = last.get("tracker_since_step") or 0
        segment = [r for r in kept if r.get("config_hash") == last.get("config_hash") and r["step"] >= since]
        t = StageTracker(stages)
        for r in segment:
            t.update(dict(r))
        tracker = t.state_dict()
    return {
        "version": STATE_VERSION,
        "probe_hashes": probes.get("probe_hashes"),
        "probe_params": probes.get("probe_params"),
        "natural_tokens": probes.get("natural_tokens"),
        "natural_params": probes.get("natural_params"),
        "tracker": tracker,
        "last_probed_step": None if last is None else last["step"],
        "tokens_seen": (last.get("tokens") or 0) if last is not None else 0,
        "n_probes": len(kept),
        "config_hash": None if last is None else last.get("config_hash"),
        "tracker_since_step": 0 if last is None else int(last.get("tracker_since_step") or 0),
    }


def last_stored_step(out_dir) -> int | None:
    steps = [r["step"] for r in read_jsonl(Path(out_dir) / "records.jsonl") if isinstance(r.get("step"), int)]
    return max(steps) if steps else None


def on_every_rank(obj):
    """Global rank 0's ``obj`` on every rank (itself without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
