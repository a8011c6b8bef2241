"""Live probe cost per data-parallel rank, and in bf16 vs float32 (docs/design.md §9), side by side in one run.

Part 1: W = 1, 2 and 4 gloo processes (torchrun), a 4-block Llama (d = 128), in two layouts: FSDP2
per block (every probe forward a collective) and DDP's (the bare module on every rank). Each rank
reports its probe wall time (median of ``--repeat`` probes), and its share of the work: probe
forwards, tokens through the model, CPU seconds. The goal (docs/design.md §9) is per-rank work ≈ 1/W of the
single process's: each rank runs its share of the sequences (``sinkwatch.probe.share``); the
ratio printed says where the code stands. Wall time is reported for W = 1 and 2 only: W = 4
processes on a small CPU share its cores, so only their work is comparable.

Part 2: one process, the same probe in float32 and under bf16 autocast (``compute_dtype``, what a
``bf16-mixed`` run now gets), median of ``--repeat``.

Usage: python benchmarks/bench_live_probe.py [--repeat 3] [--csv benchmarks/results/live_probe.csv]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import write_csv  # noqa: E402


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _probes():
    from sinkwatch import InductionProbe, RepeatedRandomProbe

    return [InductionProbe(n=32, seq_len=128, vocab_range=(2, 250)), RepeatedRandomProbe(n=16, seq_len=64, vocab_range=(2, 250))]


def _measure(model, repeat: int, *, wrapped=None, compute_dtype=None, out_dir: str) -> dict:
    """Median probe wall time and one probe's forwards / tokens / CPU seconds on this process."""
    from sinkwatch.live import LiveConfig, LiveMonitor

    options = {"every_n_steps": 1, "tokens_per_step": 1, "wandb": "disabled", "console": False, "preflight": False}
    live = LiveMonitor(LiveConfig(probes=_probes(), out_dir=out_dir, **options))
    live.setup(model, is_global_zero=_rank() == 0, wrapped=wrapped, world_size=_world(), compute_dtype=compute_dtype)
    counts = {"forwards": 0, "tokens": 0}

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        counts["forwards"] += 1
        counts["tokens"] += int(ids.numel()) if ids is not None else 0

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    walls, cpus = [], []
    for step in range(repeat + 1):  # step 0 warms up (first probe builds the probe sets)
        counts.update(forwards=0, tokens=0)
        t0, c0 = time.perf_counter(), time.process_time()
        live.step_end(step)
        if step:
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    hook.remove()
    live.finish()
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), **counts}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def worker(out: str, repeat: int, layout: str) -> None:
    """One torchrun rank of part 1."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = _model()
    if dist.get_world_size() > 1 and layout == "fsdp2":
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
    row = {"layout": layout, "W": dist.get_world_size(), "rank": dist.get_rank(), **_measure(model, repeat, out_dir=tempfile.mkdtemp())}
    Path(out, f"{layout}-w{row['W']}-rank{row['rank']}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def _launch(w: int, out: str, repeat: int, layout: str) -> None:
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(w), "--master_port", str(port), str(Path(__file__))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    subprocess.run([*cmd, "--worker", out, "--repeat", str(repeat), "--layout", layout], check=True, timeout=900, env=env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--csv", default=str(HERE / "results" / "live_probe.csv"))
    p.add_argument("--layouts", default="fsdp2,ddp", help="comma-separated: fsdp2, ddp")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layout", default="fsdp2", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.repeat, args.layout)
        return
    import torch

    out = tempfile.mkdtemp()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    for layout in layouts:
        for w in (1, 2, 4):
            _launch(w, out, args.repeat, layout)
    rows = [json.loads(f.read_text()) for f in sorted(Path(out).glob("*-w*-rank*.json"))]
    for r in rows:
        base = next(b for b in rows if b["W"] == 1 and b["layout"] == r["layout"])
        r["part"] = "per-rank"
        r["work_ratio_tokens"] = r["tokens"] / base["tokens"]
        r["work_ratio_cpu"] = r["cpu_s"] / base["cpu_s"]
        r["goal"] = 1 / r["W"]
        if r["W"] == 4:
            r["wall_s"] = None  # 4 processes on a small CPU share its cores: work, not wall time
    torch.set_num_threads(1)
    dtypes = {}
    for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
        dtypes[name] = _measure(_model(), args.repeat, compute_dtype=dtype, out_dir=tempfile.mkdtemp())
        rows.append({"part": "dtype", "W": 1, "rank": 0, "dtype": name, **dtypes[name]})
    path = write_csv([{k: r.get(k) for k in sorted({k for row in rows for k in row})} for r in rows], args.csv)
    print("per-rank probe work (W gloo processes; each rank probes its share of the sequences):")
    for r in rows:
        if r["part"] == "per-rank":
            wall = f"{r['wall_s']:.3f} s" if r["wall_s"] is not None else "  (n/a)"
            print(
                f"  {r['layout']:5s} W={r['W']} rank {r['rank']}: wall {wall}  forwards {r['forwards']}  tokens {r['tokens']}  "
                f"cpu {r['cpu_s']:.3f} s  "
                f"tokens ratio {r['work_ratio_tokens']:.2f} (goal {r['goal']:.2f})  cpu ratio {r['work_ratio_cpu']:.2f}"
            )
    ratio = dtypes["bfloat16"]["wall_s"] / dtypes["float32"]["wall_s"]
    print(f"probe wall time, one process: float32 {dtypes['float32']['wall_s']:.3f} s, bf16 autocast {dtypes['bfloat16']['wall_s']:.3f} s "
          f"(bf16 / float32 = {ratio:.2f}; a CPU has no fast bf16 matmul, a GPU does)")  # fmt: skip
    print(f"csv: {path}")


if __name__ == "__main__":
    main()
