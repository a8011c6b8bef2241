"""The engines' side of replay (SPEC §8): the manifest written once, a thin per-revision unit, and finalize.

Slurm arrays, submitit and Ray already schedule, time-limit and retry tasks; replay gives them:

- ``write_manifest`` (``sinkwatch replay MODEL --out DIR --manifest-only``): the driver's one look at
  the hub (``manifest``), and the tasks: revisions grouped by identical weights;
- ``replay_revision(model, revision, out_dir=...)`` (``--task N``): reads the manifest, lists nothing,
  claims nothing, measures the revision's task once and writes one record file per member; a failure
  writes the failed row and raises ``RevisionFailed`` (so the engine's retry applies); SIGTERM (the
  engine's time limit) writes the failed row too. The cache is the task's own (a temporary folder,
  deleted at the end) unless ``cache_dir`` is given, where only the blobs no other manifest entry
  lists are deleted;
- ``finalize`` (``--finalize``): stages derived over the whole store in step order
  (``DIR/trajectory.json``), the group ablation run once, and the revisions that failed or are missing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..stages import StageTracker
from .claims import ClaimConfig
from .fetch import FetchConfig
from .manifest import MANIFEST_FILE, Manifest, write_atomic
from .measure import Measurer
from .prepare import prepare_replay
from .revisions import Revision
from .signals import Terminated, exit_terminated, terminate_cleanly
from .store import ReplayStore, done_key, failed_revisions, merged_records

_SETUP = ("probes", "dtype", "tokens_per_step", "batch_tokens", "monitor_config", "protocol", "lightning_module", "live_store")
_LOOP = ("device", "wandb", "progress", "max_memory")
_IGNORED = ("revisions", "log_spaced", "shard", "claims", "skip_duplicates", "ablate", "ablation_revision")  # replay's, meaningless here


class _NoClaims:
    """The unit's claims: an engine gives each revision to one task, so there is nothing to claim."""

    config = ClaimConfig()
    _held: dict = {}

    def try_claim(self, item, info=None) -> bool:
        return True

    def lost(self, item) -> bool:
        return False

    def failed_this_job(self, item) -> bool:
        return False

    def release(self, item, *, failed: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


class _UnitLoop(Measurer):
    """The replay loop's parts (place, fetch, measure, write, evict) for one task: no claims, nothing read
    of the store but its own keys (finalize derives the stages in step order)."""

    def _check_store(self) -> None:
        pass  # the manifest was written for this key (manifest.require_manifest) after the store's check

    def _claims(self, out_dir, config):
        return _NoClaims()

    def _tracker_before(self, rev: Revision) -> StageTracker:
        return StageTracker(self.monitor.config.stages)

    def measure_task(self, rev: Revision, members: Sequence[Revision], measured: dict | None = None) -> dict[str, dict]:
        """Measure ``rev`` once (or take its stored record, ``measured``) and write a record for each member
        of its task (revisions with identical weights): the same numbers under each one's own name,
        commit and flags (``measured_as``: the revision that was probed). Returns name -> row."""
        row = measured
        if row is None:
            job = self._start(rev)
            path = self._await(job)
            row = self._measure(job, path)
            self._done_with(job, path)
        rows = {rev.name: row}
        for m in members:
            if m.name == rev.name:
                continue
            if self.store.is_done(done_key(self.s.key, m.name, m.commit)):
                continue
            copy = {k: v for k, v in row.items() if k not in ("written_at", "run", "stage", "path", "duplicate_group", "duplicate_kind")}
            copy.update({"revision": m.name, "step": m.step, "tokens": m.tokens, **self._about(m), "measured_as": rev.name})
            self.store.write(copy)
            rows[m.name] = copy
        return rows

    def write_failed(self, revs: Sequence[Revision], exc: BaseException) -> None:
        """Failed rows for ``revs`` (the unit's task, interrupted by ``exc``)."""
        recipe = self.s.recipe
        for rev in revs:
            self.store.write({
                "model": recipe.model, "revision": rev.name, "step": rev.step, "tokens": rev.tokens, "dtype": self.s.dtype,
                "replay_key": self.s.key, **self._about(rev), "status": "failed", "error": f"{type(exc).__name__}: {exc}",
            })  # fmt: skip


class RevisionFailed(RuntimeError):
    """A revision's measurement failed; its failed row is in the store (an engine may retry the task)."""


def _split(options: dict, allowed: tuple[str, ...], what: str) -> tuple[dict, dict, FetchConfig, str | None]:
    unknown = sorted(set(options) - set(_SETUP) - set(_LOOP) - {"fetch", "cache_dir"} - set(allowed))
    if unknown:
        takes = ", ".join((*_SETUP, *_LOOP, "fetch", "cache_dir"))
        raise TypeError(f"{what} got unexpected options {unknown}; it takes replay's options ({takes})")
    setup = {k: options.get(k) for k in _SETUP}
    loop = {"device": options.get("device"), "wandb": options.get("wandb", "disabled"), "progress": options.get("progress", False),
            "max_memory": options.get("max_memory")}  # fmt: skip
    return setup, loop, options.get("fetch") or FetchConfig(), options.get("cache_dir")


def write_manifest(model, *, out_dir, revisions=None, log_spaced=None, cache_dir=None, skip_duplicates=False, **options) -> Manifest:
    """Compute ``DIR/manifest.json`` for this replay (the driver, once, before the tasks start): refs,
    commits, fingerprints of every listed revision, duplicate groups over the whole run, tasks. A
    revision already in an earlier manifest at the same commit is not asked about again."""
    setup, _, _, _ = _split(options, ("ablate", "ablation_revision", "progress", "wandb", "claims", "shard"), "write_manifest")
    s = prepare_replay(model, revisions=revisions, log_spaced=log_spaced, cache_dir=cache_dir, shard=None, skip_duplicates=skip_duplicates,
                       out_dir=out_dir, manifest="refresh", **setup)  # fmt: skip
    ReplayStore(out_dir).check(s.key)  # a store of another measurement is refused before any task starts
    return s.manifest


def _name(revision) -> str:
    return revision.name if isinstance(revision, Revision) else str(revision)


def replay_revision(model, revision, *, out_dir: str | os.PathLike, **options) -> dict:
    """Measure one revision into the store ``out_dir`` and return its record: the unit an engine maps
    over the manifest's tasks (Ray tasks, submitit jobs, Slurm array tasks via ``--task``). Reads
    ``DIR/manifest.json`` (a ValueError naming the command that writes it, when absent), lists
    nothing, claims nothing. Revisions with identical weights (one task) are measured once, each
    getting its own record. A revision done already returns its stored record; a failure writes the
    failed row, then raises ``RevisionFailed``."""
    setup, loop_opts, fetch, cache_dir = _split(options, _IGNORED, "replay_revision")
    name = _name(revision)
    s = prepare_replay(
        model, revisions=[name], log_spaced=None, cache_dir=cache_dir, shard=None, out_dir=out_dir, manifest="require", **setup
    )
    m: Manifest = s.manifest
    task = m.task_of(name)
    revs = {r.name: r for r in s.revisions}
    store = ReplayStore(out_dir)
    keys = {n: done_key(s.key, n, revs[n].commit) for n in task}
    if store.is_done(keys[name]):
        return store.read(keys[name])
    own_cache = cache_dir is None  # a task's own cache: whatever it downloads goes with it
    cache = tempfile.mkdtemp(prefix="sinkwatch-task-") if own_cache else cache_dir
    protect = set() if own_cache else m.blobs_except(task)  # blobs other revisions list stay in a shared cache
    s.mine = [revs[task[0]]]
    loop = _UnitLoop(s, out_dir=out_dir, cache_dir=cache, fetch=fetch, claims=None, protect=protect, **loop_opts)
    rows: dict[str, dict] = {}
    try:
        with terminate_cleanly() as ours:
            try:
                measured = store.read(keys[task[0]]) if store.is_done(keys[task[0]]) else None
                rows = loop.measure_task(revs[task[0]], [revs[n] for n in task], measured=measured)
            except Terminated as exc:
                loop.write_failed([revs[n] for n in task if not store.is_done(keys[n])], exc)
                loop._close(wait=False)
                if own_cache:
                    shutil.rmtree(cache, ignore_errors=True)
                if ours:
                    exit_terminated(exc)
                raise
            except BaseException:
                loop._close(wait=False)
                raise
        loop._close(wait=True)
    finally:
        if own_cache:
            shutil.rmtree(cache, ignore_errors=True)
    row = rows.get(name) or store.read(keys[name])
    if row is None or row.get("status") != "ok":
        error = (row or {}).get("error", "no record written")
        raise RevisionFailed(f"{s.recipe.model}@{name} failed: {error} (its failed row is in {Path(out_dir) / 'records'})")
    return row


def failed_tasks(model, *, out_dir: str | os.PathLike, **options) -> list[int]:
    """Indices of the manifest's tasks with a revision not done (failed, killed by a time limit, never run):
    what to resubmit (``sbatch --array=...``)."""
    setup, _, _, cache_dir = _split(options, ("claims", "shard", "skip_duplicates", "ablate", "ablation_revision"), "failed_tasks")
    s = prepare_replay(
        model, revisions=None, log_spaced=None, cache_dir=cache_dir, shard=None, out_dir=out_dir, manifest="require", **setup
    )
    store = ReplayStore(out_dir)
    revs = {r.name: r for r in s.revisions}
    return [i for i, task in enumerate(s.manifest.tasks()) if not all(store.is_done(done_key(s.key, n, revs[n].commit)) for n in task)]


def finalize(model, *, out_dir: str | os.PathLike, ablate: bool | None = None, ablation_revision: str | None = None, **options) -> dict:
    """After the tasks (a job on ``afterany``): derive the stages over the whole store in step order into
    ``DIR/trajectory.json``, run the group ablation once (as ``replay`` decides it), and say which of the
    manifest's revisions failed or are missing. Returns ``{"done", "failed": {revision: error}, "missing",
    "trajectory", "ablation"}``."""
    from .ablation import ablation_key, check_ablation, read_ablation

    setup, loop_opts, fetch, cache_dir = _split(options, ("claims", "shard", "skip_duplicates"), "finalize")
    s = prepare_replay(
        model, revisions=None, log_spaced=None, cache_dir=cache_dir, shard=None, out_dir=out_dir, manifest="require", **setup
    )
    store = ReplayStore(out_dir)
    errors = failed_revisions(out_dir)
    done, failed, missing = [], {}, []
    for r in s.revisions:
        if store.is_done(done_key(s.key, r.name, r.commit)):
            done.append(r.name)
        elif r.name in errors:
            failed[r.name] = errors[r.name]
        else:
            missing.append(r.name)
    records = merged_records(out_dir)
    fields = ("revision", "step", "tokens", "run", "p0_stage", "induction_state")
    trajectory = [{k: r.get(k) for k in fields} for r in records]
    s.ablation = ablation_revision or s.recipe.ablation_revision
    if ablate is None:
        ablate = s.protocol == "paper" and s.ablation is not None
    ablation = None
    if ablate:
        s.ablation = s.ablation or s.revisions[-1].name
        check_ablation(out_dir, ablation_key(s.key, s.ablation))
        loop = _UnitLoop(s, out_dir=out_dir, cache_dir=cache_dir, fetch=fetch, claims=None, **loop_opts)
        try:
            loop._ablation()
        finally:
            loop._close(wait=True)
        ablation = read_ablation(out_dir)
    summary = {"done": done, "failed": failed, "missing": missing, "trajectory": trajectory, "ablation": ablation}
    write_atomic(Path(out_dir) / "trajectory.json", {k: v for k, v in summary.items() if k != "ablation"})
    return summary


__all__ = ["MANIFEST_FILE", "RevisionFailed", "failed_tasks", "finalize", "replay_revision", "write_manifest"]
