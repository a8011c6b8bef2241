"""The replay loop (SPEC §8): revisions claimed in the store, fetched one ahead, probed, written, evicted.

This is the claim mode, for plain processes (torchrun, ``srun -n``, hosts started by hand); engines
(Slurm arrays, submitit, Ray) run the per-revision unit of ``unit`` instead, over the manifest's tasks.

One worker, whatever launched it, runs ``replay``:

1. the revisions to replay, in training order (``--shard K/N`` keeps every N-th: a static split);
2. ``claim``: the first revision not done anywhere in the store, not failed in this job and not held
   live by another worker is claimed (``claims``); with none left but some held by others, the worker
   waits for them (a stale claim is taken over), then runs the ablation if it is due;
3. ``place``: from the revision's config alone — its device, a split over GPUs, or refused (not downloaded);
4. ``fetch``: downloaded by commit on one background thread; the next revision is claimed and starts
   downloading as soon as the current one is on disk, so probing and downloading overlap;
5. ``measure``: loaded straight onto its device(s), probed with the live ``Monitor`` (an out-of-memory
   probe is retried once at half ``batch_tokens``), the paper protocol's float16 PR pass after the
   float32 model is freed, stages derived over the whole store in step order;
6. ``write``: one complete record appended to this worker's file, the claim released, the revision
   evicted from the cache and the device cache emptied.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..loading import HubUnreachableError, default_device, load_model, loaded_attention
from ..monitor import PAPER_PR_SEQUENCES, Monitor, MonitorConfig
from ..probes import ProbeSet
from ..stages import StageTracker
from .ablation import ablation_key, check_ablation, read_ablation, run_ablation
from .claims import ClaimConfig, Claims
from .fetch import FetchConfig, Fetcher
from .local import is_local
from .manifest import MANIFEST_FILE, Manifest, local_source
from .manifest import resolve as resolve_manifest
from .plan import ModelShape, Placement, Plan, device_budgets, make_plan, place, revision_config
from .progress import _counter, _status
from .protocol import ProtocolLabel, resolve_protocol
from .provenance import DuplicateGroup, provenance, warn_duplicates
from .recipes import Recipe
from .revisions import Revision, check_hub, lineage
from .signals import Terminated, exit_terminated, terminate_cleanly
from .source import RevisionSource
from .store import ReplayStore, done_key, key_of, record_done_key, replay_key, store_group, stored_records
from .workers import Worker, detect_worker

_WAIT = object()  # every remaining revision is held by another live worker


# ---- what to replay ------------------------------------------------------------------------------------------
@dataclass
class _Setup:
    recipe: Recipe
    revisions: list[Revision]  # every revision of the replay, in training order
    mine: list[Revision]  # this worker's: all of them, or its static shard
    key: dict
    cfg: MonitorConfig
    protocol: str
    probes: list
    dtype: str
    ablation: str | None
    source: RevisionSource  # where the revisions come from (a hub model or a local folder) and how a local one loads
    label: ProtocolLabel  # what the records say they measured (paper | sinkwatch | custom, and what changed)
    flags: dict[str, DuplicateGroup]  # revisions whose weights are another's (provenance.find_duplicates, over the whole run)
    manifest: Manifest | None = None


def _setup(
    model,
    *,
    revisions,
    log_spaced,
    probes,
    dtype,
    tokens_per_step,
    batch_tokens,
    monitor_config,
    protocol,
    cache_dir,
    shard,
    lightning_module=None,
    live_store=None,
    skip_duplicates=False,
    out_dir=None,
    manifest="reuse",
) -> _Setup:
    """What to replay and how. ``manifest`` (``manifest.resolve``): ``reuse`` (a worker), ``refresh``
    (the driver writing ``DIR/manifest.json``), ``require`` (the unit, finalize: read it, ask the hub
    nothing), ``peek`` (the plan: write nothing)."""
    recipe = model if isinstance(model, Recipe) else Recipe(model=model)
    if is_local(recipe.model):  # one run, however its path is spelled (run/, ./run, /abs/run): one replay key, one store
        recipe = dataclasses.replace(recipe, model=str(Path(recipe.model).resolve()))
    names = list(revisions) if revisions is not None else (list(recipe.revisions) if recipe.revisions else None)
    names = [r.name if isinstance(r, Revision) else str(r) for r in names] if names is not None else None
    tps = tokens_per_step or recipe.tokens_per_step
    label = resolve_protocol(recipe, probes=probes, dtype=dtype, protocol=protocol or (monitor_config.protocol if monitor_config else None))
    log_spaced = log_spaced or recipe.log_spaced
    local = None
    if is_local(recipe.model):  # a local run: its folder is its listing, each checkpoint hashed once (the store's hash cache)
        local = local_source(
            recipe, None if manifest == "require" else names, out_dir=out_dir, log_spaced=log_spaced, tokens_per_step=tps,
            lightning_module=lightning_module, live_store=live_store, write=manifest != "peek",
        )  # fmt: skip
    elif lightning_module or live_store:
        raise ValueError(
            f"--lightning-module and --live-store are for a local folder of checkpoints; {recipe.model} is no path on this machine"
        )
    probe_list = list(probes) if probes is not None else ((local.live_probes() if local is not None else None) or recipe.probe_recipes())
    # a live store's probe_dtype (the trainer's compute dtype the callback probed in), unless --dtype says otherwise
    live = (getattr(local.local, "live_state", None) or {}) if local is not None and local.local is not None else {}
    dtype = dtype or live.get("probe_dtype") or recipe.dtype
    key = replay_key(recipe.model, dtype, label.label, probe_list)
    if local is None and manifest != "require" and not (out_dir is not None and (Path(out_dir) / MANIFEST_FILE).is_file()):
        check_hub(recipe.model)  # no manifest yet: an unreachable hub stops here, with the advice
    # each revision with the commit its name resolves to now (weights are fetched by it; its done key names
    # those weights), its weights' fingerprint from metadata, and the duplicate groups of the whole run
    m, source = resolve_manifest(
        recipe, names, key=key, out_dir=out_dir, mode=manifest, log_spaced=log_spaced, cache_dir=cache_dir, tokens_per_step=tps,
        local_source=local,
    )  # fmt: skip
    whole = m.groups()
    flags = {r.name: whole[r.name] for r in source.revisions if r.name in whole}
    warn_duplicates(recipe.model, flags)
    ordered = [r for r in source.revisions if not (skip_duplicates and r.name in flags)]  # --skip-duplicates: never downloaded
    if not ordered:
        raise ValueError(f"no revisions to replay for {recipe.model}")
    k, n = shard or (0, 1)
    cfg = monitor_config or MonitorConfig(batch_tokens=batch_tokens or recipe.batch_tokens)  # batch_tokens: memory only
    cfg = dataclasses.replace(cfg, protocol=label.computation)
    s = _Setup(recipe, ordered, ordered[k::n], key, cfg, label.computation, probe_list, dtype, None, source, label, flags)
    s.manifest = m
    return s


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
    s = _setup(
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
    s = _setup(
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
    dev = _worker_device(device, worker)
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


def _worker_device(device: str | None, worker: Worker) -> str:
    """The device given, else this worker's GPU (its local rank: torchrun's LOCAL_RANK or Slurm's
    SLURM_LOCALID), else ``default_device``."""
    if device is not None:
        return device
    dev = default_device()
    if dev.startswith("cuda") and worker.local_rank is not None:
        import torch

        return f"cuda:{worker.local_rank % torch.cuda.device_count()}"
    return dev


# ---- one worker's loop ---------------------------------------------------------------------------------------------
@dataclass
class _Job:
    rev: Revision
    item: str  # the claim: the revision's done key
    placement: Placement | None = None
    error: BaseException | None = None


class _Loop:
    def __init__(
        self, s: _Setup, *, out_dir, device, cache_dir, wandb, progress, fetch: FetchConfig, claims: ClaimConfig | None, max_memory,
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
        self.device = _worker_device(device, self.worker)
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

    # ---- the loop ----
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
            nxt: _Job | None = None
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

    def _start(self, rev: Revision) -> _Job:
        """Decide where ``rev`` goes (from its config alone), then start its download."""
        job = _Job(rev, done_key(self.s.key, rev.name, rev.commit))
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

    def _await(self, job: _Job) -> Path | None:
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

    def _measure(self, job: _Job, path: Path | None) -> dict | None:
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
        _reset_peaks(gpus)
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
            snap = self._oom_retry(
                [self.monitor],
                lambda: self.monitor.probe(
                    model, step=rev.step, tokens=rev.tokens, revision=rev.name, model_name=recipe.model, track=False
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
                    _release_memory()
                    model = self._load(rev, path, "float16", placement)
                values = self._oom_retry([self.pr_monitor], lambda: self.pr_monitor.probe(model, track=False).values, used)
                record.update({"pr": np.asarray(values["pr"]).tolist(), "pr_sequences": values["pr_sequences"], "pr_dtype": "float16"})
        except Terminated:
            # the process is leaving (a time limit): its failed row comes first, before SIGKILL follows
            # (KillWait); a gc pass here took 0.4 s idle and seconds under load
            leaving = True
            raise
        finally:
            model = None
            if not leaving:
                _release_memory()
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
            record["device_peak_bytes"] = _peaks(gpus)  # what this revision needed on its GPUs (the plan's estimate, measured)
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

    def _oom_retry(self, monitors: list[Monitor], fn, used: dict):
        """``fn()``; on out-of-memory, once more at half ``batch_tokens`` (recorded as ``oom_batch_tokens``)."""
        try:
            return fn()
        except Exception as exc:
            if not _is_oom(exc):
                raise
            half = max(1, monitors[0].config.batch_tokens // 2)
            warnings.warn(
                f"sinkwatch replay: out of memory at batch_tokens={monitors[0].config.batch_tokens}; retrying at {half}",
                RuntimeWarning,
                stacklevel=2,
            )
            _empty_device_cache()
            saved = [m.config for m in monitors]
            for m in monitors:
                m.config = dataclasses.replace(m.config, batch_tokens=half)
            try:
                out = fn()
            finally:
                for m, c in zip(monitors, saved):
                    m.config = c
            used["oom_batch_tokens"] = half
            return out

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

    def _done_with(self, job: _Job, path: Path | None) -> None:
        """Evict the revision (the ablation revision stays until the ablation ran) and empty the device cache."""
        if self.s.ablation == job.rev.name and path is not None and job.error is None:
            self._kept = (job.rev, path)
        else:
            self.fetcher.release(job.rev)
        _empty_device_cache()

    def _progress(self) -> None:
        if self.bar is not None:
            self.bar.n = sum(self.store.is_done(done_key(self.s.key, r.name, r.commit)) for r in self.s.mine)
            self.bar.refresh()

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


def _is_oom(exc: BaseException) -> bool:
    import torch

    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower() or "can't allocate memory" in text


def _release_memory() -> None:
    """Give back what a model just dropped held (host and device); call after the last reference is gone."""
    gc.collect()
    _empty_device_cache()


def _reset_peaks(gpus: list[str]) -> None:
    if gpus:
        import torch

        for d in gpus:
            torch.cuda.reset_peak_memory_stats(d)


def _peaks(gpus: list[str]) -> int:
    import torch

    return int(sum(torch.cuda.max_memory_allocated(d) for d in gpus))


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


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
