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

import gc
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

from .loading import HubUnreachableError, _is_network_error, hub_offline, load_model
from .monitor import Monitor, MonitorConfig
from .probes import InductionProbe, NaturalProbe, RepeatedRandomProbe
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

    def __post_init__(self) -> None:
        if self.revisions is not None and self.log_spaced is not None:
            raise ValueError("give revisions or log_spaced, not both")
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
        "instead: on a machine with network run `huggingface-cli download MODEL --revision REV` for each revision "
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


class ReplayStore:
    """``DIR/records.jsonl`` (or one shard's file). A record is appended only when complete; a line
    torn by a crash is skipped when reading, so that revision is simply done again."""

    def __init__(self, out_dir: str | os.PathLike, shard: tuple[int, int] = (0, 1)):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        k, n = shard
        self.path = self.dir / ("records.jsonl" if n == 1 else f"records.shard-{k}-of-{n}.jsonl")

    def rows(self) -> list[dict]:
        return read_jsonl(self.path)

    def done(self) -> set[str]:
        return {r["revision"] for r in self.rows() if r.get("status", "ok") == "ok" and "revision" in r}

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
) -> list[dict]:
    """Replay revisions of a hub model (or a ``Recipe``); returns this shard's rows (ok and failed).

    Revisions come from the recipe, ``revisions``, or ``list_repo_refs`` (+ ``log_spaced``). They
    are replayed in training order; shard K of N takes every N-th one (from RANK/WORLD_SIZE under
    torchrun or accelerate launch, or given).
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
    done = store.done()
    tps = tokens_per_step or recipe.tokens_per_step
    cfg = monitor_config or MonitorConfig(batch_tokens=batch_tokens or recipe.batch_tokens)
    monitor = Monitor(probes if probes is not None else recipe.probe_recipes(), config=cfg)
    reporter = _replay_wandb(wandb, out_dir, recipe)
    rows = []
    bar = _progress(mine, progress, recipe.model)
    for rev in bar:
        step, tokens = revision_step(rev), revision_tokens(rev, tps)
        if rev in done:
            _status(bar, rev, "done already")
            continue
        row = _replay_one(monitor, store, recipe, rev, step, tokens, dtype or recipe.dtype, device, cache_dir, bar)
        rows.append(row)
        if reporter is not None and row.get("status", "ok") == "ok":
            try:
                reporter.log_record(row)
            except Exception as exc:  # noqa: BLE001 - logging never stops a replay
                warnings.warn(f"sinkwatch replay: W&B logging failed ({exc}); records are in {store.path}", RuntimeWarning, stacklevel=2)
                reporter = None
    if reporter is not None:
        reporter.finish()
    return rows


def _replay_one(monitor, store, recipe, rev, step, tokens, dtype, device, cache_dir, bar) -> dict:
    base = {"model": recipe.model, "revision": rev, "step": step, "tokens": tokens}
    t0 = time.perf_counter()
    model = None
    try:
        _status(bar, rev, "load")
        model = load_model(recipe.model, revision=rev, dtype=dtype, device=device, cache_dir=cache_dir)
        load_s = time.perf_counter() - t0
        _status(bar, rev, "probe")
        monitor.tracker = _tracker_before(store, step, monitor.config.stages)
        snap = monitor.probe(model, step=step, tokens=tokens, revision=rev, model_name=recipe.model)
        record = snap.to_record()
        record.update({"status": "ok", "dtype": dtype, "load_seconds": load_s, "revision_seconds": time.perf_counter() - t0})
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
