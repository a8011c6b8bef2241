"""The engines' side of replay (docs/design.md §8): the manifest written once, a thin per-task unit, and finalize.

Slurm arrays, submitit and Ray already schedule, time-limit and retry tasks; replay gives them:

- ``write_manifest`` (``sinkwatch replay MODEL --out DIR --manifest-only``): the driver's one look at
  the hub (``manifest``): the plan, an ordered list of named tasks, written once;
- ``replay_revision(model, task, out_dir=...)`` (``--task N``: the N-th task of the written list): reads
  the manifest, lists nothing, and writes a record for every member of its task not recorded yet
  (measured once); a failure writes the failed rows and raises ``RevisionFailed`` (the engine's retry,
  or a resubmission, applies); SIGTERM (a Slurm time limit) and KeyboardInterrupt (Ray's cancel)
  write them too. It downloads into the task's own folder (``attempts``);
- ``failed_tasks``: the tasks with a member not recorded, to resubmit;
- ``finalize`` (``--finalize``, after the tasks): attempts killed without a word get their failed rows,
  what they left in the task folders is swept, the stages are derived over the whole store in step
  order (``DIR/trajectory.json``), the group ablation runs once, and it says what failed or is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..stages import StageTracker
from . import attempts
from .manifest import MANIFEST_FILE, Manifest, Task, array_range, write_atomic
from .measure import Measurer
from .merged import merged_records
from .options import UNIT, ReplayOptions
from .prepare import ablation_at, prepare_replay
from .revisions import Revision
from .signals import Terminated, exit_terminated, terminate_cleanly
from .store import ReplayStore, ask_min, done_key


class _UnitLoop(Measurer):
    """The measuring parts (place, fetch, measure, write) for one task: nothing read of the store but its
    own keys (finalize derives the stages in step order)."""

    def _check_store(self) -> None:
        pass  # the driver checked the store when it wrote the manifest

    def _tracker_before(self, rev: Revision) -> StageTracker:
        return StageTracker(self.monitor.config.stages)


class RevisionFailed(RuntimeError):
    """A task's measurement failed; its failed rows are in the store (an engine may retry the task)."""


def _options(out_dir, options: ReplayOptions | None, kwargs: dict, what: str) -> ReplayOptions:
    """The options of an engine's step: replay's (a driver passes one set to every step); the selection is the manifest's."""
    return ReplayOptions.given(options, {**kwargs, "out_dir": out_dir}, reader=UNIT, what=what)


def write_manifest(model, *, out_dir, rewrite: bool = False, options: ReplayOptions | None = None, **kwargs) -> Manifest:
    """The plan of this replay in ``DIR/manifest.json`` (the driver, once, before the tasks start): refs,
    commits, fingerprints of every listed revision, duplicate groups over the whole run, and the named
    tasks. An existing manifest that plans this selection is returned as it is (no hub request);
    ``rewrite=True`` (``rewrite_manifest``) updates it — new revisions appended as new tasks, moved branches
    fingerprinted again, every existing task kept under its name and index — and is refused while a task is running."""
    o = _options(out_dir, options, {**kwargs, **({"rewrite_manifest": True} if rewrite else {})}, "write_manifest()")
    s = prepare_replay(model, o, manifest="use", running=attempts.running(out_dir) if Path(out_dir).is_dir() else {})
    return s.manifest


def replay_revision(model, task, *, out_dir: str | os.PathLike, options: ReplayOptions | None = None, **kwargs) -> dict:
    """Measure one task of the manifest into the store ``out_dir`` and return a record: the unit an engine
    maps over the manifest's task names (Ray tasks, submitit jobs, Slurm array tasks via ``--task``).
    ``task``: a task name (``Manifest.task_names()``) or a revision a task holds (its record is returned;
    for a task name, its first member's). Reads ``DIR/manifest.json`` (a ValueError naming the command
    that writes it, when absent), lists nothing. Writes a record for every member not recorded yet —
    those with identical weights measured once, a member recorded by an earlier attempt not measured
    again. A failure writes the failed rows, then raises ``RevisionFailed``."""
    o = _options(out_dir, options, kwargs, "replay_revision()")
    s = prepare_replay(model, o, manifest="require")
    name = task.name if isinstance(task, (Revision, Task)) else str(task)
    t = s.manifest.find_task(name)
    s.tasks = [t]
    store = ReplayStore(out_dir)
    needed = s.needed(t)
    asked = s.rev(name) if name in t.members else (needed or [s.rev(t.members[0])])[0]
    if all(store.is_done(done_key(s.key, r.name, r.commit)) for r in needed):
        return store.read(done_key(s.key, asked.name, asked.commit))
    loop = _UnitLoop(s, **o.loop(progress=False))
    with terminate_cleanly() as ours:
        try:
            job = loop._start(t)
            if job is not None:
                loop._measure(job, loop._await(job))
                loop._end(job)
        except BaseException as exc:
            loop.abandon(exc, every=True)  # its failed rows first (a SIGTERM's SIGKILL follows after KillWait)
            loop._close(wait=False)
            if isinstance(exc, Terminated) and ours:
                exit_terminated(exc)
            raise
    loop._close(wait=True)
    missing = [r for r in needed if not store.is_done(done_key(s.key, r.name, r.commit))]
    if missing:
        row = store.read(done_key(s.key, missing[0].name, missing[0].commit)) or {}
        error = row.get("error", "no record written")
        raise RevisionFailed(
            f"{s.recipe.model} task {t.name} ({', '.join(r.name for r in missing)}) failed: {error} "
            f"(its failed rows are in {Path(out_dir) / 'records'})"
        )
    return store.read(done_key(s.key, asked.name, asked.commit))


