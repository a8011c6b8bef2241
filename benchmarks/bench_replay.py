"""Time and memory of replaying one revision with the paper's probe (2000 x 256, induction), on CPU,
and what prefetching the next revision saves when the network is slow.

Three measurements, each in its own process, on random GPT-NeoX models (weights do not change cost):

  time    a Pythia-160m-shaped model (12 x 768) with ``--n-time`` sequences of the paper's probe:
          seconds per sequence, extrapolated to 2000 sequences and, by forward FLOPs per token,
          to Pythia-1B (16 x 2048).
  memory  a Pythia-1B-shaped model in float32 (16 layers, d=2048, 8 heads, vocab 50304) probed
          with ``--n-memory`` sequences at the default batch_tokens=16384 (64 sequences per forward,
          the largest activation footprint a replay ever has): peak RSS of the whole process,
          model included, plus the arrays that grow with n, extrapolated to n=2000.
  prefetch  ``--revisions`` revisions of a small GPT-NeoX served by the stand-in hub on 127.0.0.1
          (tests/local_hub.py, the real huggingface_hub client) at a throttled bandwidth set so one
          revision's download takes about as long as its probe; the same replay timed twice, side by
          side: without prefetch (download, then probe, revision after revision) and with it (the
          next revision downloads while the current one is probed). Ideal ratio with download =
          probe: (1 + N) / 2N.

Usage: python benchmarks/bench_replay.py [--n-time 64] [--n-memory 64] [--revisions 4] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import proc_status_mib, write_csv  # noqa: E402

SHAPES = {
    "pythia-160m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "pythia-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192),
}


def flops_per_token(shape: dict, seq: int = 256) -> float:
    """Forward FLOPs per token: 2 x non-embedding params + attention scores/values + stats kernel."""
    d, L, ff = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    params = L * (4 * d * d + 2 * d * ff)
    return 2 * params + L * 3 * 2 * seq * d  # QK^T, PV, and the statistics' QK^T


def worker(shape_name: str, n: int, threads: int) -> dict:
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import sinkwatch as sw

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=50304,
        max_position_embeddings=2048,
        rotary_pct=0.25,
        use_parallel_residual=True,
        bos_token_id=0,
        eos_token_id=0,
        **SHAPES[shape_name],
    )
    model = GPTNeoXForCausalLM(cfg).eval()
    monitor = sw.Monitor([sw.InductionProbe(n=n, seq_len=256)])  # the paper's probe, first n sequences
    monitor.probe_sets(50304)
    loaded = proc_status_mib("VmRSS")
    t0 = time.perf_counter()
    snap = monitor.probe(model)
    seconds = time.perf_counter() - t0
    assert snap["n_induction_ge30"] >= 0
    return {
        "shape": shape_name,
        "n": n,
        "seconds": seconds,
        "rss_loaded_mib": loaded,
        "peak_rss_mib": proc_status_mib("VmHWM"),
        "params": sum(p.numel() for p in model.parameters()),
    }


def prefetch_worker(revisions: int, threads: int) -> dict:
    """Wall time of one replay from a throttled local hub, without and with prefetch (see the module doc)."""
    import os
    import tempfile
    import warnings

    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from local_hub import LocalHub, patched_endpoint

    import sinkwatch as sw
    from sinkwatch.replay import FetchConfig, replay

    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    cfg = GPTNeoXConfig(
        vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=1024,
        max_position_embeddings=512, rotary_pct=0.25, use_parallel_residual=True, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    probes = [sw.InductionProbe(n=32, seq_len=256, vocab_range=(100, 8000))]
    with tempfile.TemporaryDirectory() as tmp, LocalHub() as hub:
        names = [f"step{1000 * i}" for i in range(revisions)]
        for i, name in enumerate(names):
            torch.manual_seed(i)
            GPTNeoXForCausalLM(cfg).save_pretrained(f"{tmp}/{name}")
            hub.add_revision("bench/neox", name, Path(f"{tmp}/{name}"))
        size = os.path.getsize(f"{tmp}/{names[0]}/model.safetensors")
        with patched_endpoint(hub.endpoint):

            def timed(label: str, prefetch: bool) -> float:
                t0 = time.perf_counter()
                rows = replay(
                    "bench/neox", revisions=names, out_dir=f"{tmp}/{label}", probes=probes, cache_dir=f"{tmp}/cache-{label}",
                    progress=False, fetch=FetchConfig(prefetch=prefetch),
                )  # fmt: skip
                assert [r["status"] for r in rows] == ["ok"] * revisions, rows
                return time.perf_counter() - t0

            timed("warm", True)  # imports, kernels, the first model build: out of the comparison
            probe = statistics.median(r["revision_seconds"] for r in read_store(f"{tmp}/warm"))
            bandwidth = size / probe  # one revision's weights download in about one probe's time
            hub.throttle(bandwidth)
            without = timed("without", False)
            with_ = timed("with", True)
    return {
        "revisions": revisions,
        "weights_bytes": size,
        "probe_s": probe,
        "bandwidth_b_s": bandwidth,
        "without_s": without,
        "with_s": with_,
    }


def read_store(path: str) -> list[dict]:
    from sinkwatch.replay import record_files
    from sinkwatch.reporters.jsonl import read_jsonl

    return [r for p in record_files(path) for r in read_jsonl(p) if r.get("status") == "ok"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-time", type=int, default=64)
    ap.add_argument("--n-memory", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--revisions", type=int, default=4, help="revisions of the prefetch measurement")
    ap.add_argument("--csv", default="benchmarks/results/bench_replay.csv")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if args.worker[0] == "prefetch":
            print(json.dumps(prefetch_worker(int(args.worker[1]), args.threads)))
        else:
            print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.threads)))
        return

    def run(shape, n):
        res = subprocess.run(
            [sys.executable, __file__, "--worker", shape, str(n), "--threads", str(args.threads)],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(res.stdout.strip().splitlines()[-1])

    small = run("pythia-160m", args.n_time)
    per_seq = small["seconds"] / small["n"]
    t_small = per_seq * 2000
    t_1b = t_small * flops_per_token(SHAPES["pythia-1b"]) / flops_per_token(SHAPES["pythia-160m"])
    big = run("pythia-1b", args.n_memory)
    # arrays that grow with n (float32): P0 vectors (n, L, d), per-sequence ratios, gathered columns
    L, d = 16, 2048
    growth = lambda n: n * (L * d + L + L * 8 * 64 + L * 8 * 8) * 4 / 2**20  # noqa: E731
    peak_2000 = big["peak_rss_mib"] + growth(2000) - growth(big["n"])
    print(
        f"\ntime   Pythia-160m shape, {small['n']} sequences: {small['seconds']:.1f} s = {per_seq:.2f} s/sequence, {args.threads} threads"
    )
    print(
        f"       -> 2000 sequences: {t_small / 60:.1f} min per revision at 160m; "
        f"x{flops_per_token(SHAPES['pythia-1b']) / flops_per_token(SHAPES['pythia-160m']):.1f} FLOPs/token "
        f"-> ~{t_1b / 3600:.1f} h per Pythia-1B revision on this CPU"
    )
    print(
        f"memory Pythia-1B shape, float32 ({big['params'] / 1e9:.2f}B params), {big['n']} sequences: "
        f"loaded {big['rss_loaded_mib'] / 1024:.1f} GiB, peak {big['peak_rss_mib'] / 1024:.1f} GiB"
    )
    print(f"       -> 2000 sequences: peak ~{peak_2000 / 1024:.1f} GiB (limit 24 GiB)")
    pf = run("prefetch", args.revisions)
    ideal = (1 + pf["revisions"]) / (2 * pf["revisions"])
    print(
        f"prefetch {pf['revisions']} revisions of {pf['weights_bytes'] / 2**20:.1f} MiB from the local hub at "
        f"{pf['bandwidth_b_s'] / 2**20:.2f} MiB/s (download ~ probe {pf['probe_s']:.1f} s): without {pf['without_s']:.1f} s, "
        f"with {pf['with_s']:.1f} s -> x{pf['with_s'] / pf['without_s']:.2f} (ideal x{ideal:.2f})"
    )
    rows = [
        {
            "measure": "time",
            "shape": "pythia-160m",
            "n": small["n"],
            "seconds": small["seconds"],
            "peak_rss_mib": small["peak_rss_mib"],
            "extrapolated": f"{t_small:.0f}s@2000 (160m), {t_1b:.0f}s@2000 (1b)",
        },
        {
            "measure": "memory",
            "shape": "pythia-1b",
            "n": big["n"],
            "seconds": big["seconds"],
            "peak_rss_mib": big["peak_rss_mib"],
            "extrapolated": f"{peak_2000:.0f}MiB@2000",
        },
        {
            "measure": "prefetch",
            "shape": f"neox-4x256, {pf['revisions']} revisions",
            "n": 32,
            "seconds": pf["with_s"],
            "peak_rss_mib": "",
            "extrapolated": f"without {pf['without_s']:.1f}s, with {pf['with_s']:.1f}s, ratio {pf['with_s'] / pf['without_s']:.2f}",
        },
    ]
    print(f"CSV: {write_csv(rows, args.csv)}")


if __name__ == "__main__":
    main()
