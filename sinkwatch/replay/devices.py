"""The device side of a worker's replay: its device, an out-of-memory probe retried once at half ``batch_tokens``,
peak memory per revision, memory given back between revisions."""

from __future__ import annotations

import dataclasses
import gc
import warnings

from ..models.loading import default_device
from ..probe.monitor import Monitor
from .workers import Worker


def worker_device(device: str | None, worker: Worker) -> str:
    """The device given, else this worker's GPU (by LOCAL_RANK or SLURM_LOCALID), else ``default_device``."""
    if device is not None:
        return device
    dev = default_device()
    if dev.startswith("cuda") and worker.local_rank is not None:
        import torch

        return f"cuda:{worker.local_rank % torch.cuda.device_count()}"
    return dev


def oom_retry(monitors: list[Monitor], fn, used: dict):
    """``fn()``; on out-of-memory, once more at half ``batch_tokens`` (recorded as ``oom_batch_tokens``)."""
    try:
        return fn()
    except Exception as exc:
        if not is_oom(exc):
            raise
        half = max(1, monitors[0].config.batch_tokens // 2)
        msg = f"sinkwatch replay: out of memory at batch_tokens={monitors[0].config.batch_tokens}; retrying at {half}"
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        empty_device_cache()
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


def is_oom(exc: BaseException) -> bool:
    import torch

    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower() or "can't allocate memory" in text


def release_memory() -> None:
    """Give back what a model just dropped held (host and device); call after the last reference is gone."""
    gc.collect()
    empty_device_cache()


def reset_peaks(gpus: list[str]) -> None:
    if gpus:
        import torch

        for d in gpus:
            torch.cuda.reset_peak_memory_stats(d)


def peaks(gpus: list[str]) -> int:
    import torch

    return int(sum(torch.cuda.max_memory_allocated(d) for d in gpus))


def empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
