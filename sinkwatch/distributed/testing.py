"""Test-only fault injection at the named points of a probe's rank protocol.

``SINKWATCH_TEST_FAULT=POINT@RANK`` (or ``POINT@RANK@STEP``; several, comma-separated) raises
``InjectedFault`` on that global rank at that point of a probe, so the tests can show what a fault
there does. Points: "memory" (the pre-probe check says no), "stats" (inside sinkwatch's statistics,
during a forward), "between" (after a probe forward, before the next), "after" (after the probe, before
the ranks agree to write), "model" (in the hooks of the model's middle block, during a forward).
"""

from __future__ import annotations

import os

FAULT_ENV = "SINKWATCH_TEST_FAULT"
FAULT_POINTS = ("memory", "stats", "between", "after", "model")


class InjectedFault(RuntimeError):
    """A fault raised on purpose by ``SINKWATCH_TEST_FAULT`` (tests only)."""


def global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def fault_point(point: str, step: int | None) -> None:
    """Raise ``InjectedFault`` when ``SINKWATCH_TEST_FAULT`` names this point, this rank (and this step)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for one in spec.split(","):
        name, _, rest = one.strip().partition("@")
        rank, _, at_step = rest.partition("@")
        if name not in FAULT_POINTS:
            raise ValueError(f"{FAULT_ENV}={spec!r}: each point must be one of {FAULT_POINTS}")
        if name == point and int(rank or 0) == global_rank() and (not at_step or int(at_step) == step):
            raise InjectedFault(f"test fault injected at {point!r} on rank {global_rank()}, step {step}")
