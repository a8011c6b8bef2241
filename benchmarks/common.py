"""Helpers shared by the benchmark scripts: Linux peak-RSS measurement, the machine's load, and
results written with the exact command, versions and machine beside them (a CSV with a
``.meta.json``, or a markdown table with a JSON of every row)."""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import sys
from pathlib import Path


def proc_status_mib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM...) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"{field} not in /proc/self/status (these benchmarks measure memory on Linux)")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the next peak belongs to what follows."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (/proc/loadavg): how busy the machine was."""
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("sinkwatch", "torch", "transformers", "triton"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            continue
    return out


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    except OSError:
        model = platform.processor()
    return f"{model} ({os.cpu_count()} logical CPUs visible)"


def run_info(**extra) -> dict:
    """What a results file says about its run: the command as typed (from the repository root), the
    versions, the CPU, the torch thread count, the date and the load average now, and ``extra``."""
    import torch

    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return {
        "command": " ".join(["python", script, *sys.argv[1:]]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "versions": _versions(),
        "cpu": _cpu(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_end": load_average(),
        **extra,
    }


def load_line(first: list[float], cores: int | None = None, own: int | None = None) -> str:
    """One sentence on how busy the machine was, from 1-minute load averages sampled during a run.
    ``own``: the threads the benchmark itself keeps busy (default: torch's), whose load is not "other"."""
    import torch

    cores = cores or os.cpu_count() or 1
    own = own if own is not None else torch.get_num_threads()
    busy = max(first) > min(own, cores) + 0.75  # a 1-minute average lags: a margin for what ran just before
    state = "shared and loaded (other processes ran beside the benchmark)" if busy else f"quiet beyond the benchmark's own {own} threads"
    return f"Machine: {state}: 1-minute load average {min(first):.1f}-{max(first):.1f} on {cores} logical CPUs while it ran."


def write_csv(rows: list[dict], path: str, meta: dict | None = None) -> Path:
    """The rows as a CSV at ``path`` and, beside it, ``<stem>.meta.json`` (``run_info(**meta)``)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out.with_suffix(".meta.json").write_text(json.dumps(run_info(**(meta or {})), indent=1) + "\n")
    return out


def write_results(rows: list[dict], path: str, *, title: str, columns: dict[str, str], notes: list[str], meta: dict) -> tuple[Path, Path]:
    """``<path>.json`` (``run_info(**meta)`` and every row in full) and ``<path>.md``: the title, the
    run's facts, ``notes`` (one line each), then a table of ``columns`` (key -> header; floats to 3
    significant digits); and, as every benchmark writes them, ``<path>.csv`` and ``<path>.meta.json``."""
    info = run_info(**meta)
    stem = Path(path).with_suffix("")
    write_csv([{k: r.get(k) for k in sorted({k for row in rows for k in row})} for r in rows], str(stem.with_suffix(".csv")), meta)
    js = stem.with_suffix(".json")
    js.write_text(json.dumps({**info, "rows": rows}, indent=1) + "\n")
    v = info["versions"]
    lines = [
        f"# {title}",
        "",
        f"- Command: `{info['command']}`",
        f"- Date (UTC): {info['date_utc']}; torch {v.get('torch')}, transformers {v.get('transformers')}, python {v['python']}",
        f"- CPU: {info['cpu']}; torch threads: {info['torch_threads']}",
        *[f"- {n}" for n in notes],
        f"- Every number, per row: `{js.name}`",
        "",
        "| " + " | ".join(columns.values()) + " |",
        "|" + "---|" * len(columns),
    ]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k)) for k in columns) + " |")
    md = stem.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    return md, js


def _cell(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return "" if x is None else str(x)


def generated_block(doc_path: Path, name: str, block: str | None = None) -> str:
    """``doc_path``'s text with its block ``name`` (between ``<!-- NAME:start ... -->`` and ``<!-- NAME:end -->``)
    replaced by ``block``; ``block`` None: the block as it stands. ValueError without the markers."""
    doc = Path(doc_path).read_text()
    start, end = f"<!-- {name}:start", f"<!-- {name}:end -->"
    if start not in doc or end not in doc:
        raise ValueError(f"{doc_path} has no generated {name} block ({start} ... -->, {end})")
    before, rest = doc.split(start, 1)
    marker, rest = rest.split("-->", 1)
    current, after = rest.split(end, 1)
    if block is None:
        return current.strip("\n")
    return f"{before}{start}{marker}-->\n{block}\n{end}{after}"
