"""What a replay will cost, said before it starts (docs/design.md §8): ``make_plan`` lists the revisions in training
order with their sizes from the hub's file metadata (no download), the peak disk with and without eviction, host and
device memory per dtype (``models.placement``: from the config, no weights loaded), the split over workers and a time
estimate."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..models.hub import RemoteFile, cache_repo_dir, call_with_retries, remote_files
from ..models.loading import DTYPES, default_device, hub_offline
from ..models.placement import ModelShape, Placement, device_budgets, device_label, human, place
from .fetch import FetchConfig, files_to_fetch
from .revisions import Revision

# assumptions of the time estimate, each overridable (CLI --bandwidth, --tflops)
DEFAULT_BANDWIDTH_MB_S = 100.0  # hub download per worker
DEFAULT_TFLOPS = {"cpu": 0.2, "cuda": 50.0}  # sustained probe throughput (2-core CPU measured ~0.23, benchmarks/bench_replay.py)
DISK_READ_MB_S = 1000.0  # loading a downloaded revision from local disk


def revision_config(model: str, rev: Revision, *, cache_dir=None, fetch: FetchConfig | None = None):
    """The config of ``rev`` (its config.json only: from the local folder, the cache offline, or a
    throwaway download that leaves the cache untouched)."""
    from transformers import AutoConfig

    if rev.path is not None:
        return AutoConfig.from_pretrained(rev.path)
    if hub_offline():
        return AutoConfig.from_pretrained(model, revision=rev.commit or rev.name, cache_dir=cache_dir)
    from huggingface_hub import hf_hub_download

    with tempfile.TemporaryDirectory(prefix="sinkwatch-config-") as tmp:
        path = call_with_retries(
            lambda: hf_hub_download(model, "config.json", revision=rev.commit or rev.name, cache_dir=tmp),
            fetch or FetchConfig(),
            f"config of {model}@{rev.name}",
        )
        return AutoConfig.from_pretrained(os.path.dirname(path))


# ---- the plan ----------------------------------------------------------------------------------------------------------------
@dataclass
class PlannedRevision:
    rev: Revision
    files: list[RemoteFile]  # what would be downloaded
    state: str  # "to do" | "done" (in the store) | "in cache" (no download)
    duplicate_of: str | None = None  # flagged from the hub's metadata: its weights are another revision's (provenance)

    @property
    def bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)

    @property
    def weights_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files if f.is_weights)


@dataclass
class Plan:
    model: str
    dtype: str
    protocol: str
    revisions: list[PlannedRevision]
    shape: ModelShape | None
    placement: Placement | None
    workers: int
    worker_source: str
    batch_tokens: int
    seq_len: int
    probe_tokens: int
    pr_tokens: int
    device: str
    bandwidth_mb_s: float
    tflops: float
    keep_cache: bool
    ablation: str | None = None
    tasks: int | None = None  # the manifest's tasks these revisions make (identical weights: one task)

    # ---- derived ----
    def todo(self) -> list[PlannedRevision]:
        return [p for p in self.revisions if p.state != "done"]

    def peak_disk(self, evict: bool) -> int:
        """Bytes this replay downloads that are on disk at once: with eviction, the revision probed
        plus the next one downloading (plus the ablation revision, kept until the ablation ran);
        without, every revision it downloads. Revisions already in the cache are not counted."""
        down = [p.bytes if p.state == "to do" else 0 for p in self.todo()]
        if not evict:
            return sum(down)
        pair = max((a + b for a, b in zip(down, down[1:])), default=sum(down))
        kept = next((p.bytes for p in self.todo()[:-1] if p.rev.name == self.ablation and p.state == "to do"), 0)
        return pair + kept

    def seconds(self) -> dict:
        """Estimated wall time per worker (the slowest): downloads overlap the probes (prefetch)."""
        todo = self.todo()
        per_worker = math.ceil(len(todo) / max(1, self.workers)) if todo else 0
        if not todo or self.shape is None:
            return {"per_worker": 0.0, "download": 0.0, "probe": 0.0, "revisions_per_worker": per_worker}
        size = max(p.bytes for p in todo)
        download = size / (self.bandwidth_mb_s * 1e6)
        load = self.shape.weights[self.dtype] / (DISK_READ_MB_S * 1e6)
        flops = 2 * self.shape.params * (self.probe_tokens + self.pr_tokens)
        probe = load + flops / (self.tflops * 1e12)
        total = download + per_worker * max(download, probe) if per_worker else 0.0
        return {"per_worker": total, "download": download, "probe": probe, "revisions_per_worker": per_worker}


def make_plan(
    model: str,
    revisions: list[Revision],
    *,
    done: set[str],
    dtype: str,
    protocol: str,
    batch_tokens: int,
    probes: list,
    workers: int,
    worker_source: str,
    cache_dir=None,
    fetch: FetchConfig | None = None,
    device: str | None = None,
    budgets: dict | None = None,
    bandwidth_mb_s: float = DEFAULT_BANDWIDTH_MB_S,
    tflops: float | None = None,
    ablation: str | None = None,
    duplicates: dict[str, str] | None = None,
    tasks: int | None = None,
) -> Plan:
    """The plan of a replay (see the module doc). ``done``: revision names the store already holds;
    ``duplicates``: revision -> the revision whose weights it serves (flagged before any download)."""
    fetch = fetch or FetchConfig()
    duplicates = duplicates or {}
    planned = []
    for rev in revisions:
        if rev.path is not None:
            files = [
                RemoteFile(str(p.relative_to(rev.path)), p.stat().st_size, None, None) for p in Path(rev.path).rglob("*") if p.is_file()
            ]
            planned.append(PlannedRevision(rev, files, "done" if rev.name in done else "in cache", duplicates.get(rev.name)))
            continue
        files, cached = _files(model, rev, cache_dir, fetch)
        state = "done" if rev.name in done else ("in cache" if cached else "to do")
        planned.append(PlannedRevision(rev, files, state, duplicates.get(rev.name)))
    seq_len = max((getattr(p, "seq_len", None) or 256) for p in probes) if probes else 256
    probe_tokens = sum((getattr(p, "n", None) or 0) * (getattr(p, "seq_len", None) or 0) for p in probes)
    pr_tokens = 0
    if protocol == "paper":
        ind = next((p for p in probes if p.kind == "induction"), None)
        pr_tokens = min(500, getattr(ind, "n", 0) or 0) * (getattr(ind, "seq_len", 0) or 0) if ind is not None else 0
    shape = placement = None
    last = next((p.rev for p in reversed(planned)), None)
    if last is not None and _has_hf_config(last):
        shape = ModelShape.from_config(revision_config(model, last, cache_dir=cache_dir, fetch=fetch))
        placement = place(shape, dtype, budgets or device_budgets(device), batch_tokens=batch_tokens, seq_len=seq_len)
    dev = device or default_device()
    return Plan(
        model=model,
        dtype=dtype,
        protocol=protocol,
        revisions=planned,
        shape=shape,
        placement=placement,
        workers=max(1, workers),
        worker_source=worker_source,
        batch_tokens=batch_tokens,
        seq_len=seq_len,
        probe_tokens=probe_tokens,
        pr_tokens=pr_tokens,
        device=str(dev),
        bandwidth_mb_s=bandwidth_mb_s,
        tflops=tflops or DEFAULT_TFLOPS["cuda" if str(dev).startswith("cuda") else "cpu"],
        keep_cache=fetch.keep_cache,
        ablation=ablation,
        tasks=tasks,
    )


def _has_hf_config(rev: Revision) -> bool:
    """Whether the model's size can be read from a transformers config: a hub revision or a local
    Hugging Face folder. A Lightning ``.ckpt`` or an OLMo-core checkpoint (whose ``config.json`` is the
    experiment's) holds none; the plan then lists the files without a memory estimate (the loop never
    places a local revision: it loads onto the worker's device)."""
    if rev.path is None:
        return True
    from .local import kind_of

    return kind_of(Path(rev.path)) == "hf"


def _files(model: str, rev: Revision, cache_dir, fetch: FetchConfig) -> tuple[list[RemoteFile], bool]:
    """What ``rev`` would download, and whether the user's cache (``--cache-dir``; offline, the default one
    too) holds it already — the fetcher then reads it from there."""
    snapshot = cache_repo_dir(model, cache_dir) / "snapshots" / (rev.commit or "-")
    if hub_offline():
        if not snapshot.is_dir():
            return [], False
        return [
            RemoteFile(str(p.relative_to(snapshot)), p.stat().st_size, None, None) for p in sorted(snapshot.rglob("*")) if p.is_file()
        ], True
    files = files_to_fetch(call_with_retries(lambda: remote_files(model, rev.commit or rev.name), fetch, f"list {model}@{rev.name}"))
    return files, cache_dir is not None and all((snapshot / f.path).is_file() for f in files)


def format_plan(plan: Plan) -> str:
    """The plan as the CLI prints it."""
    lines = [f"replay plan: {plan.model} — {len(plan.revisions)} revision(s), dtype {plan.dtype}, protocol {plan.protocol}"]
    lines.append(f"  {'revision':<28} {'step':>9} {'tokens':>14} {'commit':<10} {'weights':>11} {'download':>11}  state")
    for p in plan.revisions:
        r = p.rev
        lines.append(
            f"  {r.name:<28} {'' if r.step is None else r.step:>9} {'' if r.tokens is None else r.tokens:>14} "
            f"{(r.commit or '')[:8]:<10} {human(p.weights_bytes):>11} {human(p.bytes):>11}  {p.state}"
            + (f" (duplicate of {p.duplicate_of})" if p.duplicate_of else "")
        )
        for f in p.files:
            lines.append(f"      {f.path}  {f.size} bytes" + (f"  sha256 {f.sha256[:12]}" if f.sha256 else ""))
    todo = plan.todo()
    to_download = [p for p in todo if p.state == "to do"]
    lines.append(
        f"to measure: {len(todo)} revision(s), {len(to_download)} to download ({human(sum(p.bytes for p in to_download))}); "
        f"{len(plan.revisions) - len(todo)} done already in the store"
    )
    flagged = [p.rev.name for p in plan.revisions if p.duplicate_of]
    if flagged:
        lines.append(
            f"duplicated weights: {len(flagged)} revision(s) serve another revision's weight files ({', '.join(flagged)}): measured, "
            "flagged and left out of the trajectory; --skip-duplicates drops them before download"
        )
    lines.append(
        f"disk (per worker): peak {human(plan.peak_disk(evict=True))} with eviction (the revision probed + the next downloading"
        + (", + the ablation revision until the ablation ran" if plan.ablation else "")
        + f"); {human(plan.peak_disk(evict=False))} without (--keep-cache)"
        + (" <- this run keeps the cache" if plan.keep_cache else "")
    )
    if plan.shape is not None:
        s = plan.shape
        lines.append(f"memory ({s.params:,} parameters; from the config with empty weights, nothing loaded):")
        for dt in DTYPES:
            act = s.activations(dt, plan.batch_tokens, plan.seq_len)
            lines.append(
                f"  {dt:<9} weights {human(s.weights[dt]):>10} (host while loading; device)  "
                f"probe peak ~{human(s.weights[dt] + act)} at batch_tokens={plan.batch_tokens}"
                + ("  <- this run" if dt == plan.dtype else "")
            )
        if plan.protocol == "paper" and plan.dtype != "float16":
            lines.append(
                f"  + the paper protocol's float16 PR pass loads after the {plan.dtype} model is freed: peak is the larger of the two"
            )
    elif plan.revisions:
        lines.append("memory: not estimated (these checkpoints hold no transformers config.json: Lightning .ckpt, OLMo-core)")
    if plan.placement is not None:
        pl = plan.placement
        where = ", ".join(f"{device_label(d)} {human(b)}" for d, b in pl.budgets.items())
        lines.append(f"device: {plan.device} ({where} free): " + (pl.reason if pl.fits else "REFUSED — " + pl.reason))
    t = plan.seconds()
    lines.append(
        f"workers: {plan.workers} ({plan.worker_source}); each measures a stride of the {plan.tasks or len(plan.revisions)} "
        f"task(s), then takes what is still missing: ~{t['revisions_per_worker']} revision(s) each"
    )
    if plan.shape is not None and todo:
        lines.append(
            f"time: ~{_duration(t['per_worker'])} per worker — per revision ~{_duration(t['download'])} download at "
            f"{plan.bandwidth_mb_s:g} MB/s (--bandwidth), ~{_duration(t['probe'])} load + probe of {plan.probe_tokens + plan.pr_tokens} "
            f"tokens at {plan.tflops:g} TFLOP/s (--tflops); the next download overlaps the current probe"
        )
    lines.append("nothing was downloaded but file metadata" + (" and config.json" if plan.shape is not None else ""))
    return "\n".join(lines)


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"
