"""Cost of a sinkwatch probe pass vs a plain forward (CPU), on random models of real shapes.

Shapes (``--shape``): Pythia-160m (GPT-NeoX, 12 layers x 12 heads, d = 768, V = 50,304), SmolLM2-135M
(Llama, 30 layers, d = 576, GQA 9/3, V = 49,152), Qwen2.5-0.5B (Qwen2, 24 layers, d = 896, GQA 14/2,
V = 151,936). Modes, each ``model(ids)`` under no_grad, batch ``--batch``:

    plain   full logits (what a training step's forward computes)
    hidden  logits_to_keep=1 (a forward without the S x V logits: the probe's memory floor)
    probe   Monitor([NaturalProbe(...)]).probe(model): sink statistics on every row + P0 norms
    eager   output_attentions=True with eager attention (what other tools do; ``--eager``, S <= 2048)

Time: one process per (shape, S) runs the modes interleaved, ``--repeat`` rounds after a warm-up
round, the order rotating each round; reported: each mode's median time and the median over rounds
of probe / plain and probe / hidden measured in the same round (side by side, so a load change on a
shared machine hits both). Memory: one fresh process per (shape, S, mode), the resident-set
high-water mark above the live set (VmHWM reset through /proc/self/clear_refs) of the mode's second
run, and of its first (lazy imports, one-time checks) beside it.
The load average is sampled before and after each process and written with the results.

    python benchmarks/bench_probe.py [--shape ...] [--seq 512 2048 4096] [--repeat 5] [--threads 2] [--out benchmarks/results/bench_probe]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, load_line, proc_status_mib, reset_peak_rss, write_results  # noqa: E402

TIMED = ("plain", "hidden", "probe")


def pythia_160m_shaped(seq: int):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        max_position_embeddings=max(2048, seq), rotary_pct=0.25, use_parallel_residual=True, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPTNeoXForCausalLM(cfg)


def smollm2_135m_shaped(seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, max_position_embeddings=max(8192, seq), tie_word_embeddings=True, rope_theta=100000.0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def qwen2_05b_shaped(seq: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, max_position_embeddings=max(32768, seq), tie_word_embeddings=True, rope_theta=1000000.0,
        use_sliding_window=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg)


SHAPES = {"pythia-160m": pythia_160m_shaped, "smollm2-135m": smollm2_135m_shaped, "qwen2-0.5b": qwen2_05b_shaped}


def setup(shape: str, seq: int, batch: int, threads: int):
    """(model, ids, one forward per mode) for a worker process."""
    import torch

    import sinkwatch as sw

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = SHAPES[shape](seq).eval()
    ids = torch.randint(100, 10000, (batch, seq), generator=torch.Generator().manual_seed(1))
    monitor = sw.Monitor([sw.NaturalProbe(tokens=ids, n=batch, seq_len=seq)], config=sw.MonitorConfig(batch_tokens=batch * seq))
    monitor.probe_sets(model.config.vocab_size)  # the (fixed) probe set is built outside the timed region

    def forward(mode: str):
        with torch.no_grad():
            if mode == "plain":
                return model(input_ids=ids, use_cache=False).logits
            if mode == "hidden":
                return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
            if mode == "eager":
                return model(input_ids=ids, use_cache=False, output_attentions=True).attentions
            return monitor.probe(model)

    return model, forward


def time_worker(shape: str, seq: int, batch: int, repeat: int, threads: int, eager: bool) -> dict:
    load_before = load_average()
    model, forward = setup(shape, seq, batch, threads)
    modes = list(TIMED)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for m in modes:  # warm-up round: first-call allocations, lazy imports, thread pools
        forward(m)
    for r in range(repeat):
        for m in modes[r % len(modes) :] + modes[: r % len(modes)]:  # rotating order
            t0 = time.perf_counter()
            out = forward(m)
            times[m].append(time.perf_counter() - t0)
            del out
    row = {f"{m}_s": statistics.median(times[m]) for m in modes}
    row["probe_over_plain_time"] = statistics.median(p / q for p, q in zip(times["probe"], times["plain"]))
    row["probe_over_hidden_time"] = statistics.median(p / q for p, q in zip(times["probe"], times["hidden"]))
    row["probe_over_plain_time_min"] = min(p / q for p, q in zip(times["probe"], times["plain"]))
    row["probe_over_plain_time_max"] = max(p / q for p, q in zip(times["probe"], times["plain"]))
    if eager:
        model.set_attn_implementation("eager")
        forward("eager")
        t0 = time.perf_counter()
        forward("eager")
        row["eager_s"] = time.perf_counter() - t0
    row["load_before"], row["load_after"] = load_before[0], load_average()[0]
    return row


def memory_worker(mode: str, shape: str, seq: int, batch: int, threads: int) -> dict:
    """Peak resident memory above the live set of one forward, on its first run in the process and on
    its second (first-call costs gone: lazy imports, thread pools, kernels' one-time checks)."""
    import gc

    model, forward = setup(shape, seq, batch, threads)
    if mode == "eager":
        model.set_attn_implementation("eager")
    peaks = []
    for _ in range(2):
        gc.collect()
        base = proc_status_mib("VmRSS")
        reset_peak_rss()
        out = forward(mode)
        peaks.append(proc_status_mib("VmHWM") - base)
        del out
    return {"peak_mib": peaks[1], "first_peak_mib": peaks[0]}


# The memory workers' allocator: blocks of 64 KiB and more are mapped and unmapped (glibc), and freed
# memory goes back at once, so the resident set follows the live tensors and a second run's peak is
# its own (with the defaults, what a first run freed stays resident and hides the second's peak).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def run_worker(args, *worker: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", *worker, "--batch", str(args.batch), "--repeat", str(args.repeat)]
    cmd += ["--threads", str(args.threads)] + (["--eager"] if args.eager else [])
    env = {**os.environ, **(MALLOC_ENV if worker[0] == "memory" else {})}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


COLUMNS = {
    "shape": "shape", "seq": "S", "plain_s": "plain forward, s", "probe_s": "probe, s",
    "probe_over_plain_time": "probe / plain, time", "probe_over_plain_time_range": "(range over rounds)",
    "hidden_mib": "logits_to_keep=1, MiB", "probe_mib": "probe, MiB", "plain_mib": "plain, MiB",
    "probe_over_hidden_mem": "probe / logits_to_keep=1, memory", "probe_first_over_hidden_first_mem": "(first run in process)",
    "load": "load before -> after",
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5, help="timed rounds per (shape, S), after one warm-up round")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--eager", action="store_true", help="also eager attention with weights (S <= 2048: its S^2 weights per layer)")
    ap.add_argument("--out", default="benchmarks/results/bench_probe", help="writes OUT.md (the table) and OUT.json (every number)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "time":
            seq, shape = int(rest[0]), rest[1]
            out = time_worker(shape, seq, args.batch, args.repeat, args.threads, args.eager and seq <= 2048)
        else:
            mode, seq, shape = rest[0], int(rest[1]), rest[2]
            out = memory_worker(mode, shape, seq, args.batch, args.threads)
        print(json.dumps(out))
        return

    table, loads = [], [load_average()]
    for shape in args.shape:
        for seq in args.seq:
            row = {"shape": shape, "seq": seq, "batch": args.batch, "threads": args.threads, "rounds": args.repeat}
            row.update(run_worker(args, "time", str(seq), shape))
            for mode in TIMED + (("eager",) if args.eager and seq <= 2048 else ()):
                mem = run_worker(args, "memory", mode, str(seq), shape)
                row[f"{mode}_mib"], row[f"{mode}_first_mib"] = mem["peak_mib"], mem["first_peak_mib"]
            row["probe_over_hidden_mem"] = row["probe_mib"] / row["hidden_mib"]
            row["probe_first_over_hidden_first_mem"] = row["probe_first_mib"] / row["hidden_first_mib"]
            row["probe_over_plain_mem"] = row["probe_mib"] / row["plain_mib"]
            row["probe_over_plain_time_range"] = f"{row['probe_over_plain_time_min']:.2f}-{row['probe_over_plain_time_max']:.2f}"
            row["load"] = f"{row['load_before']:.1f} -> {row['load_after']:.1f}"
            loads.append(load_average())
            table.append(row)
            print(
                f"{shape:>13} S={seq:<5} time probe/plain {row['probe_over_plain_time']:.3f} ({row['probe_over_plain_time_range']}; "
                f"plain {row['plain_s']:.2f} s) | memory probe/hidden {row['probe_over_hidden_mem']:.2f} ({row['probe_mib']:.0f} / "
                f"{row['hidden_mib']:.0f} MiB; first run {row['probe_first_over_hidden_first_mem']:.2f}) | load {row['load']}",
                flush=True,
            )
    one_minute = [x[0] for x in loads] + [r[k] for r in table for k in ("load_before", "load_after")]
    notes = [
        f"Random weights of real shapes, batch {args.batch}, float32, {args.threads} torch threads, under no_grad.",
        "Time: per (shape, S) one process runs plain / logits_to_keep=1 / probe interleaved, one warm-up round then "
        f"{args.repeat} rounds in rotating order; the ratio is the median over rounds of probe / plain measured in the same round.",
        "Memory: a fresh process per (shape, S, mode); the resident-set peak above the live set of the mode's second run "
        "(glibc set to return freed memory at once); the first run's peak (lazy imports, one-time checks) in brackets.",
        load_line(one_minute, os.cpu_count()),
    ]
    md, js = write_results(
        table, args.out, title="sinkwatch probe cost vs a plain forward (CPU)", columns=COLUMNS, notes=notes,
        meta={"load_average_samples": loads},
    )  # fmt: skip
    print(f"\nwrote {md} and {js}")


if __name__ == "__main__":
    main()
