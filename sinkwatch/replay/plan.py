"""What a replay will cost, said before it starts (docs/design.md §8), and where each model goes.

``make_plan`` lists the revisions in training order with their sizes from the hub's file metadata
(``hub.remote_files``: no download), the peak disk with and without eviction, host and device memory
per dtype, the split over workers and a time estimate. Memory comes from the model's config alone:
the model is built with accelerate's ``init_empty_weights`` (parameters on the meta device, nothing
allocated) and sized with ``compute_module_sizes``; no weights are loaded.

``place`` decides where a revision goes before it is downloaded: the worker's device when it holds
the weights plus one probe micro-batch's activations; else, with several visible GPUs, a
``device_map`` splitting the layers across them (``infer_auto_device_map`` under each GPU's budget);
else it is refused, saying what would fit.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..models.loading import DTYPES, default_device, hub_offline
from .fetch import FetchConfig, call_with_retries, files_to_fetch
from .hub import RemoteFile, remote_files
from .revisions import Revision

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# assumptions of the time estimate, each overridable (CLI --bandwidth, --tflops)
DEFAULT_BANDWIDTH_MB_S = 100.0  # hub download per worker
DEFAULT_TFLOPS = {"cpu": 0.2, "cuda": 50.0}  # sustained probe throughput (2-core CPU measured ~0.23, benchmarks/bench_replay.py)
DISK_READ_MB_S = 1000.0  # loading a downloaded revision from local disk


def parse_bytes(value: int | float | str) -> int:
    """``24GiB``, ``500MB``, ``1e9`` or a number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]?I?B?)\s*", str(value), flags=re.IGNORECASE)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"a memory size is a number of bytes or like 24GiB / 500MB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---- a model's size from its config ------------------------------------------------------------------------------
@dataclass
class ModelShape:
    """Sizes of one architecture, from its config with empty weights (nothing allocated)."""

    config: object
    params: int
    weights: dict[str, int]  # dtype -> bytes of parameters and buffers
    no_split: list[str]
    empty: object = field(repr=False)  # the model on the meta device, for infer_auto_device_map

    @classmethod
    def from_config(cls, config) -> ModelShape:
        from accelerate import init_empty_weights
        from accelerate.utils import compute_module_sizes
        from transformers import AutoModelForCausalLM

        with init_empty_weights():
            empty = AutoModelForCausalLM.from_config(config)
        weights = {name: int(compute_module_sizes(empty, dtype=dt)[""]) for name, dt in DTYPES.items()}
        params = sum(p.numel() for p in empty.parameters())
        no_split = list(getattr(empty, "_no_split_modules", None) or [])
        return cls(config, params, weights, no_split, empty)

    def activations(self, dtype: str, batch_tokens: int, seq_len: int) -> int:
        """An upper estimate of one probe micro-batch's activations (no gradients): the MLP and
        residual tensors of one block, the logits (model dtype and a float32 copy), and the attention
        scores where the attention materialises them (eager, sdpa's math path on CPU)."""
        c = self.config
        b = DTYPES[dtype].itemsize
        hidden = int(getattr(c, "hidden_size", 0) or getattr(c, "n_embd", 0))
        inter = int(getattr(c, "intermediate_size", 0) or getattr(c, "n_inner", 0) or 4 * hidden)
        vocab = int(getattr(c, "vocab_size", 0))
        heads = int(getattr(c, "num_attention_heads", 0) or getattr(c, "n_head", 0))
        return batch_tokens * ((4 * hidden + inter) * b + vocab * (b + 4)) + batch_tokens * seq_len * heads * 4

    def need(self, dtype: str, batch_tokens: int, seq_len: int) -> int:
        return self.weights[dtype] + self.activations(dtype, batch_tokens, seq_len)


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


# ---- where a model goes ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """``device_map`` for ``from_pretrained`` (None: refused, ``reason`` says why and what to do)."""

    device_map: dict | None
    need: int
    budgets: dict
    reason: str

    @property
    def fits(self) -> bool:
        return self.device_map is not None

    @property
    def split(self) -> bool:
        return self.fits and len(set(self.device_map.values())) > 1


