"""Local JSONL logs: ``records.jsonl`` (one SPEC §10 record per probe) and ``events.jsonl``.

Always on: whatever happens to W&B, this keeps everything. Lines are appended whole and flushed,
so a crash loses at most the line being written; readers skip a torn last line.
"""

from __future__ import annotations

import json
import os
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


class JSONLReporter(Reporter):
    name = "jsonl"

    def __init__(self, out_dir: str | os.PathLike):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.records = self.dir / "records.jsonl"
        self.events = self.dir / "events.jsonl"

    def log_record(self, record: dict[str, Any]) -> None:
        append_jsonl(self.records, record)

    def log_event(self, event: dict[str, Any]) -> None:
        append_jsonl(self.events, event)

    def log_error(self, step, message):
        append_jsonl(self.records, {"step": step, "error": message})

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

