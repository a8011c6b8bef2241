"""The replay loop (SPEC §8): revisions claimed in the store, fetched one ahead, probed, written, evicted.

This is the claim mode, for plain processes (torchrun, ``srun -n``, hosts started by hand); engines
(Slurm arrays, submitit, Ray) run the per-revision unit of ``unit`` instead, over the manifest's tasks.

One worker, whatever launched it, runs ``replay``:

1. the revisions to replay, in training order (``prepare``; ``--shard K/N`` keeps every N-th: a static split);
2. ``claim``: the first revision not done anywhere in the store, not failed in this job and not held
   live by another worker is claimed (``claims``); with none left but some held by others, the worker
   waits for them (a stale claim is taken over), then runs the ablation if it is due;
3. each claimed revision is placed, fetched, measured, written and evicted (``measure``); the next one
   is claimed and starts downloading as soon as the current one is on disk, so probing and downloading
   overlap.

``replay_plan`` says what ``replay`` with the same options would do and cost, doing none of it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from ..monitor import MonitorConfig
from .ablation import ablation_key, check_ablation
from .claims import ClaimConfig
from .devices import worker_device
from .fetch import FetchConfig
from .measure import Job, Measurer
from .plan import Plan, device_budgets, make_plan
from .prepare import prepare_replay
from .progress import _status
from .recipes import Recipe
from .revisions import Revision
from .signals import Terminated, exit_terminated, terminate_cleanly
from .store import done_key, key_of, record_done_key, stored_records
from .workers import detect_worker

_WAIT = object()  # every remaining revision is held by another live worker


# ---- the public entry points ------------------------------------------------------------------------------------
def replay(
    model: str | Recipe,
    *,
    revisions: Sequence[str | Revision] | None = None,
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
    fetch: FetchConfig | None = None,
    claims: ClaimConfig | None = None,
    max_memory: int | str | None = None,
    lightning_module: str | None = None,
    live_store: str | None = None,
    skip_duplicates: bool = False,
) -> list[dict]:
    """Replay revisions of a hub model (or a ``Recipe``) into the store ``out_dir``; returns the rows
    this worker wrote (ok and failed). Run it in as many processes as you like, on any hosts sharing
    ``out_dir``: the claim mode (best effort: each revision is recorded once, and measured once unless a
    claim is taken over from a worker that was only slow; under an engine use ``replay_revision``).

    Revisions come from the recipe, ``revisions``, or ``list_repo_refs`` (+ ``log_spaced``), and are
    replayed in training order. ``shard=(K, N)`` keeps every N-th from K (a static split). ``model``
    may also be a local folder of checkpoints (``sinkwatch.replay.local``: HF Trainer, save_pretrained,
    OLMo-core, Lightning ``.ckpt`` with ``lightning_module="pkg.module:Class"``; ``live_store``: the
    live run's store, whose ``probes.json`` gives its probe sets). Each record carries the commit its
    branch resolved to, a fingerprint of its weights, the versions and the device; revisions whose
    weights are not their own are flagged (``duplicate_of``) and, with ``skip_duplicates``, not measured.

    ``protocol``: "paper" reproduces Xu 2026's precision choices (SPEC §8: float16 models probed
    through eager float16 attention, PR from a float16 pass over the first 500 sequences), "sinkwatch"
    keeps float32 statistics and PR over every sequence; default: the recipe's. A store that holds
    records made with another protocol, dtype, model or probe set is refused (``StoreMismatchError``).

    ``ablate``: once the revisions are done, the group ablation of the >= 50x induction circuit at
    ``ablation_revision`` (default: the recipe's; without one, the last revision) goes to
    ``DIR/ablation.json`` (``run_ablation``), run once by whichever worker claims it. Default: on
    under protocol "paper" when the recipe names an ablation revision (the packaged recipes do).

    ``fetch``: retries, prefetch and eviction (``FetchConfig``: ``keep_cache=True`` keeps what is
    downloaded); ``claims``: heartbeat and staleness of claims (``ClaimConfig``); ``max_memory``
    (``"24GiB"``): the memory each device may use, instead of what it has free.
    """
    fetch = fetch or FetchConfig()
    s = prepare_replay(
        model,
        revisions=revisions,
        log_spaced=log_spaced,
        probes=probes,
        dtype=dtype,
        tokens_per_step=tokens_per_step,
        batch_tokens=batch_tokens,
        monitor_config=monitor_config,
        protocol=protocol,
        cache_dir=cache_dir,
        shard=shard,
        lightning_module=lightning_module,
        live_store=live_store,
        skip_duplicates=skip_duplicates,
        out_dir=out_dir,
        manifest="reuse",
    )
    s.ablation = ablation_revision or s.recipe.ablation_revision
    if ablate is None:
        ablate = s.protocol == "paper" and s.ablation is not None
    if ablate:
        s.ablation = s.ablation or s.revisions[-1].name
        check_ablation(out_dir, ablation_key(s.key, s.ablation))  # refused before anything is probed
    else:
        s.ablation = None
    loop = _Loop(
        s,
        out_dir=out_dir,
        device=device,
        cache_dir=cache_dir,
        wandb=wandb,
        progress=progress,
        fetch=fetch,
        claims=claims,
        max_memory=max_memory,
    )
    return loop.run()


def replay_plan(
    model: str | Recipe,
    *,
    revisions: Sequence[str | Revision] | None = None,
    log_spaced: int | None = None,
    out_dir: str | os.PathLike = "runs/replay",
    probes: Sequence | None = None,
    dtype: str | None = None,
    device: str | None = None,
    shard: tuple[int, int] | None = None,
    cache_dir: str | None = None,
    tokens_per_step: int | None = None,
    batch_tokens: int | None = None,
    monitor_config: MonitorConfig | None = None,
    protocol: str | None = None,
    ablation_revision: str | None = None,
    fetch: FetchConfig | None = None,
    max_memory: int | str | None = None,
    workers: int | None = None,
    bandwidth_mb_s: float | None = None,
    tflops: float | None = None,
    skip_duplicates: bool = False,
    lightning_module: str | None = None,
    live_store: str | None = None,
) -> Plan:
    """What ``replay`` with these options would do and cost (``plan.format_plan`` prints it): nothing
    is downloaded but file metadata and a config.json, nothing is written."""
    fetch = fetch or FetchConfig()
    s = prepare_replay(
        model,
        revisions=revisions,
        log_spaced=log_spaced,
        probes=probes,
        dtype=dtype,
        tokens_per_step=tokens_per_step,
        batch_tokens=batch_tokens,
        monitor_config=monitor_config,
        protocol=protocol,
        cache_dir=cache_dir,
        shard=shard,
        lightning_module=lightning_module,
        live_store=live_store,
        skip_duplicates=skip_duplicates,
        out_dir=out_dir,
        manifest="peek",
    )
    worker = detect_worker()
    # done as the loop decides it: by done key (a moved branch, a rewritten checkpoint: to do again)
    stored = {record_done_key(r) for r in stored_records(out_dir) if key_of(r) == s.key} if Path(out_dir).is_dir() else set()
    done = {r.name for r in s.mine if done_key(s.key, r.name, r.commit) in stored}
    if workers is None:
        workers, source = (
            (worker.count or 1),
            ("from " + worker.launcher if worker.launcher != "single" else "this process alone; --workers N"),
        )
    else:
        source = "--workers"
    dev = worker_device(device, worker)
    return make_plan(
        s.recipe.model,
        s.mine,
        done=done,
        dtype=s.dtype,
        protocol=s.protocol,
        batch_tokens=s.cfg.batch_tokens,
        probes=s.probes,
        workers=workers,
        worker_source=source,
        cache_dir=cache_dir,
        fetch=fetch,
        device=dev,
        budgets=device_budgets(dev, max_memory, worker.local_rank),
        **({"bandwidth_mb_s": bandwidth_mb_s} if bandwidth_mb_s else {}),
        tflops=tflops,
        ablation=ablation_revision or s.recipe.ablation_revision,
        duplicates={name: group.duplicate_of for name, group in s.flags.items()},
    )


# ---- one worker's loop ---------------------------------------------------------------------------------------------
class _Loop(Measurer):
    """The claim mode's loop: claim the next revision, measure it while the one after downloads, until none
    is left; then the ablation, if due."""

    def run(self) -> list[dict]:
        with terminate_cleanly():
            try:
                return self._run()
            except Terminated as exc:  # _run freed the claims and the cache; a download thread is not waited for
                exit_terminated(exc)
                raise

    def _run(self) -> list[dict]:
        rows: list[dict] = []
        pause = 0.25  # waiting for others' claims: looks again after 0.25 s, 0.5 s, ... up to poll_s
        try:
            nxt: Job | None = None
            while True:
                if nxt is None:
                    got = self._claim_next(exclude=())
                    if got is _WAIT:
                        _status(self.bar, "-", "waiting for revisions other workers hold")
                        time.sleep(pause)
                        pause = min(2 * pause, self.claims.config.poll_s)
                        continue
                    if got is None:
                        break
                    nxt, pause = self._start(got), 0.25
                job, nxt = nxt, None
                path = self._await(job)
                got = self._claim_next(exclude=(job.rev.name,))  # the next one downloads while this one is probed
                if isinstance(got, Revision):
                    nxt = self._start(got)
                row = self._measure(job, path)
                if row is not None:
                    rows.append(row)
                self._done_with(job, path)
                self._progress()
            self._ablation()
        except BaseException:
            self._close(wait=False)  # interrupted: do not wait for a download in flight
            raise
        self._close(wait=True)
        return rows

    def _claim_next(self, exclude: Sequence[str]):
        """Claim the first revision not done anywhere, not failed in this job and not held by another
        live worker. None: nothing left; _WAIT: what is left is held by others."""
        waiting = False
        for rev in self.s.mine:
            if rev.name in exclude:
                continue
            item = done_key(self.s.key, rev.name, rev.commit)
            if self.store.is_done(item) or self.claims.failed_this_job(item):
                continue
            if not self.claims.try_claim(item, {"revision": rev.name, "commit": rev.commit}):
                waiting = True
                continue
            if self.store.is_done(item):  # another worker wrote it just before our claim
                self.claims.release(item)
                continue
            return rev
        return _WAIT if waiting else None

    def _progress(self) -> None:
        if self.bar is not None:
            self.bar.n = sum(self.store.is_done(done_key(self.s.key, r.name, r.commit)) for r in self.s.mine)
            self.bar.refresh()
