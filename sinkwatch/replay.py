"""Replay published training checkpoints (SPEC §8): one record per revision, resumable, shardable.

    sinkwatch replay pythia-1b                      # a packaged recipe (or recipes/pythia-1b.yaml)
    sinkwatch replay EleutherAI/pythia-410m --log-spaced 8 --out runs/pythia-410m

Each revision is loaded with ``from_pretrained(model, revision=...)`` — the real hub, or a local
Hugging Face cache when ``HF_HUB_OFFLINE=1`` — probed with the same ``Monitor`` as a live run, and
written as one record to ``DIR/records.jsonl`` (``records.shard-K-of-N.jsonl`` when sharded). A
record is appended only once complete; a rerun skips revisions already done; a revision that fails
is recorded with its reason and the others go on.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import yaml

from . import metrics
from .loading import HubUnreachableError, _is_network_error, hub_offline, load_model
from .monitor import PAPER_PR_SEQUENCES, PROTOCOLS, Monitor, MonitorConfig
from .probes import InductionProbe, NaturalProbe, ProbeSet, RepeatedRandomProbe
from .records import jsonable
from .reporting.jsonl import append_jsonl, read_jsonl
from .stages import StageTracker

_STEP = re.compile(r"step(\d+)")
_TOKENS = re.compile(r"tokens(\d+(?:\.\d+)?)([KMBT])", re.IGNORECASE)
_UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


# ---- recipes -------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What to replay: a hub model, its revisions (or how many log-spaced ones), dtype and probes."""

    model: str
    name: str = ""
    revisions: tuple[str, ...] | None = None
    log_spaced: int | None = None
    dtype: str = "float32"
    probes: dict = field(default_factory=lambda: {"induction": {"n": 2000, "seq_len": 256, "seed": 42}})
    tokens_per_step: int | None = None
    reference: str | None = None  # key of the paper's figures (sinkwatch/data/xu2026_developmental.json)
    batch_tokens: int = 16384
    layers: int | None = None
    heads_per_layer: int | None = None
    protocol: str = "sinkwatch"  # the packaged recipes say "paper" (SPEC §8)
    ablation_revision: str | None = None  # where the paper ran its group ablation (Pythia step143000, OLMo/OLMoE main)

    def __post_init__(self) -> None:
        if self.revisions is not None and self.log_spaced is not None:
            raise ValueError("give revisions or log_spaced, not both")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"recipe protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        unknown = set(self.probes) - {"induction", "repeated", "natural"}
        if unknown:
            raise ValueError(f"unknown probe kinds in recipe: {sorted(unknown)}")

    def probe_recipes(self, text_tokenizer=None) -> list:
        out = []
        for kind, kw in self.probes.items():
            kw = dict(kw or {})
            if "vocab_range" in kw and kw["vocab_range"] is not None:
                kw["vocab_range"] = tuple(kw["vocab_range"])
            if kind == "induction":
                out.append(InductionProbe(**kw))
            elif kind == "repeated":
                out.append(RepeatedRandomProbe(**kw))
            else:
                out.append(NaturalProbe(tokenizer=kw.pop("tokenizer", text_tokenizer or self.model), **kw))
        return out


def packaged_recipes() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("sinkwatch.recipes").iterdir() if p.name.endswith(".yaml"))


