"""A time limit for Ray tasks, which Ray does not have: the driver waits with ``ray.wait`` and a timeout,
and cancels a task past its limit.

``ray.cancel(ref)`` raises KeyboardInterrupt in the task's Python: the replay unit writes its failed
rows and ends its attempt. A task stuck in C (a CUDA hang) never sees it: after ``grace_s`` it is
cancelled with ``force=True``, which kills its worker process — no row; ``finalize`` records it as
killed. Ray retries neither (cancelled tasks are never retried): resubmit what ``failed_tasks`` lists.
A task's time counts from its submission, so at most ``slots`` run at once (submitted as others end).
"""

from __future__ import annotations

import time
from collections.abc import Sequence


def run_with_limit(remote, calls: Sequence[tuple], *, limit_s: float, grace_s: float = 60.0, slots: int | None = None, **kwargs) -> list:
    """``remote.remote(*call, **kwargs)`` for each of ``calls``, at most ``slots`` at a time (default: the
    cluster's GPUs, else its CPUs), each cancelled once it has run ``limit_s`` seconds. Returns each call's
    result, or the exception it ended with (``RevisionFailed``, ``TaskCancelledError``...), in order."""
    import ray

    if not limit_s > 0:
        raise ValueError(f"limit_s must be a positive number of seconds, got {limit_s!r}")
    if slots is None:
        resources = ray.cluster_resources()
        slots = int(resources.get("GPU", 0)) or int(resources.get("CPU", 1))
    queue = list(enumerate(calls))
    out: list = [None] * len(calls)
    running: dict = {}  # ref -> (call index, deadline)
    while queue or running:
        while queue and len(running) < max(1, slots):
            i, call = queue.pop(0)
            running[remote.remote(*call, **kwargs)] = (i, time.monotonic() + limit_s)
        wait = max(0.0, min(d for _, d in running.values()) - time.monotonic())
        ready, _ = ray.wait(list(running), num_returns=1, timeout=wait)
        for ref in ready:
            out[running.pop(ref)[0]] = _result(ray, ref)
        for ref, (i, deadline) in list(running.items()):
            if time.monotonic() < deadline:
                continue
            ray.cancel(ref)  # KeyboardInterrupt in the task: the unit writes its failed rows
            done, _ = ray.wait([ref], timeout=grace_s)
            if not done:
                ray.cancel(ref, force=True)  # stuck where Python cannot interrupt it: its worker is killed
            out[i] = _result(ray, ref, timeout=grace_s)
            running.pop(ref)
    return out


def _result(ray, ref, timeout: float | None = None):
    try:
        return ray.get(ref, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - each call's outcome is returned, not raised
        return exc
