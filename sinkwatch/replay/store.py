"""The replay store: one measurement per directory, keyed records, one file per worker, done anywhere, merged reading."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path

from ..probes import ProbeSet
from ..stages import StageConfig
from .workers import Worker, detect_worker


def replay_key(model: str, dtype: str, protocol: str, probes: Sequence) -> dict:
    """What makes two replays of a revision the same measurement: model, dtype, protocol and probe sets (a recipe's
    parameters, or a ready probe set's content hash; with the model fixed, these determine the probe hashes)."""
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
    """The key (16 hex digits) that says a revision is measured, wherever its record lies: the replay key, the revision's
    name and the commit it resolved to. A branch moved to new weights has a new done key and is measured again."""
    payload = {"key": key, "revision": revision, "commit": commit}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def record_done_key(record: dict) -> str:
    """``done_key`` of a stored record (its replay key, revision and ``commit``; None before commits were recorded)."""
    return done_key(key_of(record), record.get("revision"), record.get("commit"))


def key_of(record: dict) -> dict:
    """The replay key a stored record was made with; an older record without one: protocol sinkwatch, probes unknown."""
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


RECORDS_DIR = "records"


class ReplayStore:
    """One replay store (a directory), as one worker sees it.

    Each measured revision is one file, ``DIR/records/KEY.json`` (KEY: its ``done_key``), written whole to a temp file and
    published by hard link, which fails when the name exists: no torn record, no two records for one key, and "done" is a
    name lookup (O(1)). A failed attempt is ``DIR/records/KEY.failed.json`` (replaced by each new failure, removed by the
    success that follows); it never counts as done. Legacy stores (``records*.jsonl``, one file per worker, but not
    ``*.superseded*``) still read, by every reader (``merged_records``, the report).

    Done means a record with the same replay key (model, dtype, protocol, probes) and commit. A store holding records
    made another way is refused, naming the difference: one store, one measurement, never two protocols in one report.
    """

    def __init__(self, out_dir: str | os.PathLike, worker: Worker | None = None):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.worker = worker or detect_worker()
        self.path = self.dir / RECORDS_DIR  # where this worker's records go
        self.path.mkdir(exist_ok=True)
        self._offsets: dict[Path, int] = {}
        self._legacy: list[dict] = []
        self._files: dict[str, tuple[int, list[dict]]] = {}  # record file name -> (mtime_ns, its rows)
        self._legacy_done: set[str] | None = None
        self.is_done("")  # a legacy store's done keys, read once now: every lookup after is one stat

    def rows(self) -> list[dict]:
        """Every complete row of the store (ok and failed): the record files, then the legacy jsonl files, read up to now."""
        for path in _legacy_files(self.dir):
            self._legacy.extend(_read_new_lines(path, self._offsets))
        seen = set()
        for entry in os.scandir(self.path) if self.path.is_dir() else ():
            if not entry.name.endswith(".json") or entry.name.startswith("."):
                continue
            seen.add(entry.name)
            try:
                mtime = entry.stat().st_mtime_ns
            except FileNotFoundError:
                continue
            cached = self._files.get(entry.name)
            if cached is None or cached[0] != mtime:
                self._files[entry.name] = (mtime, _read_new_lines(Path(entry.path), {}))
        for name in set(self._files) - seen:
            del self._files[name]  # a failed attempt a success replaced
        return [*self._legacy, *(r for _, rows in self._files.values() for r in rows)]

    def ok_records(self, key: dict | None = None) -> list[dict]:
        """Successful records (made with ``key``, when given), in the order they were written (``write_order``)."""
        return write_order(r for r in self.rows() if _is_ok_record(r) and (key is None or key_of(r) == key))

    def record_path(self, done: str, *, failed: bool = False) -> Path:
        return self.path / (f"{done}.failed.json" if failed else f"{done}.json")

    def is_done(self, done: str) -> bool:
        """Whether the done key ``done`` has a successful record: one name lookup (a legacy jsonl store: read once)."""
        if self.record_path(done).exists():
            return True
        if self._legacy_done is None:
            offsets: dict[Path, int] = {}
            rows = write_order(r for p in _legacy_files(self.dir) for r in _read_new_lines(p, offsets))
            self._legacy_ok = {record_done_key(r): r for r in rows if _is_ok_record(r)}  # the latest written of each key
            self._legacy_done = set(self._legacy_ok)
        return done in self._legacy_done

    def read(self, done: str) -> dict | None:
        """The successful record of done key ``done``, else its failed row, else None."""
        rows = _read_new_lines(self.record_path(done), {})
        if rows:
            return rows[-1]
        if self.is_done(done):  # a legacy store's record
            return self._legacy_ok[done]
        rows = _read_new_lines(self.record_path(done, failed=True), {})
        return rows[-1] if rows else None

    def check(self, key: dict) -> None:
        """Refuse (StoreMismatchError) when any successful record of the store was made with another replay key."""
        check_records(self.ok_records(), key, self.dir)

    def write(self, row: dict) -> bool:
        """Publish ``row``, whole or not at all, as its done key's file. A success (or a skipped duplicate) is written once
        (False: the key has its record already, which is kept) and removes the failed row; a failure replaces the previous
        failure, never a success."""
        row.setdefault("written_at", time.time())  # orders records of one revision across workers (write_order)
        done = record_done_key(row)
        ok = row.get("status", "ok") in ("ok", "skipped")
        final = self.record_path(done)
        if not ok and final.exists():
            return False
        tmp = self.path / f".{done}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            tmp.write_text(json.dumps(row, allow_nan=False) + "\n")
            if ok:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    return False
                except OSError:  # no hard links (some FUSE mounts): exclusive create
                    fd = os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                    with os.fdopen(fd, "w") as f:
                        f.write(tmp.read_text())
                self.record_path(done, failed=True).unlink(missing_ok=True)
            else:
                os.replace(tmp, self.record_path(done, failed=True))
                if final.exists():  # another attempt's success landed meanwhile: no failed row beside it
                    self.record_path(done, failed=True).unlink(missing_ok=True)
                    return False
        finally:
            tmp.unlink(missing_ok=True)
        return True

    append = write


def check_records(records, key: dict, where) -> None:
    """Refuse (StoreMismatchError) when any of ``records`` (a store's successful ones) was made with another replay key."""
    for r in records:
        diff = key_difference(key_of(r), key)
        if diff:
            raise StoreMismatchError(
                f"{where} already holds records made another way ({'; '.join(diff)}; first: {r.get('revision')}). "
                "Its numbers would be reported as this replay's: replay into another --out, "
                "or move its records/, records*.jsonl and manifest.json away to redo them"
            )


def write_order(rows) -> list[dict]:
    """Rows in write order over every worker's file, by ``written_at``: of two records of one revision (a moved branch
    measured again by another process) the later is the latest. Older rows without it come first, in file order."""
    return sorted(rows, key=lambda r: r.get("written_at") or 0.0)


def stored_records(store_dir: str | os.PathLike) -> list[dict]:
    """Every successful record of a store, from every worker's file, in ``write_order``; reads only."""
    offsets: dict[Path, int] = {}
    return write_order(r for path in record_files(store_dir) for r in _read_new_lines(path, offsets) if _is_ok_record(r))


def record_files(store_dir: str | os.PathLike) -> list[Path]:
    """The store's JSON-lines files: ``records/KEY.json`` and ``records/KEY.failed.json`` (one line each) in write order,
    then the legacy ``records*.jsonl`` (not ``*.superseded*``)."""
    d = Path(store_dir) / RECORDS_DIR
    own = [p for p in d.glob("*.json") if not p.name.startswith(".")] if d.is_dir() else []
    return [*sorted(own, key=_written), *_legacy_files(store_dir)]  # in the order they were written, as one file's lines were


def _written(p: Path) -> tuple[int, str]:
    try:
        return p.stat().st_mtime_ns, p.name
    except FileNotFoundError:  # a failed row a success replaced meanwhile
        return 0, p.name


def _legacy_files(store_dir: str | os.PathLike) -> list[Path]:
    return [p for p in sorted(Path(store_dir).glob("records*.jsonl")) if ".superseded" not in p.name]


def _read_new_lines(path: Path, offsets: dict[Path, int]) -> list[dict]:
    """Whole rows appended to ``path`` since the last call (a line being written waits). Opened anew each time: on NFS,
    open is what shows other hosts' appends."""
    start = offsets.get(path, 0)
    try:
        with path.open("rb") as f:
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return []
    end = data.rfind(b"\n") + 1
    offsets[path] = start + end
    rows = []
    for line in data[:end].splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a crash, followed by a fresh one
            continue
    return rows


def _is_ok_record(r: dict) -> bool:
    return r.get("status", "ok") == "ok" and r.get("revision") is not None and "n_layers" in r


def store_group(store_dir: str | os.PathLike) -> str:
    """The store's W&B group: ``DIR/store.json``'s id, created exclusively by the first worker; the same on every host."""
    path = Path(store_dir) / "store.json"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            json.dump({"id": f"{Path(store_dir).resolve().name}-{uuid.uuid4().hex[:8]}"}, f)
    for _ in range(50):  # the first worker may be writing it right now
        try:
            return json.loads(path.read_text())["id"]
        except (json.JSONDecodeError, KeyError):
            time.sleep(0.1)
    raise ValueError(f"{path} is not a sinkwatch store id file: move it away")


def stage_config_of(records: Sequence[dict]) -> StageConfig:
    """The StageConfig the records were staged with (``stage_config``; the default before it was stored)."""
    configs = {json.dumps(r["stage_config"], sort_keys=True) for r in records if r.get("stage_config") is not None}
    if len(configs) > 1:
        msg = "sinkwatch: the store's records were staged with different StageConfigs; stages are re-derived with the default"
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    if len(configs) != 1:
        return StageConfig()
    return StageConfig(**json.loads(configs.pop()))


def failed_revisions(store_dir: str | os.PathLike) -> dict[str, str]:
    """revision -> error where the latest attempt failed at a commit with no successful record in the store: a moved branch
    whose new weights failed is listed (its old commit's record still drawn); a failure a later success (any worker's,
    any commit) followed is not."""
    offsets: dict[Path, int] = {}
    rows = write_order(r for path in record_files(store_dir) for r in _read_new_lines(path, offsets))
    latest = {r["revision"]: r for r in rows if r.get("revision") is not None and (r.get("status") == "failed" or _is_ok_record(r))}
    ok = {(r["revision"], r.get("commit")) for r in rows if _is_ok_record(r)}
    return {
        n: r.get("error", "") + limit_note(r) for n, r in latest.items() if r.get("status") == "failed" and (n, r.get("commit")) not in ok
    }


def limit_note(row: dict) -> str:
    """For a failed row an engine's limit ended twice in a row (``unit.over_limit``): how far it got, the limit to ask for."""
    lim = row.get("limit") or {}
    if lim.get("count", 0) < 2:
        return ""
    return (f" — over the limit: ended by it {lim['count']} times in a row, the last after {lim['after_s']:.0f} s in {lim['stage']}: "
            f"ask for {ask_min(lim)} min or more")  # fmt: skip


def ask_min(limit: dict) -> int:
    """The limit to ask for, in whole minutes: twice what the attempt had (how much more it needs is unknown)."""
    return max(1, math.ceil(2 * limit["after_s"] / 60))
