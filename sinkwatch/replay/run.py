"""Workers without an engine (docs/design.md §8): a deterministic stride of the manifest's tasks, then one pass over what is missing.

For plain processes sharing a store (one process, torchrun, ``srun -n``, hosts started by hand): they start N copies
of one command and schedule nothing, so the split is ours. Engines (Slurm arrays, submitit, Ray) run ``unit`` instead,
over the same manifest. Each worker runs ``replay``:

1. the plan: the store's manifest (the first worker into an empty ``--out`` writes it by exclusive create, so workers
   starting together agree on one), and the tasks this run asks for;
2. its stride: tasks ``rank, rank + world, ...``, from ``RANK``/``WORLD_SIZE``, ``SLURM_PROCID``/``SLURM_NTASKS`` or
   ``--shard i/n`` (none: all of them); each not recorded yet is measured (a failed one too: a rerun retries it), the
   next downloading while this one is probed. Live attempts are not skipped here: a requeue starts before the old
   process has died, and skipping would leave the task to a rerun;
3. one pass over the other tasks from the end of the list (where the other strides end): each with no row and no live
   attempt (``attempts.is_running``) is measured too. Two workers measuring one task record it once (exclusive
   create): a few measurements may be duplicated at the tail, never a record;
4. the group ablation, by the worker that recorded its revision (rank 0 when that was recorded before or never is).

No lease, no heartbeat: a hung worker holds only its own tasks, which a rerun measures; on a bare node a hang is the
user's to kill (an engine's time limit does it for you).

``replay_plan`` says what ``replay`` with the same options would do and cost, doing none of it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..models.placement import device_budgets
from . import attempts
from .ablation import ablation_key, check_ablation
from .devices import worker_device
from .manifest import Task
from .measure import Job, Measurer
from .options import PLAN, REPLAY, ReplayOptions
from .plan import Plan, make_plan
from .prepare import ablation_at, prepare_replay
from .progress import _status
from .recipes import Recipe
from .signals import Terminated, exit_terminated, terminate_cleanly
from .store import done_key, key_of, record_done_key, stored_records
from .workers import detect_worker


# ---- the public entry points ------------------------------------------------------------------------------------
def replay(model: str | Recipe, *, options: ReplayOptions | None = None, **kwargs) -> list[dict]:
    """Replay revisions of a hub model (or a ``Recipe``, or a local folder of checkpoints: ``sinkwatch.replay.local``)
    into the store ``out_dir``; returns the rows this worker wrote (ok, failed, skipped). Run it in as many processes as
    you like, on any hosts sharing ``out_dir`` (the module doc; ``shard=(i, n)``: the stride when no launcher gives
    one). Under an engine use ``replay_revision``.

    Options: ``options=ReplayOptions(...)`` and/or its fields as keywords laid over it (an unknown one, or one only
    ``replay_plan`` reads, is a TypeError); ``ReplayOptions`` says what each does. Revisions come from the recipe,
    ``revisions``, or the hub's refs (``all_revisions``, ``log_spaced``). The first run into an empty ``out_dir``
    writes the plan (``DIR/manifest.json``); later runs use it and ask the hub nothing; another selection, a moved
    branch or a rewritten local checkpoint needs ``rewrite_manifest=True``.

    Each record carries its commit, weights fingerprint, versions and device; revisions whose weights are not their
    own are flagged (``duplicate_of``; ``skip_duplicates``: not measured). ``protocol``: "paper" is Xu 2026's precision
    (docs/design.md §8), "sinkwatch" float32 statistics and PR over every sequence; a store of records made with another
    protocol, dtype, model or probe set is refused (``StoreMismatchError``). ``ablate``: the group ablation at ``ablation_revision`` once it
    is recorded, into ``DIR/ablation.json`` (``run_ablation``).
    """
    o = ReplayOptions.given(options, kwargs, reader=REPLAY, what="replay()")
    s = prepare_replay(model, o, manifest="use", running=attempts.running(o.out_dir))
    s.ablation = ablation_at(s, o)
    if s.ablation is not None:
        check_ablation(o.out_dir, ablation_key(s.key, s.ablation))  # refused before anything is probed
    loop = _Loop(s, **o.loop(progress=True))
    return loop.run(stride(o.shard))


def stride(shard: tuple[int, int] | None = None) -> tuple[int, int]:
    """(rank, world) of this worker: ``shard``, else its launcher's (torchrun, srun), else (0, 1)."""
    if shard is not None:
        return shard
    w = detect_worker()
    if w.launcher == "local-rank":
        warnings.warn(
            f"sinkwatch replay: LOCAL_RANK={w.local_rank} without WORLD_SIZE: this process is one worker of an unknown number; "
            "it measures every task not recorded yet (set RANK and WORLD_SIZE, or --shard i/n, to split them)", RuntimeWarning,
            stacklevel=3,
        )  # fmt: skip
        return 0, 1
    return w.index, w.count or 1


