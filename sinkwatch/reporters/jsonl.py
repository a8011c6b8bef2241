"""Local JSONL logs: ``records.jsonl`` (one docs/design.md §10 record per probe) and ``events.jsonl``.

Always on: whatever happens to W&B, this keeps everything. Lines are appended whole and flushed,
so a crash loses at most the line being written; readers skip a torn last line.

One store holds one run. A live monitor's reporter is built with ``new_run=True``: its first line
decides what the directory's existing files are. After ``resume`` (the run continues from a
checkpoint) they are this run's history, rewound to the checkpoint; otherwise they belong to an
earlier run started in the same ``out_dir`` and move, whole, to ``earlier-runs/<time>/`` (itself a
store ``sinkwatch report`` reads), with a warning that says where.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .base import Reporter


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All complete lines of a JSONL file (a torn last line from a crash is skipped)."""
    return list(iter_jsonl(path))


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    p = Path(path)
    if not p.exists():
        return
    with p.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def append_jsonl(path: Path, obj: dict) -> None:
    """Append one whole line; after a torn last line (a crash mid-write) start a fresh line first."""
    line = json.dumps(obj, allow_nan=False) + "\n"
    with path.open("ab+") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line
        f.write(line.encode())
        f.flush()


PROBES_FILE = "probes.json"  # the run's probe sets and natural windows (what `sinkwatch replay DIR --live-store` reads)
STORE_FILES = ("records.jsonl", "events.jsonl", "records.superseded.jsonl", "events.superseded.jsonl", PROBES_FILE)
EARLIER_RUNS = "earlier-runs"  # where a new run moves the store of an earlier one


class JSONLReporter(Reporter):
    """``records.jsonl`` and ``events.jsonl`` in ``out_dir``.

    ``new_run``: the first line written starts a new store unless ``resume`` was called first, so
    an earlier run's files are moved aside (``move_aside``) instead of being appended to. False:
    always append (a reporter a user adds next to the monitor's own).
    """

    name = "jsonl"

    def __init__(self, out_dir: str | os.PathLike, *, new_run: bool = False):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.records = self.dir / "records.jsonl"
        self.events = self.dir / "events.jsonl"
        self._undecided = new_run  # fresh start or resume: settled by ``resume`` or by the first write

    def log_record(self, record: dict[str, Any]) -> None:
        self._start()
        append_jsonl(self.records, record)

    def log_event(self, event: dict[str, Any]) -> None:
        self._start()
        append_jsonl(self.events, event)

    def log_error(self, step, message):
        self._start()
        append_jsonl(self.records, {"step": step, "error": message})

    def write_probes(self, probes: dict[str, Any]) -> None:
        """``probes.json``: this run's probe sets, written whole (by rename) once the store is settled,
        so a fresh start first moves an earlier run's file aside with that run's records."""
        self._start()
        path = self.dir / PROBES_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(probes))
        os.replace(tmp, path)

    def resume(self, last_step: int | None) -> int:
        """The run continues from a checkpoint whose last probe was at ``last_step``: keep the store
        (it is this run's), rewound to that step (``rewind``). Returns how many lines were moved."""
        self._undecided = False
        return self.rewind(last_step)

    def _start(self) -> None:
        if not self._undecided:
            return
        self._undecided = False
        moved = self.move_aside()
        if moved is not None:
            warnings.warn(
                f"sinkwatch: {self.dir} held the records of an earlier run; this run starts fresh (it did not resume from a "
                f"checkpoint with sinkwatch state), so they were moved to {moved} (one store per run; `sinkwatch report {moved}` "
                "still reads them). Give each run its own out_dir to keep them side by side.",
                RuntimeWarning,
                stacklevel=4,
            )

    def move_aside(self) -> Path | None:
        """Move the store's non-empty files to ``earlier-runs/<YYYYmmdd-HHMMSS>/`` (the time of their
        last write, a suffix if taken); returns that folder, or None when there was nothing to move."""
        present = [self.dir / name for name in STORE_FILES if (self.dir / name).is_file() and (self.dir / name).stat().st_size > 0]
        if not present:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.stat().st_mtime for p in present)))
        dest = self.dir / EARLIER_RUNS / stamp
        n = 1
        while dest.exists():
            n += 1
            dest = self.dir / EARLIER_RUNS / f"{stamp}-{n}"
        dest.mkdir(parents=True)
        for p in present:
            os.replace(p, dest / p.name)
        return dest

    def rewind(self, last_step: int | None) -> int:
        """On resume: move lines after ``last_step`` (a rolled-back timeline) to ``*.superseded.jsonl``;
        ``last_step`` None (the checkpoint predates the first probe): every line with a step.

        Nothing is deleted; returns how many lines were moved.
        """
        moved = 0
        for path in (self.records, self.events):
            keep, later = [], []
            for r in read_jsonl(path):
                step = r.get("step")
                (later if step is not None and (last_step is None or step > last_step) else keep).append(r)
            if not later:
                continue
            superseded = path.with_name(path.stem + ".superseded.jsonl")
            for r in later:
                append_jsonl(superseded, r)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in keep))
            os.replace(tmp, path)
            moved += len(later)
        return moved
