"""A time limit for Ray tasks, which Ray lacks (only ``ray.wait``/``ray.get`` take a timeout): the driver waits with
``ray.wait`` and a timeout, and cancels a task past its limit.

``ray.cancel(ref)`` raises KeyboardInterrupt in the task's Python: the replay unit writes its failed rows and ends its
attempt. A task stuck in C (a CUDA hang) never sees it: ``grace_s`` later ``force=True`` kills its worker process, with
no row (``finalize`` records it as killed). Each task's deadlines are its own: one task's grace never delays another's.
Ray never retries a cancelled task: resubmit what ``failed_tasks`` lists. A task's time counts from its submission, so
at most ``slots`` run at once (submitted as others end).
"""

from __future__ import annotations

import time
from collections.abc import Sequence


def run_with_limit(remote, calls: Sequence[tuple], *, limit_s: float, grace_s: float = 60.0, slots: int | None = None, **kwargs) -> list:
    """``remote.remote(*call, **kwargs)`` for each of ``calls``, at most ``slots`` at a time (default: the cluster's
    GPUs, else CPUs), each cancelled after ``limit_s`` seconds, force-cancelled ``grace_s`` later, given up on
    (``TimeoutError``) ``grace_s`` after that. Returns each call's result or exception (``RevisionFailed``,
    ``TaskCancelledError``...), in order."""
    import ray

    if not limit_s > 0 or not grace_s > 0:
        raise ValueError(f"limit_s and grace_s must be positive numbers of seconds, got {limit_s!r} and {grace_s!r}")
    if slots is None:
        resources = ray.cluster_resources()
        slots = int(resources.get("GPU", 0)) or int(resources.get("CPU", 1))
    queue = list(enumerate(calls))
    out: list = [None] * len(calls)
    running: dict = {}  # ref -> [call index, next deadline, cancels sent]
    while queue or running:
        while queue and len(running) < max(1, slots):  # a cancelled task holds its slot until its worker is gone
            i, call = queue.pop(0)
            running[remote.remote(*call, **kwargs)] = [i, time.monotonic() + limit_s, 0]
        wait = max(0.0, min(d for _, d, _ in running.values()) - time.monotonic())
        ready, _ = ray.wait(list(running), num_returns=1, timeout=wait)
        for ref in ready:
            out[running.pop(ref)[0]] = _result(ray, ref)
        now = time.monotonic()
        for ref, entry in list(running.items()):
            i, deadline, cancels = entry
            if now < deadline:
                continue
            if cancels == 2:  # its worker was killed a grace ago and Ray still reports nothing: not waited for
                out[i] = TimeoutError(f"call {i} did not end {grace_s:.0f} s after its force-cancel")
                running.pop(ref)
                continue
            ray.cancel(ref, force=cancels == 1)  # KeyboardInterrupt first (the unit writes its rows); then its worker is killed
            entry[1:] = [now + grace_s, cancels + 1]
    return out


def _result(ray, ref):
    try:
        return ray.get(ref, timeout=0)
    except Exception as exc:  # noqa: BLE001 - each call's outcome is returned, not raised
        return exc
