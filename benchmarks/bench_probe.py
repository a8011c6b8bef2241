"""Cost of a sinkwatch probe pass vs a plain forward vs eager attention with weights (SPEC §9, CPU).

Each measurement runs in its own process on a random model of a real shape — Pythia-160m (GPT-NeoX,
12 layers, 12 heads, d=768, vocab 50304) or SmolLM2-135M (Llama, 30 layers, d=576, GQA 9/3 heads,
vocab 49152), ``--shape`` picks; both by default, side by side: peak memory is the resident-set high-water mark above the loaded
model (Linux: VmHWM reset through /proc/self/clear_refs), time the median of ``--repeat`` runs.

    (a)  plain     model(ids) with sdpa, full logits (what a training step's forward does)
    (a') hidden    the same with logits_to_keep=1 (a forward without the (S x vocab) logits)
    (b)  probe     Monitor([NaturalProbe(...)]).probe(model): sink stats on every row + P0 norms
    (c)  eager     model(ids, output_attentions=True) with eager attention (what other tools do)

Usage: python benchmarks/bench_probe.py [--shape pythia-160m smollm2-135m] [--seq 512 1024 2048] [--batch 1] [--csv out.csv]
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
from common import proc_status_mib, reset_peak_rss, write_csv  # noqa: E402

MODES = ("plain", "hidden", "probe", "eager")


def pythia_160m_shaped(seq: int):
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        max_position_embeddings=max(2048, seq), rotary_pct=0.25, use_parallel_residual=True, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(cfg).eval()


def smollm2_135m_shaped(seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, max_position_embeddings=max(8192, seq), tie_word_embeddings=True, rope_theta=100000.0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


SHAPES = {"pythia-160m": (pythia_160m_shaped, 50304), "smollm2-135m": (smollm2_135m_shaped, 49152)}


def worker(mode: str, seq: int, batch: int, repeat: int, threads: int, shape: str = "pythia-160m") -> dict:
    import gc

    import torch

    torch.set_num_threads(threads)
    import sinkwatch as sw

    build, vocab = SHAPES[shape]
    model = build(seq)
    ids = torch.randint(100, 10000, (batch, seq), generator=torch.Generator().manual_seed(1))
    if mode == "eager":
        model.set_attn_implementation("eager")
    monitor = sw.Monitor([sw.NaturalProbe(tokens=ids, n=batch, seq_len=seq)], config=sw.MonitorConfig(batch_tokens=batch * seq))
    monitor.probe_sets(vocab)  # build the (fixed) probe set outside the timed region

    def run():
        with torch.no_grad():
            if mode == "plain":
                return model(input_ids=ids, use_cache=False).logits
            if mode == "hidden":
                return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
            if mode == "eager":
                return model(input_ids=ids, use_cache=False, output_attentions=True).attentions
            return monitor.probe(model)

    gc.collect()
    base = proc_status_mib("VmRSS")
    reset_peak_rss()
    t0 = time.perf_counter()
    out = run()
    first = time.perf_counter() - t0
    peak = proc_status_mib("VmHWM") - base
    del out
    gc.collect()
    times = [first]
    for _ in range(repeat - 1):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
        del out
    return {"shape": shape, "mode": mode, "seq": seq, "batch": batch, "time_s": statistics.median(times), "peak_mib": peak,
            "threads": threads}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["pythia-160m", "smollm2-135m"])
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--csv", default="benchmarks/results/bench_probe.csv")
    ap.add_argument("--worker", nargs=3, metavar=("MODE", "SEQ", "SHAPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.batch, args.repeat, args.threads, args.worker[2])))
        return

    table = []
    for shape in args.shape:
        table += measure_shape(shape, args)
    print(f"\nCSV: {write_csv(table, args.csv)}")


def measure_shape(shape: str, args) -> list[dict]:
    rows = []
    for seq in args.seq:
        for mode in MODES:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                mode,
                str(seq),
                shape,
                "--batch",
                str(args.batch),
                "--repeat",
                str(args.repeat),
                "--threads",
                str(args.threads),
            ]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"  measured {shape} {mode:6s} S={seq}: {rows[-1]['time_s']:.3f} s, {rows[-1]['peak_mib']:.0f} MiB", file=sys.stderr)

    print(f"\n{shape}-shaped model, batch {args.batch}, {args.threads} threads; memory = peak RSS above the loaded model\n")
    head = (
        f"{'S':>5} | {'plain s':>8} {'probe s':>8} {'eager s':>8} | "
        f"{'plain MiB':>9} {'hidden MiB':>10} {'probe MiB':>9} {'eager MiB':>9} | "
        f"{'probe/plain t':>13} {'probe/plain mem':>15} {'probe/hidden mem':>16} {'eager/probe mem':>15}"
    )
    print(head)
    print("-" * len(head))
    table = []
    for seq in args.seq:
        r = {row["mode"]: row for row in rows if row["seq"] == seq}
        line = {
            "shape": shape,
            "seq": seq,
            "plain_s": r["plain"]["time_s"],
            "hidden_s": r["hidden"]["time_s"],
            "probe_s": r["probe"]["time_s"],
            "eager_s": r["eager"]["time_s"],
            "plain_mib": r["plain"]["peak_mib"],
            "hidden_mib": r["hidden"]["peak_mib"],
            "probe_mib": r["probe"]["peak_mib"],
            "eager_mib": r["eager"]["peak_mib"],
        }
        line["probe_over_plain_time"] = line["probe_s"] / line["plain_s"]
        line["probe_over_plain_mem"] = line["probe_mib"] / line["plain_mib"]
        line["probe_over_hidden_mem"] = line["probe_mib"] / line["hidden_mib"]
        line["eager_over_probe_mem"] = line["eager_mib"] / line["probe_mib"]
        table.append(line)
        print(
            f"{seq:>5} | {line['plain_s']:8.3f} {line['probe_s']:8.3f} {line['eager_s']:8.3f} | "
            f"{line['plain_mib']:9.0f} {line['hidden_mib']:10.0f} {line['probe_mib']:9.0f} {line['eager_mib']:9.0f} | "
            f"{line['probe_over_plain_time']:13.2f} {line['probe_over_plain_mem']:15.2f} "
            f"{line['probe_over_hidden_mem']:16.2f} {line['eager_over_probe_mem']:15.1f}"
        )
    return table


if __name__ == "__main__":
    main()