def load_recipe(spec: str) -> Recipe:
    """A recipe from a YAML path or a packaged recipe name (``pythia-1b``)."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") and path.exists():
        text = path.read_text()
    elif spec in packaged_recipes():
        text = resources.files("sinkwatch.recipes").joinpath(f"{spec}.yaml").read_text()
    else:
        raise FileNotFoundError(f"no recipe {spec!r}: give a .yaml path or one of {packaged_recipes()}")
    data = yaml.safe_load(text) or {}
    if "revisions" in data and data["revisions"] is not None:
        data["revisions"] = tuple(str(r) for r in data["revisions"])
    allowed = set(Recipe.__dataclass_fields__)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"recipe {spec}: unknown keys {unknown}; valid: {sorted(allowed)}")
    return Recipe(**data)


def is_recipe(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or spec in packaged_recipes()


# ---- revisions -----------------------------------------------------------------------------------------
def revision_step(name: str) -> int | None:
    m = _STEP.search(name)
    return int(m.group(1)) if m else None


def revision_tokens(name: str, tokens_per_step: int | None = None) -> int | None:
    """Tokens seen at a revision: from its name (``...-tokens23B``), else step x tokens_per_step."""
    m = _TOKENS.search(name)
    if m:
        return int(round(float(m.group(1)) * _UNITS[m.group(2).upper()]))
    step = revision_step(name)
    if step is not None and tokens_per_step:
        return step * tokens_per_step
    return None


def training_order(revisions: Sequence[str]) -> list[str]:
    """Revisions sorted by step (names without a step go last, in their given order)."""
    with_step = [r for r in revisions if revision_step(r) is not None]
    without = [r for r in revisions if revision_step(r) is None]
    return sorted(with_step, key=revision_step) + without


def select_log_spaced(revisions: Sequence[str], count: int) -> list[str]:
    """About ``count`` revisions whose steps are closest to log-spaced targets (first and last kept)."""
    ordered = [r for r in training_order(revisions) if revision_step(r) is not None]
    if len(ordered) <= count:
        return ordered
    steps = np.array([max(revision_step(r), 1) for r in ordered], dtype=float)
    targets = np.geomspace(steps[0], steps[-1], num=count)
    picked = {int(np.argmin(np.abs(np.log(steps) - np.log(t)))) for t in targets}
    return [ordered[i] for i in sorted(picked)]


def list_revisions(model: str, *, cache_dir: str | None = None) -> list[str]:
    """Branch names of a hub model via ``huggingface_hub.list_repo_refs`` (never computed).

    Offline (``HF_HUB_OFFLINE=1``), the refs of the local cache are listed instead.
    """
    import huggingface_hub

    if not hub_offline():
        try:
            refs = huggingface_hub.list_repo_refs(model)
            return [b.name for b in refs.branches]
        except Exception as exc:  # noqa: BLE001 - classified: network problems get advice
            if _is_network_error(exc):
                raise HubUnreachableError(_offline_advice(model)) from exc
            raise
    refs = _cache_repo_dir(model, cache_dir) / "refs"
    if not refs.is_dir():
        raise HubUnreachableError(_offline_advice(model))
    return sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file())


def _cache_repo_dir(model: str, cache_dir: str | None) -> Path:
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(cache_dir or HF_HUB_CACHE) / ("models--" + model.replace("/", "--"))


def _offline_advice(model: str) -> str:
    return (
        f"cannot reach the Hugging Face hub to list or download {model}'s revisions. Replay from a local cache "
        "instead: on a machine with network run `hf download MODEL --revision REV` for each revision "
        "(or copy an existing HF cache), then set HF_HUB_OFFLINE=1 and HF_HOME (or pass --cache-dir) to point at it"
    )


def check_hub(model: str) -> None:
    """Fail fast with advice when the hub cannot be reached and replay is not explicitly offline."""
    if hub_offline() or os.path.isdir(model):
        return
    import huggingface_hub

    try:
        huggingface_hub.model_info(model, timeout=10)
    except Exception as exc:  # noqa: BLE001
        if _is_network_error(exc):
            raise HubUnreachableError(_offline_advice(model)) from exc


# ---- the store -------------------------------------------------------------------------------------------
def shard_from_env() -> tuple[int, int]:
    """(K, N) from torchrun / accelerate launch (RANK, WORLD_SIZE), else (0, 1)."""
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)) or 0)
    world = int(os.environ.get("WORLD_SIZE", 1) or 1)
    return rank, max(world, 1)


def parse_shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"--shard must be K/N with 0 <= K < N, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def replay_key(model: str, dtype: str, protocol: str, probes: Sequence) -> dict:
    """What makes two replays of a revision the same measurement: the model, its dtype, the protocol
    and the probe sets (each probe recipe's parameters, or a ready probe set's content hash; with the
    model fixed, these determine the probe hashes)."""
    return {"model": model, "dtype": dtype, "protocol": protocol, "probes": {p.kind: _probe_spec(p) for p in probes}}


def _probe_spec(probe) -> dict | str:
    if isinstance(probe, ProbeSet):
        return probe.hash
    spec = {}
    for f in dataclasses.fields(probe):
        v = getattr(probe, f.name)
        try:
            json.dumps(v)
        except TypeError:  # token tensors, tokenizer objects: their content, hashed
            v = hashlib.sha256(repr(v.tolist() if hasattr(v, "tolist") else v).encode()).hexdigest()[:16]
        spec[f.name] = list(v) if isinstance(v, tuple) else v
    return spec


def key_of(record: dict) -> dict:
    """The replay key a stored record was made with; records from before keys were stored lack one
    (their protocol was sinkwatch's; what probes they used is unknown)."""
    if "replay_key" in record:
        return record["replay_key"]
    return {
        "model": record.get("model"),
        "dtype": record.get("dtype"),
        "protocol": record.get("protocol", "sinkwatch"),
        "probes": "unrecorded",
    }


def key_difference(stored: dict, wanted: dict) -> list[str]:
    """Human-readable differences between two replay keys ("dtype: float32 -> float16")."""
    out = []
    for k in ("model", "dtype", "protocol"):
        if stored.get(k) != wanted.get(k):
            out.append(f"{k}: {stored.get(k)} -> {wanted.get(k)}")
    a, b = stored.get("probes"), wanted.get("probes")
    if a != b:
        if not isinstance(a, dict) or not isinstance(b, dict):
            out.append(f"probes: {a} -> {b}")
        else:
            for kind in sorted(set(a) | set(b)):
                pa, pb = a.get(kind), b.get(kind)
                if pa == pb:
                    continue
                if isinstance(pa, dict) and isinstance(pb, dict):
                    out += [f"{kind} probe {f}: {pa.get(f)} -> {pb.get(f)}" for f in sorted(set(pa) | set(pb)) if pa.get(f) != pb.get(f)]
                else:
                    out.append(f"{kind} probe: {pa or 'absent'} -> {pb or 'absent'}")
    return out


class StoreMismatchError(ValueError):
    """A store holds records made another way than the replay asked for."""


class ReplayStore:
    """``DIR/records.jsonl`` (or one shard's file). A record is appended only when complete; a line
    torn by a crash is skipped when reading, so that revision is simply done again.

    A revision is done only when its record was made with the same replay key (model, dtype,
    protocol, probes). A store holding records made another way is refused with an error naming
    the difference — one store, one measurement — rather than mixing two protocols in one report.
    """

    def __init__(self, out_dir: str | os.PathLike, shard: tuple[int, int] = (0, 1)):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        k, n = shard
        self.path = self.dir / ("records.jsonl" if n == 1 else f"records.shard-{k}-of-{n}.jsonl")

    def rows(self) -> list[dict]:
        return read_jsonl(self.path)

    def done(self, key: dict | None = None) -> set[str]:
        """Revisions with a successful record (made with ``key``, when given)."""
        return {
            r["revision"] for r in self.rows() if r.get("status", "ok") == "ok" and "revision" in r and (key is None or key_of(r) == key)
        }

    def check(self, key: dict) -> None:
        """Refuse (StoreMismatchError) when any successful record of this store's directory — every
        shard — was made with another replay key."""
        for path in sorted(self.dir.glob("records*.jsonl")):
            if ".superseded" in path.name:  # set aside on purpose: not part of the store
                continue
            for r in read_jsonl(path):
                if r.get("status", "ok") != "ok" or "n_layers" not in r:
                    continue
                diff = key_difference(key_of(r), key)
                if diff:
                    raise StoreMismatchError(
                        f"{self.dir} already holds records made another way ({'; '.join(diff)}; first: {r.get('revision')}). "
                        "Its numbers would be reported as this replay's: replay into another --out, "
                        "or move its records*.jsonl away to redo them"
                    )

    def append(self, row: dict) -> None:
        append_jsonl(self.path, row)


def merged_records(store_dir: str | os.PathLike) -> list[dict]:
    """All successful records of a store (every shard), one per revision (the latest), in training
    order, with ``p0_stage``/``induction_state`` re-derived over the merged sequence."""
    d = Path(store_dir)
    latest: dict[str, dict] = {}
    for path in sorted(d.glob("records*.jsonl")):
        if ".superseded" in path.name:
            continue
        for r in read_jsonl(path):
            if r.get("status", "ok") == "ok" and r.get("revision") is not None and "n_layers" in r:
                latest[r["revision"]] = r
    if not latest:
        # a live run's store: records keyed by step
        rows = [r for r in read_jsonl(d / "records.jsonl") if "n_layers" in r]
        return sorted(rows, key=lambda r: (r.get("step") is None, r.get("step") or 0))
    records = [latest[r] for r in training_order(list(latest))]
    tracker = StageTracker()
    for r in records:
        tracker.update(r)
    return records


def failed_revisions(store_dir: str | os.PathLike) -> dict[str, str]:
    """revision -> error of revisions whose latest attempt failed."""
    status: dict[str, dict] = {}
    for path in sorted(Path(store_dir).glob("records*.jsonl")):
        for r in read_jsonl(path):
            if r.get("revision") is not None:
                status[r["revision"]] = r
    return {rev: r.get("error", "") for rev, r in status.items() if r.get("status") == "failed"}


# ---- replay ------------------------------------------------------------------------------------------------
def replay(
    model: str | Recipe,
    *,
    revisions: Sequence[str] | None = None,
    log_spaced: int | None = None,
    out_dir: str | os.PathLike = "runs/replay",
    probes: Sequence | None = None,
    dtype: str | None = None,
    device: str | None = None,
    shard: tuple[int, int] | None = None,
    cache_dir: str | None = None,
    tokens_per_step: int | None = None,
    batch_tokens: int | None = None,
    wandb: str = "disabled",
    progress: bool = True,
    monitor_config: MonitorConfig | None = None,
    protocol: str | None = None,
    ablate: bool | None = None,
    ablation_revision: str | None = None,
) -> list[dict]:
    """Replay revisions of a hub model (or a ``Recipe``); returns this shard's rows (ok and failed).

    Revisions come from the recipe, ``revisions``, or ``list_repo_refs`` (+ ``log_spaced``). They
    are replayed in training order; shard K of N takes every N-th one (from RANK/WORLD_SIZE under
    torchrun or accelerate launch, or given).

    ``protocol``: "paper" reproduces Xu 2026's precision choices (SPEC §8: float16 models probed
    through eager float16 attention, PR from a float16 pass over the first 500 sequences), "sinkwatch"
    keeps float32 statistics and PR over every sequence; default: the recipe's. A store that holds
    records made with another protocol, dtype, model or probe set is refused (``StoreMismatchError``).

    ``ablate``: after the revisions, run the group ablation of the >= 50x induction circuit at
    ``ablation_revision`` (default: the recipe's; without one, the last revision) and write it to
    ``DIR/ablation.json`` (``run_ablation``). Default: on under protocol "paper" when the recipe names
    an ablation revision (the packaged recipes do), else off. Only shard 0 runs it.
    """
    recipe = model if isinstance(model, Recipe) else Recipe(model=model)
    revs = list(revisions) if revisions is not None else (list(recipe.revisions) if recipe.revisions else None)
    log_spaced = log_spaced or recipe.log_spaced
    check_hub(recipe.model)
    if revs is None:
        revs = list_revisions(recipe.model, cache_dir=cache_dir)
        if log_spaced:
            revs = select_log_spaced(revs, log_spaced)
    elif log_spaced:
        revs = select_log_spaced(revs, log_spaced)
    if not revs:
        raise ValueError(f"no revisions to replay for {recipe.model}")
    ordered = training_order(revs)
    k, n = shard or shard_from_env()
    mine = ordered[k::n]
    store = ReplayStore(out_dir, (k, n))
    tps = tokens_per_step or recipe.tokens_per_step
    cfg = monitor_config or MonitorConfig(batch_tokens=batch_tokens or recipe.batch_tokens)
    protocol = protocol or (cfg.protocol if monitor_config is not None else recipe.protocol)
    cfg = dataclasses.replace(cfg, protocol=protocol)
    probe_list = list(probes) if probes is not None else recipe.probe_recipes()
    dtype = dtype or recipe.dtype
    key = replay_key(recipe.model, dtype, protocol, probe_list)
    store.check(key)
    ablation_rev = ablation_revision or recipe.ablation_revision
    if ablate is None:
        ablate = protocol == "paper" and ablation_rev is not None
    ablate = bool(ablate) and k == 0
    if ablate:
        ablation_rev = ablation_rev or ordered[-1]
        check_ablation(out_dir, ablation_key(key, ablation_rev))  # refused before anything is probed
    done = store.done(key)
    pr_monitor = None
    if protocol == "paper" and cfg.participation_ratio and any(p.kind == "induction" for p in probe_list):
        # the paper's PR ran separately (its per-head scripts): float16, default attention, first 500 sequences
        pr_probes = [_first(p, PAPER_PR_SEQUENCES) for p in probe_list if p.kind == "induction"]
        pr_monitor = Monitor(pr_probes, config=cfg)
        cfg = dataclasses.replace(cfg, participation_ratio=False)
    monitor = Monitor(probe_list, config=cfg)
    reporter = _replay_wandb(wandb, out_dir, recipe)
    rows = []
    bar = _progress(mine, progress, recipe.model)
    for rev in bar:
        step, tokens = revision_step(rev), revision_tokens(rev, tps)
        if rev in done:
            _status(bar, rev, "done already")
            continue
        row = _replay_one(monitor, store, recipe, rev, step, tokens, dtype, device, cache_dir, bar, key=key, pr_monitor=pr_monitor)
        rows.append(row)
        if reporter is not None and row.get("status", "ok") == "ok":
            try:
                reporter.log_record(row)
            except Exception as exc:  # noqa: BLE001 - logging never stops a replay
                warnings.warn(f"sinkwatch replay: W&B logging failed ({exc}); records are in {store.path}", RuntimeWarning, stacklevel=2)
                reporter = None
    if reporter is not None:
        reporter.finish()
    if ablate:
        run_ablation(monitor, recipe, ablation_rev, out_dir=out_dir, key=key, dtype=dtype, device=device, cache_dir=cache_dir, bar=bar)
    return rows


def _first(probe, n: int):
    """The first ``n`` sequences of a probe (the induction probe draws sequentially: SPEC §3)."""
    if isinstance(probe, ProbeSet):
        return probe.subset(min(n, probe.n))
    return dataclasses.replace(probe, n=min(n, probe.n))


def _replay_one(monitor, store, recipe, rev, step, tokens, dtype, device, cache_dir, bar, *, key, pr_monitor=None) -> dict:
    base = {"model": recipe.model, "revision": rev, "step": step, "tokens": tokens}
    t0 = time.perf_counter()
    model = None
    paper = monitor.config.protocol == "paper"
    try:
        _status(bar, rev, "load")
        model = load_model(recipe.model, revision=rev, dtype=dtype, device=device, cache_dir=cache_dir)
        load_s = time.perf_counter() - t0
        if paper and dtype in ("float16", "bfloat16"):
            # the paper's attention weights came from eager half-precision attention (output_attentions):
            # every layer's input must come from the same forward for its numbers to carry over
            model.set_attn_implementation("eager")
        _status(bar, rev, "probe")
        monitor.tracker = _tracker_before(store, step, monitor.config.stages)
        snap = monitor.probe(model, step=step, tokens=tokens, revision=rev, model_name=recipe.model)
        record = snap.to_record()
        if pr_monitor is not None:
            _status(bar, rev, "PR (float16, first 500)")
            record.update(_paper_pr(pr_monitor, model, recipe, rev, dtype, device, cache_dir))
        record.update(
            {"status": "ok", "dtype": dtype, "replay_key": key, "load_seconds": load_s, "revision_seconds": time.perf_counter() - t0}
        )
        store.append(record)  # only a complete record is ever written
        return record
    except HubUnreachableError:
        raise  # every other revision would fail the same way: stop with the advice
    except Exception as exc:  # noqa: BLE001 - missing revision, download error, out of memory...
        failed = {**base, "status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        store.append(failed)
        warnings.warn(f"sinkwatch replay: {recipe.model}@{rev} failed ({failed['error']}); continuing", RuntimeWarning, stacklevel=2)
        return failed
    finally:
        del model
        gc.collect()


def _paper_pr(pr_monitor: Monitor, model, recipe: Recipe, rev: str, dtype: str, device, cache_dir) -> dict:
    """The paper's PR: its per-head scripts loaded each revision in float16 with the default (sdpa)
    attention and took the first 500 sequences. A float16 model is reused with sdpa switched back on;
    another dtype is loaded again in float16 (a cast of the loaded model would also cast buffers
    that ``from_pretrained`` keeps in float32)."""
    if dtype == "float16":
        model.set_attn_implementation("sdpa")
        half = model
    else:
        half = load_model(recipe.model, revision=rev, dtype="float16", device=device, cache_dir=cache_dir)
    try:
        values = pr_monitor.probe(half, track=False).values
    finally:
        del half
    return {"pr": np.asarray(values["pr"]).tolist(), "pr_sequences": values["pr_sequences"], "pr_dtype": "float16"}


def _tracker_before(store: ReplayStore, step: int | None, config) -> StageTracker:
    """A tracker that has seen every stored revision before ``step``, in training order."""
    ok = {r["revision"]: r for r in store.rows() if r.get("status", "ok") == "ok" and r.get("revision") is not None}
    tracker = StageTracker(config)
    for rev in training_order(list(ok)):
        if (revision_step(rev) or 0) < (step or 0):
            tracker.update(dict(ok[rev]))
    return tracker


def _progress(items, enabled: bool, model: str):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"replay {model}", unit="rev")


def _status(bar, rev: str, phase: str) -> None:
    if hasattr(bar, "set_postfix_str"):
        bar.set_postfix_str(f"{rev}: {phase}")


def _replay_wandb(mode: str, out_dir, recipe: Recipe):
    if mode == "disabled":
        return None
    try:
        from .reporting.wandb_run import wandb_reporter

        return wandb_reporter(mode, project="sinkwatch-replay", dir=str(out_dir), init_kwargs={"name": recipe.name or recipe.model})
    except ImportError:
        warnings.warn("sinkwatch replay: wandb is not installed; records are in the store only", RuntimeWarning, stacklevel=2)
        return None


# ---- the paper's group ablation (SPEC §5) -------------------------------------------------------------------
ABLATION_FILE = "ablation.json"
PAPER_ABLATION_DTYPE = "float16"  # the paper ran every ablation in float16, Pythia too
PAPER_CONTROL_RULE = (
    "the fourth draw of one RandomState(123) shared across the sweep thresholds [2, 10, 30, 50, 100], "
    "min(picks, eligible) in a short layer (metrics.paper_control_sets)"
)


def ablation_key(key: dict, revision: str) -> dict:
    """What makes two ablations the same measurement: the store's replay key and the revision."""
    return {**key, "revision": revision}


def read_ablation(out_dir: str | os.PathLike) -> dict | None:
    """The store's ablation result (``DIR/ablation.json``), or None when there is none yet."""
    path = Path(out_dir) / ABLATION_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:  # written by rename, so only a hand-edited file lands here
        warnings.warn(f"sinkwatch replay: {path} is not valid JSON; the ablation will be redone", RuntimeWarning, stacklevel=2)
        return None


def check_ablation(out_dir: str | os.PathLike, wanted: dict) -> None:
    """Refuse (StoreMismatchError) when the store holds a successful ablation made another way."""
    stored = read_ablation(out_dir)
    if stored is None or stored.get("status") != "ok":
        return
    diff = key_difference(stored["ablation_key"], wanted)
    if stored["ablation_key"].get("revision") != wanted.get("revision"):
        diff.append(f"ablation revision: {stored['ablation_key'].get('revision')} -> {wanted.get('revision')}")
    if diff:
        raise StoreMismatchError(
            f"{Path(out_dir) / ABLATION_FILE} was made another way ({'; '.join(diff)}). "
            "Replay into another --out, or move ablation.json away to redo it"
        )


def paper_ablation_sets(induction: np.ndarray, n_heads: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The >= 50x induction set of a screen ((L, H) selectivities) and the paper's control for it: the
    fourth draw of the shared-stream sweep, every threshold drawn in the paper's order."""
    t = metrics.INDUCTION_CIRCUIT_MIN_SELECTIVITY
    screens = metrics.screen_sets(induction, metrics.PAPER_SWEEP_THRESHOLDS)
    return screens[t], metrics.paper_control_sets(screens, n_heads)[t]


def _stored_record(out_dir, revision: str, key: dict) -> dict | None:
    """The latest successful record of ``revision`` made with ``key``, from any shard."""
    found = None
    for path in sorted(Path(out_dir).glob("records*.jsonl")):
        if ".superseded" in path.name:
            continue
        for r in read_jsonl(path):
            if r.get("revision") == revision and r.get("status", "ok") == "ok" and "n_layers" in r and key_of(r) == key:
                found = r
    return found


def run_ablation(
    monitor: Monitor, recipe: Recipe, revision: str, *, out_dir, key: dict, dtype: str, device=None, cache_dir=None, bar=None
) -> dict:
    """Group ablation of the >= 50x induction circuit at ``revision``, written to ``DIR/ablation.json``.

    The set comes from that revision's screen — its record in the store, else a probe of that
    revision made here the same way (its induction selectivities kept in the result). Protocol
    "paper": the model in float16 and the paper's control (``paper_ablation_sets``); protocol
    "sinkwatch": the replay's dtype and ``Monitor.ablate``'s own draw. Done already (same key): skipped.
    A failure is written with its reason and warned about; a rerun retries it. Returns the result.
    """
    wanted = ablation_key(key, revision)
    stored = read_ablation(out_dir)
    if stored is not None and stored.get("status") == "ok" and stored.get("ablation_key") == wanted:
        _status(bar, revision, "ablation done already")
        return stored
    paper = monitor.config.protocol == "paper"
    abl_dtype = PAPER_ABLATION_DTYPE if paper else dtype
    base = {"kind": "ablation", "model": recipe.model, "revision": revision, "protocol": monitor.config.protocol, "dtype": abl_dtype}
    t0 = time.perf_counter()
    model = None
    try:
        record = _stored_record(out_dir, revision, key)
        screen = {"screen": "record"}
        if record is None:
            _status(bar, revision, "screen for the ablation")
            model = load_model(recipe.model, revision=revision, dtype=dtype, device=device, cache_dir=cache_dir)
            if paper and dtype in ("float16", "bfloat16"):
                model.set_attn_implementation("eager")  # as the per-revision records (see _replay_one)
            record = monitor.probe(model, track=False, revision=revision, model_name=recipe.model).to_record()
            screen = {"screen": "probed for the ablation", "screen_induction": record["selectivity"]["induction"]}
        induction = np.asarray(record["selectivity"]["induction"], dtype=float)  # (L, H)
        if paper:
            heads, control = paper_ablation_sets(induction, int(record["n_heads"]))
        else:
            heads, control = metrics.screen_sets(induction, [metrics.INDUCTION_CIRCUIT_MIN_SELECTIVITY])[50.0], None
        if model is None or dtype != abl_dtype:
            model = None
            gc.collect()
            _status(bar, revision, f"load in {abl_dtype} for the ablation")
            model = load_model(recipe.model, revision=revision, dtype=abl_dtype, device=device, cache_dir=cache_dir)
        else:
            model.set_attn_implementation("sdpa")  # the screen's eager attention was for its rounding only
        _status(bar, revision, f"ablation of {len(heads)} head(s)")
        scores = monitor.ablate(model, heads, control=control)
        result = {
            **base,
            "status": "ok",
            "ablation_key": wanted,
            "threshold": metrics.INDUCTION_CIRCUIT_MIN_SELECTIVITY,
            "control_rule": PAPER_CONTROL_RULE if paper else "RandomState(123) for this set alone; a short layer raises",
            **screen,
            **scores,
            "seconds": time.perf_counter() - t0,
        }
        if not heads:
            result["note"] = "no head reaches 50x at this revision: the ablated and baseline scores are the same forward"
    except HubUnreachableError:
        raise
    except Exception as exc:  # noqa: BLE001 - the records are kept; the ablation is retried on a rerun
        result = {**base, "status": "failed", "ablation_key": wanted, "error": f"{type(exc).__name__}: {exc}"}
        warnings.warn(
            f"sinkwatch replay: the ablation at {recipe.model}@{revision} failed ({result['error']}); rerun to retry",
            RuntimeWarning,
            stacklevel=2,
        )
    finally:
        del model
        gc.collect()
    _write_atomic(Path(out_dir) / ABLATION_FILE, result)
    return result


def _write_atomic(path: Path, data: dict) -> None:
    """Written whole or not at all: a crash leaves the previous file (or none), never a torn one."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jsonable(data), indent=1))
    os.replace(tmp, path)