def replay_plan(model: str | Recipe, *, options: ReplayOptions | None = None, **kwargs) -> Plan:
    """What ``replay`` with these options would do and cost (``plan.format_plan`` prints it), downloading only file
    metadata and a config.json, writing nothing. Options as ``replay``'s plus the estimate's (``workers``,
    ``bandwidth_mb_s``, ``tflops``); replay's ``options=`` object is taken whole."""
    o = ReplayOptions.given(options, kwargs, reader=PLAN, what="replay_plan()")
    s = prepare_replay(model, o, manifest="peek")
    worker = detect_worker()
    # done as the loop decides it: by done key (a moved branch, a rewritten checkpoint: to do again)
    stored = {record_done_key(r) for r in stored_records(o.out_dir) if key_of(r) == s.key} if Path(o.out_dir).is_dir() else set()
    order = {n: i for i, n in enumerate(s.manifest.revisions)}
    planned = sorted((r for t in s.tasks for r in s.needed(t)), key=lambda r: order[r.name])  # training order
    done = {r.name for r in planned if done_key(s.key, r.name, r.commit) in stored}
    workers = o.workers
    if workers is None:
        rank, world = o.shard or (worker.index, worker.count or 1)
        workers, source = world, ("from " + worker.launcher if worker.launcher != "single" else "this process alone; --workers N")
        if o.shard is not None:
            source = "--shard"
    else:
        source = "--workers"
    dev = worker_device(o.device, worker)
    return make_plan(
        s.recipe.model, planned, done=done, dtype=s.dtype, protocol=s.protocol, batch_tokens=s.cfg.batch_tokens, probes=s.probes,
        workers=workers, worker_source=source, cache_dir=o.cache_dir, fetch=o.fetch, device=dev,
        budgets=device_budgets(dev, o.max_memory, worker.local_rank), **({"bandwidth_mb_s": o.bandwidth_mb_s} if o.bandwidth_mb_s else {}),
        tflops=o.tflops, ablation=o.ablation_revision or s.recipe.ablation_revision,
        duplicates={name: group.duplicate_of for name, group in s.flags.items()}, tasks=len(s.tasks),
    )  # fmt: skip


# ---- one worker's loop ---------------------------------------------------------------------------------------------
class _Loop(Measurer):
    """A stride of the tasks, then one pass over what is missing (see the module doc); then the ablation, if due."""

    def run(self, rank_world: tuple[int, int]) -> list[dict]:
        rank, world = rank_world
        tasks = self.s.tasks
        mine = tasks[rank::world]
        others = [t for t in reversed(tasks) if t not in mine]  # from where the other strides end
        ablated = self._ablation_revision_task()
        # the ablation is run by whoever records its revision now; by rank 0 when that happened before (or never will)
        self.ablate_due = rank == 0 and (ablated is None or all(self.store.is_done(self.key(r)) for r in self.s.needed(ablated)))
        with terminate_cleanly():
            try:
                return self._run(mine, others)
            except Terminated as exc:  # _run wrote the failed rows and ended the attempts; a download thread is not waited for
                exit_terminated(exc)
                raise

    def _ablation_revision_task(self) -> Task | None:
        if self.s.ablation is None:
            return None
        return next((t for t in self.s.tasks if self.s.ablation in t.members), None)

    def _candidates(self, mine: list[Task], others: list[Task]):
        for t in mine:
            yield t
        for t in others:  # the pass: only tasks nobody has begun or recorded anything for
            if attempts.is_running(self.out_dir, t.name):
                continue
            if any(self.store.read(self.key(r)) is not None for r in self.s.needed(t)):
                continue
            yield t

    def _next(self, it) -> Job | None:
        for task in it:
            job = self._start(task)
            if job is not None:
                return job
        return None

    def _run(self, mine: list[Task], others: list[Task]) -> list[dict]:
        rows: list[dict] = []
        it = self._candidates(mine, others)
        try:
            nxt = self._next(it)
            while nxt is not None:
                job, nxt = nxt, None
                path = self._await(job)
                nxt = self._next(it)  # the next one downloads while this one is probed
                rows += self._measure(job, path)
                if self.s.ablation is not None and self.s.ablation in job.written:
                    self.ablate_due = True
                self._end(job)
                self._progress()
            if self.ablate_due:
                self._ablation()
        except BaseException as exc:
            self.abandon(exc)
            self._close(wait=False)  # interrupted: do not wait for a download in flight
            raise
        self._close(wait=True)
        return rows

    def _progress(self) -> None:
        if self.bar is not None:
            self.bar.n = sum(all(self.store.is_done(self.key(r)) for r in self.s.needed(t)) for t in self.s.tasks)
            self.bar.refresh()
            _status(self.bar, "-", "")
