"""Replay's big-model paths on a real GPU, against the stand-in hub on 127.0.0.1.

Run by benchmarks/gpu_check.sh on a lent GPU machine; each check prints PASS/FAIL and the script
exits non-zero on any FAIL. What the CPU test suite can only decide, this runs for real:

1. loaded onto the GPU and freed between revisions: a paper-protocol replay of a float32 model; each
   revision's device peak (``device_peak_bytes``) stays that of the float32 probe alone (the float32
   model is freed before the float16 PR copy loads), and after the replay the CUDA caching allocator
   holds (almost) nothing: the cache was emptied between revisions;
2. the out-of-memory retry: the per-process memory fraction is set between the device peaks of a
   probe at batch_tokens B and at B/2, so the first attempt at B runs out of memory for real and the
   retry at B/2 fits (``oom_batch_tokens``);
3. a model split over GPUs (``device_map``): with 2+ GPUs, ``--max-memory`` below one model so it
   must be split; its numbers equal the single-GPU replay's. With one GPU: skipped, said so.

    python benchmarks/gpu_replay_check.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu_replay_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_replay_check: no CUDA device; nothing to check")
        return 0
    from local_hub import LocalHub, patched_endpoint
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import sinkwatch as sw
    from sinkwatch.replay import FetchConfig, record_files, replay
    from sinkwatch.reporters.jsonl import read_jsonl

    warnings.simplefilter("ignore")
    # ~160M parameters (0.64 GB in float32) and a small vocabulary, so weights, not logits, dominate the
    # device peak at batch_tokens 2048: a float32 model left alive during the float16 pass shows
    cfg = GPTNeoXConfig(
        vocab_size=4096, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, intermediate_size=4096,
        max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    probes = [sw.InductionProbe(n=64, seq_len=256, vocab_range=(100, 4000))]
    names = ["step1000", "step2000", "step3000"]
    with tempfile.TemporaryDirectory() as tmp, LocalHub() as hub:
        for i, name in enumerate(names):
            torch.manual_seed(i)
            GPTNeoXForCausalLM(cfg).save_pretrained(f"{tmp}/{name}")
            hub.add_revision("gpu/neox", name, Path(f"{tmp}/{name}"))
        fp32 = sum(p.numel() for p in GPTNeoXForCausalLM(cfg).parameters()) * 4
        with patched_endpoint(hub.endpoint):

            def run(label, **kw):
                kw = {"probes": probes, "progress": False, "fetch": FetchConfig(retries=1), **kw}
                rows = replay("gpu/neox", out_dir=f"{tmp}/{label}", cache_dir=f"{tmp}/cache-{label}", **kw)
                return rows, [r for p in record_files(f"{tmp}/{label}") for r in read_jsonl(p)]

            # 1. straight onto the GPU, float32 freed before the float16 PR pass, cache emptied between revisions
            plain, _ = run("plain", revisions=names, device="cuda:0", batch_tokens=2048)
            rows, _ = run("paper", revisions=names, protocol="paper", device="cuda:0", batch_tokens=2048, ablate=False)
            check(
                "replays",
                all(r["status"] == "ok" for r in plain + rows),
                str([r.get("error") for r in plain + rows if r["status"] != "ok"]),
            )
            peak_plain = max(r.get("device_peak_bytes") or 0 for r in plain)
            peaks = [r.get("device_peak_bytes") or 0 for r in rows]
            check(
                "float32 freed before the float16 PR pass",
                0 < max(peaks) < peak_plain + fp32 / 4,  # alive, the float32 model would add half its size to the float16 pass
                f"paper device peaks {[round(p / 2**30, 2) for p in peaks]} GiB; float32 alone {peak_plain / 2**30:.2f} GiB; "
                f"float16 weights {fp32 / 2**31:.2f} GiB",
            )
            reserved = torch.cuda.memory_reserved(0)
            check("device cache emptied", reserved < 64 * 2**20, f"{reserved / 2**20:.0f} MiB reserved after the replay")

            # 2. a real out-of-memory, retried at half batch_tokens
            big, half = 4096, 2048
            _, at_big = run("oom-big", revisions=names[:1], device="cuda:0", batch_tokens=big)
            _, at_half = run("oom-half", revisions=names[:1], device="cuda:0", batch_tokens=half)
            p_big, p_half = at_big[0]["device_peak_bytes"], at_half[0]["device_peak_bytes"]
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction((p_big + p_half) / 2 / total, 0)
            try:
                rows, _ = run("oom", revisions=names[:1], device="cuda:0", batch_tokens=big)
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, 0)
            r = rows[0]
            check(
                "out-of-memory retried at half batch_tokens",
                r["status"] == "ok" and r.get("oom_batch_tokens") == half,
                f"peaks {p_big / 2**20:.0f} / {p_half / 2**20:.0f} MiB at {big} / {half} tokens; row: {r.get('status')} "
                f"oom_batch_tokens={r.get('oom_batch_tokens')} {r.get('error', '')}",
            )
            same = np.allclose(
                np.asarray(r["selectivity"]["induction"], float), np.asarray(at_big[0]["selectivity"]["induction"], float), rtol=1e-4
            )
            check("the retried numbers equal the plain ones (rtol 1e-4)", r["status"] == "ok" and same, "")

            # 3. split over GPUs
            if torch.cuda.device_count() >= 2:
                single, _ = run("single", revisions=names[:1], device="cuda:0")
                from sinkwatch.models.placement import ModelShape

                shape = ModelShape.from_config(cfg)  # the placement's own estimate: one GPU too small, two enough
                budget = shape.activations("float32", 16384, 256) + int(0.7 * shape.weights["float32"])
                split, _ = run("split", revisions=names[:1], device="cuda", max_memory=budget)
                s = split[0]
                check("split over GPUs", s["status"] == "ok" and len(s.get("device_map", [])) >= 2, json.dumps(s.get("device_map")))
                if s["status"] == "ok":
                    a, b = np.asarray(s["selectivity"]["induction"], float), np.asarray(single[0]["selectivity"]["induction"], float)
                    check("split numbers equal one GPU's (rtol 1e-4)", np.allclose(a, b, rtol=1e-4), f"max diff {np.abs(a - b).max():.2e}")
            else:
                print("SKIP split over GPUs: one GPU visible (the placement decision is tested on CPU: tests/test_replay_cluster.py)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps([{"check": n, "ok": ok, "detail": d} for n, ok, d in RESULTS], indent=1))
    return 0 if all(ok for _, ok, _ in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
