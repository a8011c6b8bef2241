"""The repeated probe's peak memory vs the vocabulary: chunked head losses vs all-position logits.

Each case runs in a fresh process (VmHWM is per process): a random-init Llama of one shape
(d = 640, 4 blocks, 4 query heads of 256 over 1 kv head, MLP 2048: a Gemma-3-270M-like block) in
float32 with V = 32,000 or 262,144, then one repeated-random probe (n x 128 tokens, the CLI
default n = 64). "probe peak" is VmHWM minus the RSS just before the probe: what the probe itself
adds on top of the loaded model. ``chunked`` is sinkwatch's path (losses from the final hidden
states through the head in row chunks, capture/head.py); ``all-logits`` is what it did before:
``model(...).logits`` at every position, then cross-entropy over a float copy. ``estimate`` is what
the live pre-probe check (sinkwatch/probe/memory.py) would ask for on a GPU.

    python benchmarks/bench_probe_vocab.py [--csv benchmarks/results/probe_vocab.csv]

Bar: chunked peak at V = 262,144 <= chunked peak at V = 32,000 + 256 MiB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPE = dict(hidden_size=640, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=256, intermediate_size=2048)

CHILD = r"""
import json, sys
sys.path.insert(0, {here!r})
import torch, transformers as T
from common import proc_status_mib, reset_peak_rss
from sinkwatch import Monitor, RepeatedRandomProbe
from sinkwatch.capture import HFTarget
from sinkwatch.probe.memory import estimate

vocab, n, method = {vocab}, {n}, {method!r}
torch.manual_seed(0)
cfg = T.LlamaConfig(vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=True, **{shape!r})
model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
probe = RepeatedRandomProbe(n=n)
monitor = Monitor([probe])
sets = monitor.probe_sets(vocab)
ids = sets[0].tokens
reset_peak_rss()
before = proc_status_mib("VmRSS")
with torch.no_grad():
    if method == "chunked":
        record = monitor.probe(model).to_record()
        icl = record["icl_score"]
    else:  # what sinkwatch did before: every position's logits, a float copy, cross-entropy
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
        icl = float(loss[:, 64:].mean() - loss[:, :63].mean())
peak = proc_status_mib("VmHWM")
est, tokens, rows = estimate(HFTarget(model), sets, 16384)
print(json.dumps({{"before_mib": before, "peak_mib": peak, "probe_peak_mib": peak - before,
                   "estimate_mib": est.need(tokens, rows) / 2**20, "icl": icl}}))
"""


def run_case(vocab: int, n: int, method: str) -> dict:
    code = CHILD.format(here=str(HERE), vocab=vocab, n=n, method=method, shape=SHAPE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--csv", default="benchmarks/results/probe_vocab.csv")
    p.add_argument("--n", type=int, nargs="+", default=[16, 64])
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from common import write_csv

    rows = []
    for n in args.n:
        for vocab in (32_000, 262_144):
            for method in ("chunked", "all-logits"):
                if method == "all-logits" and vocab * n * 128 * 4 * 3 > 12 * 2**30:
                    need = vocab * n * 128 * 12 / 2**30
                    print(f"n={n} V={vocab} all-logits skipped: needs ~{need:.1f} GiB (this 24 GiB machine is shared)")
                    continue
                r = run_case(vocab, n, method)
                rows.append({"n": n, "vocab": vocab, "method": method, **{k: round(v, 4) for k, v in r.items()}})
                print(rows[-1], flush=True)
    by = {(r["n"], r["vocab"], r["method"]): r for r in rows}
    for n in args.n:
        small, large = by.get((n, 32_000, "chunked")), by.get((n, 262_144, "chunked"))
        if small and large:
            extra = large["probe_peak_mib"] - small["probe_peak_mib"]
            print(f"n={n}: chunked probe peak {small['probe_peak_mib']:.0f} MiB at V=32,000, {large['probe_peak_mib']:.0f} MiB at "
                  f"V=262,144 (+{extra:.0f} MiB; bar +256 MiB: {'ok' if extra <= 256 else 'FAILED'})")
        old = by.get((n, 32_000, "all-logits"))
        if old and small:
            print(f"n={n}: all-logits / chunked probe peak at V=32,000: {old['probe_peak_mib'] / max(1, small['probe_peak_mib']):.1f}x")
    print("wrote", write_csv(rows, args.csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
