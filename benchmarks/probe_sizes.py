"""How small can the live probes be? The same weights probed at several probe sizes, side by side.

A live probe's cost is its tokens (``bench_real_overhead.py``: the probe is ~1.0x its own tokens'
forwards), so the live defaults (``sinkwatch.probes.LIVE_PROBES``) are a trade between cost and the
precision of what the stage rules read. This measures that trade on real data:

- ``--demo-seeds``: the demo's model and data (``sinkwatch.demo``: a byte-level Llama 3 x 128 on the
  standard library's source, batch 16, AdamW 2e-3), trained for ``--steps``; every ``--every`` steps the
  same weights are probed at each size of ``--sizes`` (the natural windows are one frozen set for all),
  and each size's records go through their own ``StageTracker()`` at the defaults. Per size: the step
  where induction is declared ``formed`` (and first met), every induction event, and per probe whether
  the state read by that probe alone (``induction_state_now``) equals the reference size's.
- ``--smollm2 DIR``: real SmolLM2-135M-Instruct weights, the paper's induction probe at n = 500 as the
  reference and its first n sequences (the same draws) at each size: the >= 50x and >= 30x induction
  head sets against n = 500's, the largest selectivity error on heads the reference puts at >= 10x, and
  the repeated-random probe's heads >= 0.3 and ICL score against its first 128 sequences.

    python benchmarks/probe_sizes.py [--demo-seeds 0 1] [--steps 2000] [--every 100]
        [--sizes 100x32 64x32 50x32 50x16] [--smollm2 DIR] [--out benchmarks/results/probe_sizes]

A size ``NxM``: N induction sequences, M repeated-random sequences (their lengths are the live ones);
the first size is the reference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402


def parse_size(text: str) -> tuple[int, int]:
    try:
        n_ind, n_rep = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is NxM (induction x repeated-random sequences), got {text!r}") from None
    return n_ind, n_rep


def monitors(sizes, *, context: int, vocab_size: int, vocab_range, natural):
    """One Monitor per size, every one with the same frozen natural windows (``natural``: a ProbeSet)."""
    from sinkwatch import InductionProbe, Monitor, RepeatedRandomProbe
    from sinkwatch.probes import LIVE_PROBES

    T_ind, T_rep = min(LIVE_PROBES["induction"][1], context), min(LIVE_PROBES["repeated"][1], context) // 2 * 2
    out = []
    for n_ind, n_rep in sizes:
        probes = [
            InductionProbe(n=n_ind, seq_len=T_ind, vocab_range=vocab_range),
            RepeatedRandomProbe(n=n_rep, seq_len=T_rep, vocab_range=vocab_range),
        ]
        out.append(Monitor([*probes, natural] if natural is not None else probes))
    return out


def head_set(record: dict, key: str, floor: float) -> set:
    values = np.nan_to_num(np.asarray(record[key]["induction"] if key == "selectivity" else record[key], dtype=float), nan=-np.inf)
    return {f"L{l}H{h}" for l, h in zip(*np.nonzero(values >= floor))}


def jaccard(a: set, b: set) -> float:
    return 1.0 if not a and not b else len(a & b) / len(a | b)


def demo_trajectory(seed: int, sizes, steps: int, every: int, batch: int = 16, lr: float = 2e-3) -> list[dict]:
    from sinkwatch import StageTracker
    from sinkwatch.demo import DEMO_CONTEXT, PRINTABLE, DemoWindows, build_model, stdlib_bytes
    from sinkwatch.probes import LIVE_PROBES, NaturalProbe

    torch.manual_seed(seed)
    corpus = stdlib_bytes()
    model = build_model(seed)
    n_nat, T_nat = LIVE_PROBES["natural"]
    natural = NaturalProbe(tokens=corpus, n=n_nat, seq_len=T_nat).build(256)
    mons = monitors(sizes, context=DEMO_CONTEXT, vocab_size=256, vocab_range=PRINTABLE, natural=natural)
    trackers = [StageTracker() for _ in sizes]
    data = torch.utils.data.DataLoader(DemoWindows(corpus, steps * batch + batch, seed=seed), batch_size=batch, shuffle=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    per_size = [{"events": [], "states": [], "declared": [], "seconds": 0.0} for _ in sizes]
    it = iter(data)
    for step in range(steps + 1):
        if step % every == 0:
            for mon, tracker, acc in zip(mons, trackers, per_size):
                t0 = time.perf_counter()
                snap = mon.probe(model, step=step, tokens=step * batch * DEMO_CONTEXT)
                acc["seconds"] += time.perf_counter() - t0
                events = tracker.track(snap)
                rec = snap.to_record()
                acc["states"].append(rec["induction_state_now"])
                acc["declared"].append(rec["induction_state"])
                acc["events"] += [e for e in events if e.timeline == "induction"]
            print(f"seed {seed} step {step}: " + " | ".join(f"{a['states'][-1]}" for a in per_size), flush=True)
        if step == steps:
            break
        model.train()
        ids = next(it)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    rows = []
    ref, ref_declared = per_size[0]["states"], per_size[0]["declared"]
    for (n_ind, n_rep), acc in zip(sizes, per_size):
        formed = next((e for e in acc["events"] if e.stage == "formed"), None)
        same = sum(a == b for a, b in zip(acc["states"], ref))
        same_declared = sum(a == b for a, b in zip(acc["declared"], ref_declared))
        rows.append({
            "part": f"demo seed {seed}", "size": f"{n_ind}x{n_rep}", "formed_step": formed and formed.step,
            "first_met_step": formed and formed.first_met_step,
            "events": " ".join(f"{e.previous}->{e.stage}@{e.step}" for e in acc["events"]) or "none",
            "same_state": f"{same}/{len(ref)}", "same_declared": f"{same_declared}/{len(ref)}", "probe_s": acc["seconds"] / len(ref),
        })  # fmt: skip
    return rows


def smollm2(model_dir: str, sizes, n_ref: int = 500, n_rep_ref: int = 128) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from sinkwatch import InductionProbe, Monitor, RepeatedRandomProbe
    from sinkwatch.capture import resolve_target
    from sinkwatch.probes import LIVE_PROBES

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    target = resolve_target(model)
    T_ind, T_rep = LIVE_PROBES["induction"][1], LIVE_PROBES["repeated"][1]
    full_ind = InductionProbe(n=n_ref, seq_len=T_ind).build(target.vocab_size)
    full_rep = RepeatedRandomProbe(n=n_rep_ref, seq_len=T_rep).build(target.vocab_size)
    ref_ind = Monitor([full_ind]).probe(model).to_record()
    ref_rep = Monitor([full_rep]).probe(model).to_record()
    sel_ref = np.asarray(ref_ind["selectivity"]["induction"], dtype=float)
    strong = sel_ref >= 10
    rows = []
    for n_ind, n_rep in sizes:
        t0 = time.perf_counter()
        rec = Monitor([full_ind.subset(n_ind)]).probe(model).to_record()
        rep = Monitor([full_rep.subset(n_rep)]).probe(model).to_record()
        sel = np.asarray(rec["selectivity"]["induction"], dtype=float)
        rows.append({
            "part": f"SmolLM2 (vs n = {n_ref} / {n_rep_ref})", "size": f"{n_ind}x{n_rep}", "probe_s": time.perf_counter() - t0,
            "ge50": f"{len(head_set(rec, 'selectivity', 50))} (ref {len(head_set(ref_ind, 'selectivity', 50))})",
            "ge50_jaccard": jaccard(head_set(rec, "selectivity", 50), head_set(ref_ind, "selectivity", 50)),
            "ge30_jaccard": jaccard(head_set(rec, "selectivity", 30), head_set(ref_ind, "selectivity", 30)),
            "sel_max_rel_err": float(np.nanmax(np.abs(sel[strong] / sel_ref[strong] - 1))) if strong.any() else None,
            "prefix_jaccard": jaccard(head_set(rep, "induction_score", 0.3), head_set(ref_rep, "induction_score", 0.3)),
            "icl": rep["icl_score"], "icl_ref": ref_rep["icl_score"],
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo-seeds", type=int, nargs="*", default=[0, 1])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[(100, 32), (64, 32), (50, 32), (50, 16)])
    p.add_argument("--smollm2", default=None, help="a save_pretrained folder of SmolLM2-135M-Instruct")
    p.add_argument("--out", default="benchmarks/results/probe_sizes", help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    rows = []
    for seed in args.demo_seeds:
        rows += demo_trajectory(seed, args.sizes, args.steps, args.every)
    if args.smollm2:
        rows += smollm2(args.smollm2, args.sizes)
    notes = [
        f"Demo rows: the demo's model and data, {args.steps} steps, a probe every {args.every} at every size on the same weights; "
        "each size's records through its own StageTracker() at the defaults; same state / declared: probes whose induction_state_now / "
        "declared induction_state equals the first size's.",
        "SmolLM2 rows: real SmolLM2-135M-Instruct weights (dequantised GGUF), float32; the induction probe's first n of 500 sequences, "
        "the repeated-random probe's first M of 128; head sets against the largest probe (Jaccard), "
        "the selectivity error on heads >= 10x there.",
    ]
    columns = {"part": "part", "size": "size (induction x repeated)", "formed_step": "formed at", "first_met_step": "first met",
               "events": "induction events", "same_state": "same state as ref", "same_declared": "same declared as ref",
               "probe_s": "probe, s", "ge50": ">= 50x heads", "ge50_jaccard": ">= 50x Jaccard", "ge30_jaccard": ">= 30x Jaccard",
               "sel_max_rel_err": "max rel. err (>= 10x heads)", "prefix_jaccard": "prefix >= 0.3 Jaccard", "icl": "ICL",
               "icl_ref": "ICL (ref)"}  # fmt: skip
    md, js = write_results(rows, args.out, title="sinkwatch live probe sizes: what the stage rules read at each size", columns=columns,
                           notes=notes, meta={"sizes": [f"{a}x{b}" for a, b in args.sizes]})  # fmt: skip
    print("wrote", md, js)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
