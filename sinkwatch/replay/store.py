"""The replay store: one measurement per directory, keyed records, shards, merged reading."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from ..probes import ProbeSet
from ..reporting.jsonl import append_jsonl, read_jsonl
from ..stages import StageTracker
from .revisions import training_order


# ---- the store -------------------------------------------------------------------------------------------
def shard_from_env() -> tuple[int, int]:
    """(K, N) from torchrun / accelerate launch (RANK, WORLD_SIZE), else (0, 1)."""
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)) or 0)
    world = int(os.environ.get("WORLD_SIZE", 1) or 1)
    return rank, max(world, 1)


def parse_shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"--shard must be K/N with 0 <= K < N, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def replay_key(model: str, dtype: str, protocol: str, probes: Sequence) -> dict:
    """What makes two replays of a revision the same measurement: the model, its dtype, the protocol
    and the probe sets (each probe recipe's parameters, or a ready probe set's content hash; with the
    model fixed, these determine the probe hashes)."""
    return {"model": model, "dtype": dtype, "protocol": protocol, "probes": {p.kind: _probe_spec(p) for p in probes}}


def _probe_spec(probe) -> dict | str:
    if isinstance(probe, ProbeSet):
        return probe.hash
    spec = {}
    for f in dataclasses.fields(probe):
        v = getattr(probe, f.name)
        try:
            json.dumps(v)
        except TypeError:  # token tensors, tokenizer objects: their content, hashed
            v = hashlib.sha256(repr(v.tolist() if hasattr(v, "tolist") else v).encode()).hexdigest()[:16]
        spec[f.name] = list(v) if isinstance(v, tuple) else v
    return spec


def done_key(key: dict, revision: str, commit: str | None) -> str:
    """The one key that says a revision is measured, wherever in the store its record lies: the replay
    key (what was measured, how), the revision's name and the commit that name resolved to (what
    weights). A branch that moved to new weights has a new done key and is measured again. 16 hex digits."""
    payload = {"key": key, "revision": revision, "commit": commit}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def record_done_key(record: dict) -> str:
    """``done_key`` of a stored record (its replay key, revision and ``commit``; None before commits were recorded)."""
    return done_key(key_of(record), record.get("revision"), record.get("commit"))


def key_of(record: dict) -> dict:
    """The replay key a stored record was made with; records from before keys were stored lack one
    (their protocol was sinkwatch's; what probes they used is unknown)."""
    if "replay_key" in record:
        return record["replay_key"]
    return {
        "model": record.get("model"),
        "dtype": record.get("dtype"),
        "protocol": record.get("protocol", "sinkwatch"),
        "probes": "unrecorded",
    }


def key_difference(stored: dict, wanted: dict) -> list[str]:
    """Human-readable differences between two replay keys ("dtype: float32 -> float16")."""
    out = []
    for k in ("model", "dtype", "protocol"):
        if stored.get(k) != wanted.get(k):
            out.append(f"{k}: {stored.get(k)} -> {wanted.get(k)}")
    a, b = stored.get("probes"), wanted.get("probes")
    if a != b:
        if not isinstance(a, dict) or not isinstance(b, dict):
            out.append(f"probes: {a} -> {b}")
        else:
            for kind in sorted(set(a) | set(b)):
                pa, pb = a.get(kind), b.get(kind)
                if pa == pb:
                    continue
                if isinstance(pa, dict) and isinstance(pb, dict):
                    out += [f"{kind} probe {f}: {pa.get(f)} -> {pb.get(f)}" for f in sorted(set(pa) | set(pb)) if pa.get(f) != pb.get(f)]
                else:
                    out.append(f"{kind} probe: {pa or 'absent'} -> {pb or 'absent'}")
    return out


class StoreMismatchError(ValueError):
    """A store holds records made another way than the replay asked for."""


class ReplayStore:
    """``DIR/records.jsonl`` (or one shard's file). A record is appended only when complete; a line
    torn by a crash is skipped when reading, so that revision is simply done again.

    A revision is done only when its record was made with the same replay key (model, dtype,
    protocol, probes). A store holding records made another way is refused with an error naming
    the difference — one store, one measurement — rather than mixing two protocols in one report.
    """

    def __init__(self, out_dir: str | os.PathLike, shard: tuple[int, int] = (0, 1)):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        k, n = shard
        self.path = self.dir / ("records.jsonl" if n == 1 else f"records.shard-{k}-of-{n}.jsonl")

    def rows(self) -> list[dict]:
        return read_jsonl(self.path)

    def done(self, key: dict | None = None) -> set[str]:
        """Revisions with a successful record (made with ``key``, when given)."""
        return {
            r["revision"] for r in self.rows() if r.get("status", "ok") == "ok" and "revision" in r and (key is None or key_of(r) == key)
        }

    def check(self, key: dict) -> None:
        """Refuse (StoreMismatchError) when any successful record of this store's directory — every
        shard — was made with another replay key."""
        for path in sorted(self.dir.glob("records*.jsonl")):
            if ".superseded" in path.name:  # set aside on purpose: not part of the store
                continue
            for r in read_jsonl(path):
                if r.get("status", "ok") != "ok" or "n_layers" not in r:
                    continue
                diff = key_difference(key_of(r), key)
                if diff:
                    raise StoreMismatchError(
                        f"{self.dir} already holds records made another way ({'; '.join(diff)}; first: {r.get('revision')}). "
                        "Its numbers would be reported as this replay's: replay into another --out, "
                        "or move its records*.jsonl away to redo them"
                    )

    def append(self, row: dict) -> None:
        append_jsonl(self.path, row)


def merged_records(store_dir: str | os.PathLike) -> list[dict]:
    """All successful records of a store (every shard), one per revision (the latest), in training
    order, with ``p0_stage``/``induction_state`` re-derived over the merged sequence."""
    d = Path(store_dir)
    latest: dict[str, dict] = {}
    for path in sorted(d.glob("records*.jsonl")):
        if ".superseded" in path.name:
            continue
        for r in read_jsonl(path):
            if r.get("status", "ok") == "ok" and r.get("revision") is not None and "n_layers" in r:
                latest[r["revision"]] = r
    if not latest:
        # a live run's store: records keyed by step
        rows = [r for r in read_jsonl(d / "records.jsonl") if "n_layers" in r]
        return sorted(rows, key=lambda r: (r.get("step") is None, r.get("step") or 0))
    records = [latest[r] for r in training_order(list(latest))]
    tracker = StageTracker()
    for r in records:
        tracker.update(r)
    return records


def failed_revisions(store_dir: str | os.PathLike) -> dict[str, str]:
    """revision -> error of revisions whose latest attempt failed."""
    status: dict[str, dict] = {}
    for path in sorted(Path(store_dir).glob("records*.jsonl")):
        for r in read_jsonl(path):
            if r.get("revision") is not None:
                status[r["revision"]] = r
    return {rev: r.get("error", "") for rev, r in status.items() if r.get("status") == "failed"}
