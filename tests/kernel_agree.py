"""Data-parallel ranks agree on the statistics backend (tests/test_kernel_check.py): one torchrun launch.

    python -m torch.distributed.run --nproc_per_node 2 tests/kernel_agree.py OUT

Rank 0's Triton statistics kernel is deliberately corrupted (its ``first`` output shifted by 0.01);
rank 1's is not. Both probe a tiny Llama with ``backend="triton"`` (the interpreter on this CPU) and
their share of the sequences. Each rank writes ``rank{r}.json``: its record, why the kernel was given
up there, and its fallback warnings. A watchdog dumps every stack and exits on a hang.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch.distributed as dist  # noqa: E402

TIMEOUT_S = 240


def main(out: Path) -> None:
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank, size = dist.get_rank(), dist.get_world_size()
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import build

    import sinkwatch.kernels.api as api
    import sinkwatch.kernels.triton_stats as triton_stats
    from sinkwatch import InductionProbe, Monitor, MonitorConfig
    from sinkwatch.probe_share import ProbeShare

    if rank == 0:
        real = triton_stats.attention_stats_triton
        triton_stats.attention_stats_triton = lambda problem: (lambda s: s._replace(first=s.first + 0.01))(real(problem))
    share = ProbeShare(rank=rank, size=size, all_reduce=lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM))
    monitor = Monitor([InductionProbe(n=5, seq_len=64)], config=MonitorConfig(backend="triton"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = monitor.probe(build("llama"), share=share).to_record()
    result = {
        "record": {k: v for k, v in record.items() if k not in ("probe_seconds", "versions")},
        "failure": api.triton_failure(),
        "warnings": [str(w.message) for w in caught if "Triton attention-statistics kernel failed" in str(w.message)],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
