"""Helpers shared by the benchmark scripts: Linux peak-RSS measurement and CSV output."""

from __future__ import annotations

import csv
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


def write_csv(rows: list[dict], path: str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return out
