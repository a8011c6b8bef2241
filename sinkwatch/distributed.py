"""Which rank probes and how a sharded model's probe forward runs (SPEC §7).

DDP: only global rank 0 probes, the bare module (the DDP wrapper would wait for the other ranks and
hang). FSDP (v1): every rank probes together, inside ``summon_full_params`` on the root wrapper so
the inner model's forward sees whole parameters. FSDP2 (``fully_shard``): every rank probes
together; each sharded module all-gathers its own parameters in its forward. Only global rank 0
reports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

FullParams = Callable[[], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class RankFacts:
    """What this rank does at a probe step, decided once at fit start."""

    is_global_zero: bool
    world_size: int
    sharding: str | None  # "fsdp" (v1), "fsdp2", or None (single device, DDP)

    @property
    def probes_here(self) -> bool:
        """Rank 0 always probes; with sharded parameters every rank must join the collective forward."""
        return self.is_global_zero or self.sharding is not None

    @property
    def reports_here(self) -> bool:
        return self.is_global_zero


def rank_facts(module, *, is_global_zero: bool, world_size: int = 1) -> RankFacts:
    """The facts for this rank; ``module`` is the model as the strategy wraps it (FSDP shards show there)."""
    return RankFacts(is_global_zero=bool(is_global_zero), world_size=max(1, int(world_size)), sharding=_fsdp_kind(module)[0])


def fsdp_full_params(module) -> FullParams:
    """The context a sharded model's probe forward runs in; every rank must run it (a collective).

    FSDP (v1) wrappers: ``summon_full_params`` on the root gathers whole parameters first.
    FSDP2 (``fully_shard``): each sharded module's forward pre-hook all-gathers its own parameters,
    so the forward needs nothing around it. Neither: a no-op context."""
    return _fsdp_kind(module)[1]


def is_fsdp(module) -> bool:
    """Whether ``module`` holds FSDP or FSDP2 shards (then every rank probes together)."""
    return _fsdp_kind(module)[0] is not None


def _fsdp_kind(module) -> tuple[str | None, FullParams]:
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - torch without distributed
        return None, contextlib.nullcontext
    v1 = [m for m in module.modules() if isinstance(m, FSDP)]
    if v1:
        return "fsdp", lambda: FSDP.summon_full_params(v1[0], writeback=False, recurse=True)
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return "fsdp2", contextlib.nullcontext
    return None, contextlib.nullcontext
