"""Measuring one task (docs/design.md §8), for the workers' loop (``run``) and the engines' unit (``unit``):

1. ``begin``: the task's attempt starts (``attempts``: its own folder and held marker, beside any other attempt at that
   task); a listed ref whose weights the manifest could not read is asked again: a member is flagged when that finds a
   duplicate, marked unverified when it cannot;
2. ``place``: from the revision's config alone: its device, a split over GPUs, or refused (not downloaded);
3. ``fetch``: by commit into the task's folder on a background thread (``fetch.Fetcher``), the next task's while this one is probed;
4. ``measure``: loaded onto its device(s), probed with the live ``Monitor`` (an out-of-memory probe retried once at half
   ``batch_tokens``), the paper protocol's float16 PR pass after the float32 model is freed, stages derived in step order;
5. ``write``: one record per member not yet recorded (ok or failed; a second finished result for a recorded key is
   dropped), then the attempt ends: its folder emptied, its marker gone.

The group ablation, once its revision is recorded, is measured here too.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..models.loading import HubUnreachableError, hub_offline, load_model, loaded_attention
from ..models.placement import ModelShape, Placement, device_budgets, place
from ..probe.config import PAPER_PR_SEQUENCES
from ..probe.monitor import Monitor
from ..probes import ProbeSet
from ..stages import StageTracker
from . import attempts
from .ablation import ablation_key, read_ablation, run_ablation
from .devices import empty_device_cache, oom_retry, peaks, release_memory, reset_peaks, worker_device
from .fetch import FetchConfig, Fetcher
from .manifest import Task
from .plan import revision_config
from .prepare import ReplaySetup
from .progress import _counter, _status
from .provenance import could_be_a_copy, provenance, weights_of
from .recipes import Recipe
from .revisions import Revision, lineage
from .signals import Terminated
from .store import ReplayStore, done_key, store_group
from .workers import Worker, detect_worker

_PER_REVISION = ("written_at", "run", "stage", "path", "duplicate_group", "duplicate_kind", "p0_stage", "induction_state",
                 "weights_unverified")  # fmt: skip


@dataclass
class Job:
    """One attempt at a task: the member measured (``rev``) and the members it records (``todo``)."""

    task: Task
    rev: Revision
    todo: list[Revision]
    attempt: attempts.Attempt | None = None
    placement: Placement | None = None
    error: BaseException | None = None
    reuse: dict | None = None  # a member's record from an earlier attempt: the same weights, not measured again
    path: Path | None = None
    active: bool = False  # this worker is measuring it (not only downloading it ahead)
    written: list[str] = field(default_factory=list)  # members whose record this attempt published


class Measurer:
    """One worker's store, fetcher, monitors, reporter and progress bar for measuring tasks into ``out_dir``;
    ``run._Loop`` feeds it a stride of the manifest's tasks, ``unit._UnitLoop`` one task."""

    def __init__(self, s: ReplaySetup, *, out_dir, device, cache_dir, wandb, progress, fetch: FetchConfig, max_memory):
        self.s = s
        self.out_dir = out_dir
        self.worker = detect_worker()
        self.store = ReplayStore(out_dir, self.worker)
        self._check_store()
        self.device = worker_device(device, self.worker)
        self.cache_dir = cache_dir
        self.fetch_config = fetch
        self.max_memory = max_memory
        self.fetcher = Fetcher(s.recipe.model, cache_dir=cache_dir, config=fetch, progress=progress)
        self.pr_monitor = None
        cfg = s.cfg
        if s.protocol == "paper" and cfg.participation_ratio and any(p.kind == "induction" for p in s.probes):
            # the paper's PR ran separately (its per-head scripts): float16, default attention, first 500 sequences
            self.pr_monitor = Monitor([_first(p, PAPER_PR_SEQUENCES) for p in s.probes if p.kind == "induction"], config=cfg)
            cfg = dataclasses.replace(cfg, participation_ratio=False)
        self.monitor = Monitor(s.probes, config=cfg)
        self.reporter = _replay_wandb(wandb, out_dir, s.recipe, self.worker)
        self.bar = _counter(len(s.tasks), progress, s.recipe.model)
        self._shapes: dict[str, ModelShape] = {}
        self._kept: tuple[Revision, Path, attempts.Attempt] | None = None  # the ablation revision, on disk until the ablation ran
        self.open: dict[str, Job] = {}  # task -> its attempt, begun and not ended
        self.stage = "start"
        self._unreadable: dict[str, str] = {}  # listed refs whose weights could not be read, asked again: why

    def _check_store(self) -> None:
        self.store.check(self.s.key)

    def key(self, rev: Revision) -> str:
        return done_key(self.s.key, rev.name, rev.commit)

    # ---- an attempt -----------------------------------------------------------------------------------
    def _start(self, task: Task) -> Job | None:
        """Begin an attempt at ``task`` (None: all its members are recorded), place its revision, start its download."""
        todo = [r for r in self.s.needed(task) if not self.store.is_done(self.key(r))]
        if not todo:
            return None
        job = Job(task, todo[0], todo)
        job.attempt = attempts.begin(self.out_dir, task.name, root=self.fetch_config.cache_root, keep=self.fetch_config.keep_cache)
        self.open[task.name] = job
        try:
            self._verify(job)
        except Exception as exc:  # noqa: BLE001 - recorded with the task
            job.error = exc
        if not job.todo:
            return job
        for m in [self.s.rev(n) for n in task.members]:
            if self.store.is_done(self.key(m)):
                job.reuse = self.store.read(self.key(m))  # identical weights, measured by an earlier attempt
                break
        if job.error is not None or job.reuse is not None or job.rev.path is not None:
            return job  # a local checkpoint: nothing to download, loaded by its source onto this worker's device
        try:
            job.placement = self._place(job.rev)
            if not job.placement.fits:
                raise MemoryError(f"{self.s.recipe.model}@{job.rev.name} {job.placement.reason}")
        except HubUnreachableError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded with the task
            job.error = exc
            return job
        if self.fetch_config.prefetch:
            self.fetcher.prefetch(job.rev, job.attempt.folder)
        return job

    def _verify(self, job: Job) -> None:
        """Ask again for the weights the manifest could not read (a member's, or of ``main``, a tag or an unplanned step a
        member could copy), then flag duplicates over the whole listing (--skip-duplicates: recorded as skipped, not
        measured); a member whose weights, or a possible original's, stay unknown is measured, marked ``weights_unverified``."""
        s = self.s
        changed = [r.name for r in job.todo if r.name in s.changed]
        if changed:
            raise ValueError(
                f"{', '.join(changed)} changed on disk since {self.out_dir}/manifest.json was written (its weights are no longer "
                "the ones planned): write the plan again with --rewrite-manifest"
            )
        known = {**s.manifest.weights(), **s.source.weights}
        unknown = [n for n, e in s.manifest.entries.items() if n not in known and not e.get("path") and n not in self._unreadable]
        learned = {}
        for n in unknown:  # asked once per process; a ref still unreadable marks the records that could be its copy
            try:
                learned[n] = weights_of(s.recipe.model, s.rev(n), cache_dir=self.cache_dir, offline=hub_offline(), policy=self.fetch_config)
            except Exception as exc:  # noqa: BLE001 - measured anyway, marked unverified
                self._unreadable[n] = f"{type(exc).__name__}: {exc}"
        if learned:
            s.source.weights.update(learned)
            groups = s.manifest.groups(extra=s.source.weights)
            s.flags.update({r.name: groups[r.name] for r in job.todo if r.name in groups})
        listing = [s.rev(n) for n in s.manifest.entries if n not in s.manifest.aliases]
        for r in job.todo:
            if r.name in self._unreadable:
                s.unverified[r.name] = self._unreadable[r.name]
            elif self._unreadable and r.name not in s.flags and could_be_a_copy(r, listing):
                refs = "; ".join(f"{n}: {e}" for n, e in self._unreadable.items())
                s.unverified[r.name] = f"the weights of refs it could be a copy of could not be read ({refs})"
        if s.skip_duplicates:
            for r in [r for r in job.todo if r.name in s.flags]:
                self._write({**self._base(r), "status": "skipped", "reason": "--skip-duplicates: " + s.flags[r.name].describe()}, job)
            job.todo = [r for r in job.todo if r.name not in s.flags]
            job.rev = job.todo[0] if job.todo else job.rev

    def _await(self, job: Job) -> Path | None:
        job.active = True
        if job.error is not None or job.reuse is not None or not job.todo:
            return None
        self._at(job.rev.name, "download")
        try:
            job.path = self.fetcher.fetch(job.rev, job.attempt.folder)
            return job.path
        except HubUnreachableError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded with the task
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
        """What a row (ok or failed) says it measured: commit, fingerprint, duplicate flag, versions, protocol label, worker."""
        s = self.s
        out = {
            **provenance(rev, s.source.weights.get(rev.name), s.flags.get(rev.name)),
            **s.label.record_fields(),
            "worker": self.worker.id,
        }
        if rev.name in s.unverified:
            out["weights_unverified"] = s.unverified[rev.name]  # drawn, but its weights were never checked against the others'
        return out

    def _base(self, rev: Revision) -> dict:
        """What every row of ``rev`` says, ok or failed: which measurement (its replay key and dtype) of which weights."""
        recipe = self.s.recipe
        return {"model": recipe.model, "revision": rev.name, "step": rev.step, "tokens": rev.tokens, "dtype": self.s.dtype,
                "replay_key": self.s.key, **self._about(rev)}  # fmt: skip

    def _write(self, row: dict, job: Job) -> bool:
        """Publish ``row``; False when its key had a record already (a second finished result: dropped)."""
        won = self.store.write(row)
        if won and row.get("status") != "failed":
            job.written.append(row["revision"])
        return won

    def _measure(self, job: Job, path: Path | None) -> list[dict]:
        """Measure the task's revision once (or reuse an earlier attempt's record of identical weights); write and
        return a row for every member it records."""
        recipe = self.s.recipe
        rows: list[dict] = []
        if not job.todo:
            return rows
        row = job.reuse
        if job.error is None and row is None:
            try:
                row = self._probe(job.rev, path, job.placement)
            except HubUnreachableError:
                raise
            except Exception as exc:  # noqa: BLE001 - missing revision, out of memory twice, a bad checkpoint...
                job.error = exc
        if job.error is not None:
            error = f"{type(job.error).__name__}: {job.error}"
            warnings.warn(f"sinkwatch replay: {recipe.model}@{job.rev.name} failed ({error}); continuing", RuntimeWarning, stacklevel=2)
            return self.write_failed(job, error)
        for m in job.todo:
            if job.reuse is None and m.name == job.rev.name:
                out = row
            else:  # the same numbers under this member's own name, commit and flags (``measured_as``: the revision probed)
                out = {k: v for k, v in row.items() if k not in _PER_REVISION}
                out.update({"revision": m.name, "step": m.step, "tokens": m.tokens, **self._about(m),
                            "measured_as": row.get("measured_as") or row["revision"]})  # fmt: skip
                self._tracker_before(m).update(out)
            if self._write(out, job):
                rows.append(out)
                self._log(out)
        return rows

    def _at(self, rev: str, stage: str) -> None:
        self.stage = stage  # how far the attempt got, should a limit end it
        _status(self.bar, rev, stage)

    def write_failed(self, job: Job, error: str, *, limit: bool = False) -> list[dict]:
        """Failed rows for the unrecorded members of ``job``. ``limit``: an engine's limit ended it (SIGTERM, submitit's
        time-out, Ray's cancel): ``row["limit"]`` says after how long, in which stage, and how many attempts in a row
        (``failed_tasks`` stops listing it at two)."""
        rows = []
        for m in job.todo:
            if m.name in job.written or self.store.is_done(self.key(m)):
                continue
            row = {**self._base(m), "status": "failed", "error": error}
            if limit:
                before = (self.store.read(self.key(m)) or {}).get("limit") or {}
                row["limit"] = {"after_s": round(time.time() - job.attempt.started_at, 1),
                                "stage": self.stage if job.active else "waiting", "count": before.get("count", 0) + 1}  # fmt: skip
            self.store.write(row)
            rows.append(row)
        return rows

    def _log(self, row: dict) -> None:
        if self.reporter is None or row.get("status") != "ok":
            return
        try:
            self.reporter.log_record(row)
        except Exception as exc:  # noqa: BLE001 - logging never stops a replay
            warnings.warn(f"sinkwatch replay: W&B logging failed ({exc}); records are in {self.store.path}", RuntimeWarning, stacklevel=2)
            self.reporter = None

    def _end(self, job: Job) -> None:
        """End the attempt: folder emptied (the ablation revision's kept until the ablation ran), marker gone, device cache emptied."""
        if self.s.ablation == job.rev.name and job.path is not None and job.error is None and not self.fetch_config.keep_cache:
            self._kept = (job.rev, job.path, job.attempt)  # its attempt lives on (its folder held) until the ablation ran
        else:
            job.attempt.end()
        self.open.pop(job.task.name, None)
        empty_device_cache()

    def abandon(self, exc: BaseException, *, every: bool = False) -> None:
        """Interrupted (SIGTERM, Ray's cancel as KeyboardInterrupt, an exception): end the attempts in flight; the one
        being measured (``every``: each) writes its failed rows, saying why."""
        why = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, KeyboardInterrupt):
            why = "KeyboardInterrupt: interrupted (Ctrl-C, or Ray's cancel of a task past its time limit)"
        limit = isinstance(exc, (Terminated, KeyboardInterrupt)) or type(exc).__name__ == "UncompletedJobError"  # submitit's
        for job in list(self.open.values()):
            try:
                if job.active or every:
                    self.write_failed(job, why, limit=limit)
            except OSError as err:  # a full disk fails the failed row too: the task stays unrecorded, as --failed-tasks says
                warnings.warn(f"sinkwatch replay: no failed row for task {job.task.name} ({err})", RuntimeWarning, stacklevel=2)
            job.attempt.end()
            self.open.pop(job.task.name, None)

    def _probe(self, rev: Revision, path: Path, placement: Placement | None) -> dict:
        recipe, dtype = self.s.recipe, self.s.dtype
        gpus = sorted({d for d in placement.device_map.values() if str(d).startswith("cuda")}) if placement is not None else []
        reset_peaks(gpus)
        t0 = time.perf_counter()
        self._at(rev.name, "load")
        model = self._load(rev, path, dtype, placement)
        load_s = time.perf_counter() - t0
        leaving = False
        try:
            default = loaded_attention(model)  # sdpa, or eager for a class without sdpa (gpt-oss, Gemma 2)
            if self.s.protocol == "paper" and dtype in ("float16", "bfloat16"):
                # the paper's attention weights came from eager half-precision attention (output_attentions)
                model.set_attn_implementation("eager")
            self._at(rev.name, "probe")
            used: dict = {}
            snap = oom_retry(
                [self.monitor],
                lambda: self.monitor.probe(model, step=rev.step, tokens=rev.tokens, revision=rev.name, model_name=recipe.model),
                used,
            )
            record = snap.to_record()  # with the device it ran on (Monitor.probe)
            if self.pr_monitor is not None:
                self._at(rev.name, "PR (float16, first 500)")
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
            # leaving (a time limit): its failed row before SIGKILL (KillWait), no gc pass (0.4 s idle, seconds under load)
            leaving = True
            raise
        finally:
            model = None
            if not leaving:
                release_memory()
        record.update(self._about(rev))
        record.update({"status": "ok", "dtype": dtype, "replay_key": self.s.key, "stage_config": self.monitor.config.stages.to_dict(),
                       "load_seconds": load_s, "revision_seconds": time.perf_counter() - t0, **used})  # fmt: skip
        if placement is not None and placement.split:
            record["device_map"] = sorted(set(placement.device_map.values()))
        if gpus:
            record["device_peak_bytes"] = peaks(gpus)  # what this revision needed on its GPUs (the plan's estimate, measured)
        # stages from the whole store in step order, applied to the complete record (PR included)
        self._tracker_before(rev).update(record)
        return record

    def _load(self, rev: Revision, path: Path | None, dtype: str, placement: Placement | None):
        """A local revision through its source's loader (HF, OLMo-core, LitGPT, Lightning); a hub one from its fetched folder."""
        if rev.path is not None:
            return self.s.source.load(rev, dtype=dtype, device=self.device)
        device_map = placement.device_map if placement is not None else {"": self.device}
        return load_model(str(path), dtype=dtype, device_map=device_map)

    def _tracker_before(self, rev: Revision) -> StageTracker:
        """A tracker fed every stored revision (any worker's) before ``rev`` in its lineage (its run, and a parallel run's
        main run before it), in training order as ``merged_records`` (the report) derives stages. Duplicates are skipped."""
        latest = {r["revision"]: r for r in self.store.ok_records(self.s.key) if r["revision"] != rev.name}
        here = {"revision": rev.name, "step": rev.step, "run": rev.run, "stage": rev.stage, "_this": True}
        points = [r for r in latest.values() if not r.get("duplicate_of")] + [here]
        tracker = StageTracker(self.monitor.config.stages)
        for r in lineage(points, rev.run):
            if r.get("_this"):
                break
            tracker.update(dict(r))
        return tracker

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
            # the ablation uses that revision's record
            row = self.store.read(done_key(self.s.key, name, rev.commit))
            if row is not None and row.get("status") == "failed":
                warnings.warn(f"sinkwatch replay: no ablation: its revision {name} failed; rerun to retry both", RuntimeWarning,
                              stacklevel=2)  # fmt: skip
            return
        task = f"ablation {name}"
        kept = self._kept[1] if self._kept is not None and self._kept[0].name == name else None
        attempt = attempts.begin(self.out_dir, task, root=self.fetch_config.cache_root, keep=self.fetch_config.keep_cache)
        try:
            run_ablation(
                self.monitor, self.s.recipe, name, out_dir=self.out_dir, key=self.s.key, dtype=self.s.dtype, device=self.device,
                cache_dir=self.cache_dir, bar=self.bar, commit=rev.commit,
                # loaded as the revisions are (fetched by commit, inside run_ablation's error handling)
                load=lambda _name, dt: self._load(rev, None if rev.path else (kept or self.fetcher.fetch(rev, attempt.folder)), dt, None),
            )  # fmt: skip
        finally:
            attempt.end()
            self._drop_kept(name)

    def _drop_kept(self, name: str | None = None) -> None:
        if self._kept is not None and (name is None or self._kept[0].name == name):
            self._kept[2].end()
            self._kept = None

    def _close(self, *, wait: bool) -> None:
        self._drop_kept()
        self.fetcher.close(wait=wait)
        if self.reporter is not None:
            self.reporter.finish()
        if self.bar is not None:
            self.bar.close()


# ---- helpers ------------------------------------------------------------------------------------------------------------------
def _first(probe, n: int):
    """The first ``n`` sequences of a probe (the induction probe draws sequentially: docs/design.md §3)."""
    if isinstance(probe, ProbeSet):
        return probe.subset(min(n, probe.n))
    return dataclasses.replace(probe, n=min(n, probe.n))


def _replay_wandb(mode: str, out_dir, recipe: Recipe, worker: Worker):
    """One W&B run per worker (named by the worker), grouped by the store."""
    if mode == "disabled":
        return None
    try:
        from ..reporters.wandb_run import wandb_reporter

        name = f"{recipe.name or recipe.model.split('/')[-1]} {worker.id}"
        return wandb_reporter(mode, project="sinkwatch-replay", dir=str(out_dir), init_kwargs={"name": name, "group": store_group(out_dir)})
    except ImportError:
        warnings.warn("sinkwatch replay: wandb is not installed; records are in the store only", RuntimeWarning, stacklevel=2)
        return None
