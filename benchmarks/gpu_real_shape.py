"""GPU check on a real model's shape: a random-init SmolLM2-135M-shaped Llama (30 blocks,
d = 576, GQA 9/3, V = 49,152) in bfloat16 — no weights travel to the device — probed with the Triton
kernel and with the chunked PyTorch path, beside a forward with eager attention and weights
(what other tools do). Prints times side by side, the probes' agreement, and peak device memory.

    python benchmarks/gpu_real_shape.py [--n 64] [--seq-len 256] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_probe import smollm2_135m_shaped  # noqa: E402


def main(argv=None) -> int:
    import numpy as np
    import torch

    import sinkwatch as sw

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    model = smollm2_135m_shaped(args.seq_len).to("cuda", torch.bfloat16).eval()
    result = {"shape": "smollm2-135m", "dtype": "bfloat16", "n": args.n, "seq_len": args.seq_len}
    records = {}
    for backend in ("triton", "torch"):
        monitor = sw.Monitor([sw.InductionProbe(n=args.n, seq_len=args.seq_len), sw.RepeatedRandomProbe(n=args.n)],
                             config=sw.MonitorConfig(backend=backend))  # fmt: skip
        monitor.probe(model)  # warm-up: compile / autotune
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        records[backend] = monitor.probe(model).to_record()
        torch.cuda.synchronize()
        result[f"{backend}_s"] = time.perf_counter() - t0
        result[f"{backend}_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    ids = torch.randint(100, 10000, (args.n, args.seq_len), device="cuda")
    model.set_attn_implementation("eager")
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False, output_attentions=True, logits_to_keep=1)
    torch.cuda.synchronize()
    result["eager_weights_s"] = time.perf_counter() - t0
    result["eager_weights_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    a, b = (np.asarray(records[k]["selectivity"]["induction"], dtype=float) for k in ("triton", "torch"))
    result["induction_selectivity_max_rel_diff"] = float(np.nanmax(np.abs(a - b) / np.maximum(np.abs(b), 1e-6)))
    result["icl_diff"] = abs(records["triton"]["icl_score"] - records["torch"]["icl_score"])
    result["triton_over_torch_time"] = result["triton_s"] / result["torch_s"]
    result["eager_over_triton_time"] = result["eager_weights_s"] / result["triton_s"]
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