def device_budgets(device: str | None = None, max_memory: int | str | None = None, local_rank: int | None = None) -> dict:
    """Memory each device this worker may use has free: {"cpu": bytes} or {gpu_index: bytes}.

    A worker with a local rank (one worker per GPU) uses its own GPU; a lone worker on a multi-GPU
    host may use every visible GPU. ``max_memory`` replaces the measured free memory of each device."""
    dev = device or default_device()
    cap = parse_bytes(max_memory) if max_memory is not None else None
    if not str(dev).startswith("cuda"):
        return {"cpu": cap if cap is not None else _host_available()}
    import torch

    if ":" in str(dev):
        gpus = [int(str(dev).split(":")[1])]
    elif local_rank is not None:
        gpus = [local_rank % torch.cuda.device_count()]
    else:
        gpus = list(range(torch.cuda.device_count()))
    return {i: cap if cap is not None else int(torch.cuda.mem_get_info(i)[0]) for i in gpus}


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def place(shape: ModelShape, dtype: str, budgets: dict, *, batch_tokens: int, seq_len: int) -> Placement:
    """Where a model of ``shape`` in ``dtype`` goes under ``budgets`` (see the module doc)."""
    act = shape.activations(dtype, batch_tokens, seq_len)
    need = shape.weights[dtype] + act
    for dev, budget in budgets.items():
        if budget >= need:
            return Placement({"": "cpu" if dev == "cpu" else f"cuda:{dev}"}, need, dict(budgets), f"fits on {_dev(dev)}")
    gpus = [d for d in budgets if d != "cpu"]
    if len(gpus) > 1 and sum(budgets[d] - act for d in gpus) >= shape.weights[dtype]:
        from accelerate.utils import infer_auto_device_map

        # each GPU keeps room for the activations: the micro-batch runs through every block in turn
        cap = {d: max(0, budgets[d] - act) for d in gpus}
        device_map = infer_auto_device_map(shape.empty, max_memory=cap, no_split_module_classes=shape.no_split, dtype=DTYPES[dtype])
        if set(device_map.values()) <= set(gpus):
            used = sorted(set(device_map.values()))
            return Placement(
                {k: f"cuda:{v}" for k, v in device_map.items()}, need, dict(budgets), f"split over GPUs {used} (one cannot hold it)"
            )
    return Placement(None, need, dict(budgets), _advice(shape, dtype, budgets, batch_tokens, seq_len))


def _dev(dev) -> str:
    return "the CPU" if dev == "cpu" else f"GPU {dev}"


def _advice(shape: ModelShape, dtype: str, budgets: dict, batch_tokens: int, seq_len: int) -> str:
    best = max(budgets.values())
    act = shape.activations(dtype, batch_tokens, seq_len)
    parts = [
        f"needs about {human(shape.weights[dtype] + act)} ({human(shape.weights[dtype])} of {dtype} weights + ~{human(act)} of "
        f"activations at batch_tokens={batch_tokens}) and the largest device has {human(best)} free "
        f"({', '.join(f'{_dev(d)} {human(b)}' for d, b in budgets.items())}). It was not downloaded. What would fit:"
    ]
    for other in ("bfloat16", "float16"):
        if other != dtype and shape.need(other, batch_tokens, seq_len) <= best:
            parts.append(f"--dtype {other} ({human(shape.need(other, batch_tokens, seq_len))})")
            break
    smaller = batch_tokens
    while smaller > seq_len and shape.need(dtype, smaller, seq_len) > best:
        smaller //= 2
    if smaller < batch_tokens and shape.need(dtype, smaller, seq_len) <= best:
        parts.append(f"--batch-tokens {smaller}")
    gpus_needed = math.ceil((shape.weights[dtype]) / max(1, best - act)) if best > act else None
    if gpus_needed and gpus_needed > 1:
        parts.append(f"one worker per host with {gpus_needed}+ such GPUs visible (CUDA_VISIBLE_DEVICES), so the layers are split")
    parts.append("or a device with more memory")
    return parts[0] + " " + "; ".join(parts[1:])


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
    from .revisions import _cache_repo_dir

    snapshot = _cache_repo_dir(model, cache_dir) / "snapshots" / (rev.commit or "-")
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
        where = ", ".join(f"{_dev(d)} {human(b)}" for d, b in pl.budgets.items())
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
