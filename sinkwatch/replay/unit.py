"""The engines' side of replay (docs/design.md §8): the manifest written once, a thin per-task unit, and finalize.

Slurm arrays, submitit and Ray already schedule, time-limit and retry tasks; replay gives them:

- ``write_manifest`` (``--manifest-only``): the driver's one look at the hub: the plan, named tasks, written once;
- ``replay_revision`` (``--task N``: the N-th task of the written list): reads the manifest, lists nothing, records
  every member of its task not recorded yet, downloading into the task's own folder (``attempts``); a failure, SIGTERM
  (a Slurm time limit) or KeyboardInterrupt (Ray's cancel) writes the failed rows, then ``RevisionFailed`` is raised;
- ``failed_tasks``: the tasks with a member not recorded, to resubmit;
- ``finalize`` (``--finalize``, after the tasks): failed rows for attempts killed without a word, task folders swept,
  stages derived over the whole store in step order (``DIR/trajectory.json``), the group ablation run once, and what
  failed or is missing listed.
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
    """Place, fetch, measure, write one task, reading of the store only its own keys (finalize derives the stages)."""

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
    """Write the plan to ``DIR/manifest.json`` (the driver, once, before the tasks): refs, commits, fingerprints of every
    listed revision, duplicate groups over the whole run, the named tasks. A manifest that plans this selection is
    returned as it is (no hub request); ``rewrite=True`` updates it (new revisions appended as tasks, moved branches
    fingerprinted again, existing tasks keep their names and indices), refused while a task is running."""
    o = _options(out_dir, options, {**kwargs, **({"rewrite_manifest": True} if rewrite else {})}, "write_manifest()")
    s = prepare_replay(model, o, manifest="use", running=attempts.running(out_dir) if Path(out_dir).is_dir() else {})
    return s.manifest


def replay_revision(model, task, *, out_dir: str | os.PathLike, options: ReplayOptions | None = None, **kwargs) -> dict:
    """Measure one task of the manifest into ``out_dir``: the unit an engine maps over the task names (Ray, submitit,
    Slurm arrays via ``--task``). ``task``: a task name or a revision a task holds (whose record is returned; for a
    task name, its first member's). Reads ``DIR/manifest.json`` (absent: a ValueError naming the command that writes
    it), lists nothing, and records every member not recorded yet (identical weights measured once, an earlier
    attempt's record reused). A failure writes the failed rows, then raises ``RevisionFailed``."""
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
        raise RevisionFailed(f"{s.recipe.model} task {t.name} ({', '.join(r.name for r in missing)}) failed: {error} "
                             f"(its failed rows are in {Path(out_dir) / 'records'})")  # fmt: skip
    return store.read(done_key(s.key, asked.name, asked.commit))


def failed_tasks(model, *, out_dir: str | os.PathLike, options: ReplayOptions | None = None, **kwargs) -> list[str]:
    """The tasks to resubmit: those with a member not recorded (failed, killed, never run); ``Manifest.index_of`` gives
    their array indices. A task an engine's limit ended twice in a row is left out (it would end again): ``finalize``
    lists it under ``over_limit`` with the limit to ask for."""
    s = prepare_replay(model, _options(out_dir, options, kwargs, "failed_tasks()"), manifest="require")
    store = ReplayStore(out_dir)
    rows = {t.name: [store.read(done_key(s.key, r.name, r.commit)) for r in s.needed(t)] for t in s.manifest.task_list}
    return [n for n, got in rows.items() if not all(r is not None and r.get("status", "ok") != "failed" for r in got)
            and not any(over_limit(r) for r in got)]  # fmt: skip


def over_limit(row: dict | None) -> bool:
    """An engine's limit ended two attempts in a row: resubmitted with the same limit it would end the same way."""
    return row is not None and row.get("status") == "failed" and (row.get("limit") or {}).get("count", 0) >= 2


def finalize(model, *, out_dir: str | os.PathLike, options: ReplayOptions | None = None, **kwargs) -> dict:
    """After the tasks (a job on ``afterany``, never beside running tasks): failed rows for the members an attempt killed
    without a word (SIGKILL) did not record, the task folders swept (unless ``keep_cache``), stages derived over the
    store in step order (``DIR/trajectory.json``), the group ablation run once (as ``replay`` decides it). An attempt
    still alive (a requeue, a late task) is left alone, listed under ``running``. Returns ``{"done", "failed": {revision: error},
    "missing", "skipped", "killed", "running", "over_limit": {revision: {"after_s", "stage", "count", "task",
    "ask_min"}}, "trajectory", "ablation"}``."""
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
