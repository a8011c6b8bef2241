"""Registers, spills and shared memory of every autotune config of the Triton kernel, compiled for
real GPUs on this machine (no GPU needed: Triton ships ptxas). Writes a CSV and prints a summary.

What it answers without a device: does each config the autotuner may pick fit the target's shared
memory, and does any leave registers (spill) — the static half of the kernel's performance story.
Time on a GPU is ``bench_attention_stats.py``'s job.

Usage: python benchmarks/bench_kernel_resources.py [--arch 90 80] [--head-dims 64 128 256]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_csv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp32"])
    ap.add_argument("--csv", default="benchmarks/results/bench_kernel_resources.csv")
    args = ap.parse_args()
    from sinkwatch.kernels.triton_aot import Variant, compiler_env, survey

    if os.environ.get("TRITON_INTERPRET", "0") == "1":  # triton.jit must build compiled functions
        raise SystemExit(subprocess.call([sys.executable, *sys.argv], env=compiler_env()))

    variants = [Variant(dtype=t, head_dim=d) for t in args.dtypes for d in args.head_dims]
    rows = [r.as_row() for r in survey(args.arch, variants)]
    print(f"{'arch':>4} {'dtype':>5} {'D':>4} | configs  fit  spill-free | regs min-max | smem KiB max")
    for arch in args.arch:
        for v in variants:
            g = [r for r in rows if r["arch"] == arch and r["dtype"] == v.dtype and r["head_dim"] == v.head_dim]
            print(
                f"{arch:>4} {v.dtype:>5} {v.head_dim:>4} | {len(g):>7} {sum(r['fits'] for r in g):>4} "
                f"{sum(r['spill_bytes'] == 0 for r in g):>11} | {min(r['registers'] for r in g):>4}-{max(r['registers'] for r in g):<3}   "
                f"| {max(r['shared_bytes'] for r in g) / 1024:12.1f}"
            )
    print(f"CSV: {write_csv(rows, args.csv)}")


if __name__ == "__main__":
    main()
