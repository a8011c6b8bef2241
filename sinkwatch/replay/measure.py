"""Measuring one revision (SPEC §8), as the claim loop (``run``) and the engines' unit (``unit``) both do:

1. ``place``: from the revision's config alone — its device, a split over GPUs, or refused (not downloaded);
2. ``fetch``: downloaded by commit on one background thread (``fetch.Fetcher``; the loop starts the next
   download while this one is probed);
3. ``measure``: loaded straight onto its device(s), probed with the live ``Monitor`` (an out-of-memory
   probe is retried once at half ``batch_tokens``), the paper protocol's float16 PR pass after the
   float32 model is freed, stages derived over the whole store in step order;
4. ``write``: one complete record (ok or failed) in the store, the claim released, the revision evicted
   from the cache and the device cache emptied.

The group ablation, once its revision is recorded, is measured here too.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..loading import HubUnreachableError, load_model, loaded_attention
from ..monitor import PAPER_PR_SEQUENCES, Monitor
from ..probes import ProbeSet
from ..stages import StageTracker
from .ablation import ablation_key, read_ablation, run_ablation
from .claims import ClaimConfig, Claims
from .devices import empty_device_cache, oom_retry, peaks, release_memory, reset_peaks, worker_device
from .fetch import FetchConfig, Fetcher
from .plan import ModelShape, Placement, device_budgets, place, revision_config
from .prepare import ReplaySetup
from .progress import _counter, _status
from .provenance import provenance
from .recipes import Recipe
from .revisions import Revision, lineage
from .signals import Terminated
from .store import ReplayStore, done_key, store_group
from .workers import Worker, detect_worker


@dataclass
class Job:
    rev: Revision
    item: str  # the claim: the revision's done key
    placement: Placement | None = None
    error: BaseException | None = None


class Measurer:
    """One worker's means to measure revisions into the store ``out_dir``: its store, claims, fetcher,
    monitors, reporter and progress bar. ``run._Loop`` claims revisions and feeds them through it;
    ``unit._UnitLoop`` measures one task."""

    def __init__(
        self, s: ReplaySetup, *, out_dir, device, cache_dir, wandb, progress, fetch: FetchConfig, claims: ClaimConfig | None, max_memory,
        protect: set[str] = frozenset(),
    ):  # fmt: skip
        self.s = s
        self.out_dir = out_dir
        self.worker = detect_worker()
        if self.worker.launcher == "local-rank":
            warnings.warn(
                f"sinkwatch replay: LOCAL_RANK={self.worker.local_rank} without WORLD_SIZE: this process is one worker of an "
                "unknown number; it claims revisions in the store like any other (nothing is skipped)",
                RuntimeWarning,
                stacklevel=3,
            )
        self.store = ReplayStore(out_dir, self.worker)
        self._check_store()
        self.device = worker_device(device, self.worker)
        self.cache_dir = cache_dir
        self.fetch_config = fetch
        self.max_memory = max_memory
        self.claims = self._claims(out_dir, claims)
        self.fetcher = Fetcher(
            s.recipe.model, cache_dir=cache_dir, config=fetch, worker_id=self.worker.id, progress=progress, protect=protect
        )
        self.pr_monitor = None
        cfg = s.cfg
        if s.protocol == "paper" and cfg.participation_ratio and any(p.kind == "induction" for p in s.probes):
            # the paper's PR ran separately (its per-head scripts): float16, default attention, first 500 sequences
            self.pr_monitor = Monitor([_first(p, PAPER_PR_SEQUENCES) for p in s.probes if p.kind == "induction"], config=cfg)
            cfg = dataclasses.replace(cfg, participation_ratio=False)
        self.monitor = Monitor(s.probes, config=cfg)
        self.reporter = _replay_wandb(wandb, out_dir, s.recipe, self.worker)
        self.bar = _counter(len(s.mine), progress, s.recipe.model)
        self._shapes: dict[str, ModelShape] = {}
        self._kept: tuple[Revision, Path] | None = None  # the ablation revision, on disk until the ablation ran

    def _check_store(self) -> None:
        self.store.check(self.s.key)

    def _claims(self, out_dir, config: ClaimConfig | None):
        return Claims(out_dir, self.worker, config)

    def _start(self, rev: Revision) -> Job:
        """Decide where ``rev`` goes (from its config alone), then start its download."""
        job = Job(rev, done_key(self.s.key, rev.name, rev.commit))
        if rev.path is not None:
            return job  # a local checkpoint: nothing to download, loaded by its source onto this worker's device
        try:
            job.placement = self._place(rev)
            if not job.placement.fits:
                raise MemoryError(f"{self.s.recipe.model}@{rev.name} {job.placement.reason}")
        except HubUnreachableError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded with the revision
            job.error = exc
            return job
        if self.fetch_config.prefetch:
            self.fetcher.prefetch(rev)
        return job

    def _await(self, job: Job) -> Path | None:
        if job.error is not None:
            return None
        _status(self.bar, job.rev.name, "download")
        try:
            return self.fetcher.fetch(job.rev)
        except HubUnreachableError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded with the revision
            job.error = exc
            return None

    def _place(self, rev: Revision) -> Placement:
        try:
            config = revision_config(self.s.recipe.model, rev, cache_dir=self.cache_dir, fetch=self.fetch_config)
        except HubUnreachableError:
            raise
        except Exception as exc:  # a missing revision lands here first: say which
            raise RuntimeError(f"cannot read the config of {self.s.recipe.model}@{rev.name}: {type(exc).__name__}: {exc}") from exc
        text = config.to_json_string()
        if text not in self._shapes:
            self._shapes[text] = ModelShape.from_config(config)
        seq = max((getattr(p, "seq_len", 0) or 0) for p in self.s.probes) or 256
        budgets = device_budgets(self.device, self.max_memory, self.worker.local_rank)
        return place(self._shapes[text], self.s.dtype, budgets, batch_tokens=self.monitor.config.batch_tokens, seq_len=seq)

    def _about(self, rev: Revision) -> dict:
        """What a row says it measured, ok or failed: the commit, the weights' fingerprint, a duplicate
        flag, the versions (``provenance``), the protocol label and what changed it, this worker."""
        s = self.s
        return {
            **provenance(rev, s.source.weights.get(rev.name), s.flags.get(rev.name)),
            **s.label.record_fields(),
            "worker": self.worker.id,
        }

    def _measure(self, job: Job, path: Path | None) -> dict | None:
        rev, recipe = job.rev, self.s.recipe
        # a failed row says which measurement failed, as an ok one does (its replay key and dtype)
        base = {
            "model": recipe.model, "revision": rev.name, "step": rev.step, "tokens": rev.tokens,
            "dtype": self.s.dtype, "replay_key": self.s.key, **self._about(rev),
        }  # fmt: skip
        row = None
        if job.error is None:
            try:
                row = self._probe(rev, path, job.placement)
            except HubUnreachableError:
                raise
            except Exception as exc:  # noqa: BLE001 - missing revision, out of memory twice, a bad checkpoint...
                job.error = exc
        if job.error is not None:
            row = {**base, "status": "failed", "error": f"{type(job.error).__name__}: {job.error}"}
            warnings.warn(f"sinkwatch replay: {recipe.model}@{rev.name} failed ({row['error']}); continuing", RuntimeWarning, stacklevel=2)
        if self.claims.lost(job.item):
            warnings.warn(
                f"sinkwatch replay: {rev.name} was taken over by another worker while this one was silent; its result is not written",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        self.store.write(row)  # only a complete record is ever written, and once per done key
        self.claims.release(job.item, failed=row["status"] == "failed")
        if self.reporter is not None and row["status"] == "ok":
            try:
                self.reporter.log_record(row)
            except Exception as exc:  # noqa: BLE001 - logging never stops a replay
                warnings.warn(
                    f"sinkwatch replay: W&B logging failed ({exc}); records are in {self.store.path}", RuntimeWarning, stacklevel=2
                )
                self.reporter = None
        return row

    def _probe(self, rev: Revision, path: Path, placement: Placement | None) -> dict:
        recipe, dtype = self.s.recipe, self.s.dtype
        gpus = sorted({d for d in placement.device_map.values() if str(d).startswith("cuda")}) if placement is not None else []
        reset_peaks(gpus)
        t0 = time.perf_counter()
        _status(self.bar, rev.name, "load")
        model = self._load(rev, path, dtype, placement)
        load_s = time.perf_counter() - t0
        leaving = False
        try:
            default = loaded_attention(model)  # sdpa, or eager for a class without sdpa (gpt-oss, Gemma 2)
            if self.s.protocol == "paper" and dtype in ("float16", "bfloat16"):
                # the paper's attention weights came from eager half-precision attention (output_attentions):
                # every layer's input must come from the same forward for its numbers to carry over
                model.set_attn_implementation("eager")
            _status(self.bar, rev.name, "probe")
            used: dict = {}
            snap = oom_retry(
                [self.monitor],
                lambda: self.monitor.probe(
                    model, step=rev.step, tokens=rev.tokens, revision=rev.name, model_name=recipe.model
                ),
                used,
            )
            record = snap.to_record()  # with the device it ran on (Monitor.probe)
            if self.pr_monitor is not None:
                _status(self.bar, rev.name, "PR (float16, first 500)")
                if dtype == "float16":
                    model.set_attn_implementation(default)  # the paper's PR scripts ran the model's default attention
                else:
                    # a cast would also cast buffers from_pretrained keeps in float32: load again, after freeing this one
                    model = None
                    release_memory()
                    model = self._load(rev, path, "float16", placement)
                values = oom_retry([self.pr_monitor], lambda: self.pr_monitor.probe(model).values, used)
                record.update({"pr": np.asarray(values["pr"]).tolist(), "pr_sequences": values["pr_sequences"], "pr_dtype": "float16"})
        except Terminated:
            # the process is leaving (a time limit): its failed row comes first, before SIGKILL follows
            # (KillWait); a gc pass here took 0.4 s idle and seconds under load
            leaving = True
            raise
        finally:
            model = None
            if not leaving:
                release_memory()
        record.update(self._about(rev))
        record.update(
            {
                "status": "ok",
                "dtype": dtype,
                "replay_key": self.s.key,
                "stage_config": self.monitor.config.stages.to_dict(),
                "load_seconds": load_s,
                "revision_seconds": time.perf_counter() - t0,
                **used,
            }
        )
        if placement is not None and placement.split:
            record["device_map"] = sorted(set(placement.device_map.values()))
        if gpus:
            record["device_peak_bytes"] = peaks(gpus)  # what this revision needed on its GPUs (the plan's estimate, measured)
        # stages from the whole store in step order, applied to the complete record (PR included)
        self._tracker_before(rev).update(record)
        return record

    def _load(self, rev: Revision, path: Path | None, dtype: str, placement: Placement | None):
        """A local revision (a user's checkpoint: HF, OLMo-core, Lightning) through its source's loader;
        a hub one from the folder the fetcher downloaded by commit, straight onto its device(s)."""
        if rev.path is not None:
            return self.s.source.load(rev, dtype=dtype, device=self.device)
        device_map = placement.device_map if placement is not None else {"": self.device}
        return load_model(str(path), dtype=dtype, device_map=device_map)

    def _tracker_before(self, rev: Revision) -> StageTracker:
        """A tracker that has seen every stored revision (any worker's) before ``rev`` in its lineage —
        its run, and for a parallel run the main run before it — in training order: the order
        ``merged_records`` (the report) derives the stages in. Flagged duplicates are no trajectory points."""
        latest = {r["revision"]: r for r in self.store.ok_records(self.s.key) if r["revision"] != rev.name}
        here = {"revision": rev.name, "step": rev.step, "run": rev.run, "stage": rev.stage, "_this": True}
        points = [r for r in latest.values() if not r.get("duplicate_of")] + [here]
        tracker = StageTracker(self.monitor.config.stages)
        for r in lineage(points, rev.run):
            if r.get("_this"):
                break
            tracker.update(dict(r))
        return tracker

    def _done_with(self, job: Job, path: Path | None) -> None:
        """Evict the revision (the ablation revision stays until the ablation ran) and empty the device cache."""
        if self.s.ablation == job.rev.name and path is not None and job.error is None:
            self._kept = (job.rev, path)
        else:
            self.fetcher.release(job.rev)
        empty_device_cache()

    # ---- the ablation, once ----
    def _ablation(self) -> None:
        name = self.s.ablation
        if name is None:
            return
        listed = next((r for r in self.s.revisions if r.name == name), None)
        rev = listed or self.s.source.revision(name)  # outside the trajectory (``main``): the commit its ref pointed at when listed
        key = ablation_key(self.s.key, name, rev.commit)  # a branch that moved (OLMoE's main) is ablated again
        stored = read_ablation(self.out_dir)
        if stored is not None and stored.get("status") == "ok" and stored.get("ablation_key") == key:
            return
        if listed is not None and not self.store.is_done(done_key(self.s.key, name, rev.commit)):
            # the ablation uses that revision's record: whoever writes it runs the ablation after its loop
            if any(r.get("revision") == name and r.get("status") == "failed" for r in self.store.rows()):
                warnings.warn(
                    f"sinkwatch replay: no ablation: its revision {name} failed; rerun to retry both", RuntimeWarning, stacklevel=2
                )
            return
        item = "ablation-" + done_key(key, name, rev.commit)
        if not self.claims.try_claim(item, {"revision": name, "kind": "ablation"}):
            return  # another worker runs it
        result = {"status": "failed"}
        try:
            kept = self._kept[1] if self._kept is not None and self._kept[0].name == name else None
            result = run_ablation(
                self.monitor, self.s.recipe, name, out_dir=self.out_dir, key=self.s.key, dtype=self.s.dtype, device=self.device,
                cache_dir=self.cache_dir, bar=self.bar, commit=rev.commit,
                # loaded as the revisions are (fetched by commit, inside run_ablation's error handling)
                load=lambda _name, dt: self._load(rev, None if rev.path else (kept or self.fetcher.fetch(rev)), dt, None),
            )  # fmt: skip
        finally:
            self.claims.release(item, failed=result.get("status") != "ok")
            self.fetcher.release(rev)
            self._kept = None if self._kept is not None and self._kept[0].name == name else self._kept

    def _close(self, *, wait: bool) -> None:
        if self._kept is not None:
            self.fetcher.release(self._kept[0])
        self.fetcher.close(wait=wait)
        for item in list(self.claims._held):  # an interrupted worker: free its claims at once
            self.claims.release(item)
        self.claims.close()
        if self.reporter is not None:
            self.reporter.finish()
        if self.bar is not None:
            self.bar.close()


# ---- helpers ------------------------------------------------------------------------------------------------------------------
def _first(probe, n: int):
    """The first ``n`` sequences of a probe (the induction probe draws sequentially: SPEC §3)."""
    if isinstance(probe, ProbeSet):
        return probe.subset(min(n, probe.n))
    return dataclasses.replace(probe, n=min(n, probe.n))


def _replay_wandb(mode: str, out_dir, recipe: Recipe, worker: Worker):
    """One W&B run per worker (named by the worker), grouped by the store."""
    if mode == "disabled":
        return None
    try:
        from ..reporting.wandb_run import wandb_reporter

        name = f"{recipe.name or recipe.model.split('/')[-1]} {worker.id}"
        return wandb_reporter(mode, project="sinkwatch-replay", dir=str(out_dir), init_kwargs={"name": name, "group": store_group(out_dir)})
    except ImportError:
        warnings.warn("sinkwatch replay: wandb is not installed; records are in the store only", RuntimeWarning, stacklevel=2)
        return None
