"""The replay loop: each revision loaded, probed with the live ``Monitor``, written as one record."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import warnings
from collections.abc import Sequence

import numpy as np

from ..loading import HubUnreachableError, load_model
from ..monitor import PAPER_PR_SEQUENCES, Monitor, MonitorConfig
from ..probes import ProbeSet
from ..stages import StageTracker
from .ablation import ablation_key, check_ablation, run_ablation
from .progress import _progress, _status
from .recipes import Recipe
from .revisions import check_hub, list_revisions, revision_step, revision_tokens, select_log_spaced, training_order
from .store import ReplayStore, replay_key, shard_from_env


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


def _replay_wandb(mode: str, out_dir, recipe: Recipe):
    if mode == "disabled":
        return None
    try:
        from .reporting.wandb_run import wandb_reporter

        return wandb_reporter(mode, project="sinkwatch-replay", dir=str(out_dir), init_kwargs={"name": recipe.name or recipe.model})
    except ImportError:
        warnings.warn("sinkwatch replay: wandb is not installed; records are in the store only", RuntimeWarning, stacklevel=2)
        return None