def failed_tasks(model, *, out_dir: str | os.PathLike, options: ReplayOptions | None = None, **kwargs) -> list[str]:
    """Names of the manifest's tasks with a member not recorded (failed, killed, never run): what to
    resubmit. ``Manifest.index_of`` (or the CLI's ``--failed-tasks``) gives their array indices. A task an
    engine's limit ended twice in a row is left out (the same limit would end it again): ``finalize`` lists
    it under ``over_limit`` with the limit to ask for."""
    s = prepare_replay(model, _options(out_dir, options, kwargs, "failed_tasks()"), manifest="require")
    store = ReplayStore(out_dir)
    rows = {t.name: [store.read(done_key(s.key, r.name, r.commit)) for r in s.needed(t)] for t in s.manifest.task_list}
    return [n for n, got in rows.items() if not all(r is not None and r.get("status", "ok") != "failed" for r in got)
            and not any(over_limit(r) for r in got)]  # fmt: skip


def over_limit(row: dict | None) -> bool:
    """An engine's limit ended two attempts in a row: resubmitted with the same limit it would end the same way."""
    return row is not None and row.get("status") == "failed" and (row.get("limit") or {}).get("count", 0) >= 2


def finalize(model, *, out_dir: str | os.PathLike, options: ReplayOptions | None = None, **kwargs) -> dict:
    """After the tasks (a job on ``afterany``, never beside running tasks): an attempt that began and never
    ended (killed by SIGKILL) gets a failed row for each member it did not record, what attempts left in
    the task folders is swept (unless ``keep_cache``), the stages are derived over the whole store in step
    order (``DIR/trajectory.json``), the group ablation runs once (as ``replay`` decides it), and it says
    which planned revisions failed or are missing. An attempt still alive (a requeue, a late task) is left
    alone and listed under ``running``. Returns ``{"done", "failed": {revision: error}, "missing", "skipped",
    "killed", "running", "over_limit": {revision: {"after_s", "stage", "count", "task", "ask_min"}},
    "trajectory", "ablation"}``."""
    from .ablation import ablation_key, check_ablation, read_ablation

    o = _options(out_dir, options, kwargs, "finalize()")
    s = prepare_replay(model, o, manifest="require")
    fetch = o.fetch
    store = ReplayStore(out_dir)
    m = s.manifest
    loop = _UnitLoop(s, **o.loop(progress=False))
    killed, live = [], []
    for mark in attempts.markers(out_dir):  # a live attempt (beside finalize: a requeue, a late task) writes its own outcome
        if mark.alive():
            live.append(mark.task)
            continue
        task = next((t for t in m.task_list if t.name == mark.task), None)
        for r in s.needed(task) if task is not None else ():
            row = store.read(done_key(s.key, r.name, r.commit))
            if row is None or (row.get("status") == "failed" and (row.get("written_at") or 0) < mark.info.get("started_at", 0)):
                store.write({**loop._base(r), "status": "failed", "error": attempts.killed_error(mark.info)})
                killed.append(r.name)
        mark.remove(fetch.cache_root, folder=not fetch.keep_cache)
    if not fetch.keep_cache:
        attempts.sweep(out_dir, [*m.task_names(), *(f"ablation {n}" for n in m.entries)], root=fetch.cache_root)
    done, failed, missing, skipped, over = [], {}, [], [], {}
    for t in m.task_list:
        for n in t.members:
            r = s.rev(n)
            row = store.read(done_key(s.key, n, r.commit))
            if row is not None and row.get("status") == "skipped" or (s.skip_duplicates and n in s.flags):
                skipped.append(n)
            elif row is not None and row.get("status", "ok") == "ok":
                done.append(n)
            elif row is not None:
                failed[n] = row.get("error", "")
                if over_limit(row):
                    lim = row["limit"]
                    over[n] = {**lim, "task": m.index_of(t.name), "ask_min": ask_min(lim)}
            else:
                missing.append(n)
    records = merged_records(out_dir)
    fields = ("revision", "step", "tokens", "run", "p0_stage", "induction_state")
    trajectory = [{k: r.get(k) for k in fields} for r in records]
    s.ablation = ablation_at(s, o)
    ablation = None
    if s.ablation is not None:
        check_ablation(out_dir, ablation_key(s.key, s.ablation))
        try:
            loop._ablation()
        finally:
            loop._close(wait=True)
        ablation = read_ablation(out_dir)
    else:
        loop._close(wait=True)
    order = {n: i for i, n in enumerate(m.revisions)}
    summary = {"done": sorted(done, key=order.get), "failed": failed, "missing": missing, "skipped": skipped, "killed": killed,
               "running": sorted(set(live)), "over_limit": over, "trajectory": trajectory, "ablation": ablation}  # fmt: skip
    write_atomic(Path(out_dir) / "trajectory.json", {k: v for k, v in summary.items() if k != "ablation"})
    return summary


__all__ = ["MANIFEST_FILE", "RevisionFailed", "array_range", "failed_tasks", "finalize", "replay_revision", "write_manifest"]
