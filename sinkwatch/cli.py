"""The ``sinkwatch`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROBE_CHOICES = ("induction", "repeated", "natural")


def _probe_kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in PROBE_CHOICES]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"probe kinds are {', '.join(PROBE_CHOICES)} (comma-separated), got {text!r}")
    return kinds


def add_probe_arguments(p: argparse.ArgumentParser, default_n: int | None = None) -> None:
    """Probe options shared by ``probe`` and ``replay``."""
    p.add_argument("--probe", type=_probe_kinds, default=["induction"], help="probe kinds, comma-separated: induction, repeated, natural (default induction)")
    p.add_argument("--n", type=int, default=default_n, help="sequences per probe (default: induction 500, repeated 64, natural 100)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: induction 256, repeated 128 = 2L, natural 64)")
    p.add_argument("--vocab-range", type=int, nargs=2, metavar=("LO", "HI"), default=None, help="token-id range [LO, HI) of the induction/repeated probes (default [100, 10000) fitted to the vocabulary)")
    p.add_argument("--text", type=str, default=None, help="UTF-8 text file for the natural probe (tokenized with the model's tokenizer)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per probe forward (lower it to save memory)")


def probe_recipes(args, tokenizer_source: str | None):
    """Probe recipes from CLI arguments."""
    from .probes import InductionProbe, NaturalProbe, RepeatedRandomProbe

    recipes = []
    vr = tuple(args.vocab_range) if args.vocab_range else None
    for kind in args.probe:
        kw = {k: v for k, v in (("n", args.n), ("seq_len", args.seq_len)) if v is not None}
        if kind == "induction":
            recipes.append(InductionProbe(vocab_range=vr, **kw))
        elif kind == "repeated":
            recipes.append(RepeatedRandomProbe(vocab_range=vr, **kw))
        else:
            if not args.text:
                raise ValueError("the natural probe needs --text FILE (a UTF-8 text file tokenized with the model's tokenizer)")
            recipes.append(NaturalProbe(text_file=args.text, tokenizer=tokenizer_source, **kw))
    return recipes


def cmd_probe(args) -> int:
    from .loading import load_model
    from .monitor import Monitor, MonitorConfig
    from .reporting.console import summary

    model = load_model(args.model, revision=args.revision, dtype=args.dtype, device=args.device)
    monitor = Monitor(probe_recipes(args, args.model), config=MonitorConfig(batch_tokens=args.batch_tokens))
    snap = monitor.probe(model, revision=args.revision, model_name=args.model, track=False)
    record = snap.to_record()
    print(summary(record))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"record written to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sinkwatch", description="Watch attention sinks and induction heads form in a language model.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("probe", help="probe one model once and print/write its record")
    p.add_argument("model", help="hub id (e.g. EleutherAI/pythia-160m) or a local directory written by save_pretrained")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit), e.g. step3000")
    add_probe_arguments(p)
    p.add_argument("--out", default=None, help="write the record (JSON) here")
    p.set_defaults(func=cmd_probe)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        print(f"sinkwatch {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
