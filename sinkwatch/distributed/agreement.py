"""The rank protocol of a live probe: what the ranks that probe together agree on, and when (docs/design.md §7).

``ProbeGroup.run(step, probe, target=..., check=...)`` is the one owner of the protocol and of this rank's
layout; a probe and the pre-flight probe are each one call of it, and the probe engine (``Monitor.probe``)
is handed what it needs (a guarded target, this rank's share) without importing any of this.

Every collective here is issued by every rank of the group at the same point of the same probe:

1. ``check()`` on each rank (its inputs, its memory) and one all-reduced go/no-go (START), carrying the
   config hash (same probe sets and thresholds everywhere, or no rank goes on) and whether some rank
   lacked memory;
2. ``probe(target, share)`` on this rank's layout (``ProbeLayout.run``: eager forwards, the probe's
   dtype, a sharded model's parameters gathered in a collective stretch), whose forwards each start on one agreement (FORWARD, in
   ``forwards.py``) and whose shares are combined after one more (COMBINE);
3. one agreement before anything is written (DONE);
4. after a failed verdict, one ``all_gather_object`` of every rank's fault, so every rank knows who
   failed and why (left out for a retry that failed again for lack of memory).

Every agreement is one all-reduce of the same 5-integer tensor, so agreements of different phases pair
with each other: a rank that failed sends FAIL at its next agreement, whichever the others are at, and
after the first verdict that is not unanimous no rank sends another. A fault outside a probe forward is
local (the rank's next agreement says FAIL). A fault that escapes a forward while the forward is itself
a collective (FSDP's all-gathers) goes through ``collective``: the verdict on the c10d store.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .forwards import GroupForwards
from .layout import ProbeLayout, group_device
from .protocol import COMBINE, DONE, FAIL, FAULT_TIMEOUT_S, START, PeerFailed, ProbeFaultEverywhere, ProbeForwardBroken, ProbeNotReady
from .testing import fault_point

_GROUPS = 0  # ProbeGroups of several ranks built in this process (their ids name their store keys)


@dataclass(frozen=True)
class Outcome:
    """What ``ProbeGroup.run`` tells every rank: ``ok`` and the body's ``value``, or this rank's own
    ``error`` (None when another rank stopped the probe), every rank's ``(fault or None, label)`` in rank
    order (``faults``; None when left quiet), and whether some rank lacked memory before it (``short``)."""

    ok: bool
    value: object = None
    error: BaseException | None = None
    faults: list | None = None
    short: bool = False

    def explain(self) -> str:
        """The error line of a failed probe: who failed and why (every rank's fault), or that the ranks'
        labels (config hashes) differ when no rank failed on its own."""
        local = describe(self.error)
        if self.faults is None or len(self.faults) == 1:
            return local or "the probe failed"
        named = [f"rank {r}: {m}" for r, (m, _) in enumerate(self.faults) if m is not None]
        hashes = ", ".join(f"rank {r}: {h}" for r, (_, h) in enumerate(self.faults))
        differ = f"the ranks' probe sets or thresholds differ (config_hash {hashes}); give every rank the same options"
        return f"{'; '.join(named) if named else differ} (every rank skipped this probe; no rank wrote it)"


def config_token(config_hash: str | None) -> int:
    """The 48-bit integer of a 12-hex-digit config hash (0: none yet), as the agreements carry it."""
    return int(config_hash[:12], 16) if config_hash else 0


def describe(error: BaseException | None) -> str | None:
    """A rank's fault as the error line names it (None: no fault of its own)."""
    return None if error is None or isinstance(error, PeerFailed) else f"{type(error).__name__}: {error}"


def is_out_of_memory(error: BaseException | str | None) -> bool:
    """An out-of-memory of any device: CUDA's ``torch.OutOfMemoryError``, a CPU allocator's refusal."""
    if isinstance(error, torch.OutOfMemoryError) or (isinstance(error, str) and error.startswith("OutOfMemoryError")):
        return True
    text = str(error).lower()
    return "out of memory" in text or "can't allocate memory" in text


def fault_signature(exc: BaseException, place: str = "") -> str:
    """What makes two ranks' faults "the same fault at the same place": where it happened (``place``:
    the probe forward's ordinal and the block) and what it was, with every number blanked: the ranks of a
    split probe run different row counts (so shapes differ), and an out-of-memory message carries the
    process's PID and byte counts (compared as "out of memory", whatever the device says)."""
    if is_out_of_memory(exc):
        what = "out of memory"
    else:
        text = re.sub(r"0x[0-9a-fA-F]+", "0x?", str(exc))
        text = re.sub(r"\d+(?:\.\d+)?\s*(?:bytes|[KMGTP]i?B)\b", "<size>", text)
        text = re.sub(r"\d+", "N", text)
        what = f"{type(exc).__name__}: {text}"
    return f"{what} @ {place}" if place else what


def shared_max_steps(max_steps: int | None, device: torch.device) -> int | None:
    """Rank 0's planned number of optimizer steps on every rank of the default process group (a
    collective every rank runs at setup; alone: ``max_steps`` itself). Each rank's trainer estimates
    the run from its own data (Lightning's ``estimated_stepping_batches``), and log-spaced steps
    computed from unequal estimates would send one rank into a probe the others never start."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return max_steps
    on = group_device(str(dist.get_backend()), device)
    value = torch.tensor([max_steps if max_steps is not None else -1], dtype=torch.int64, device=on)
    dist.broadcast(value, src=0)
    steps = int(value.item())
    return steps if steps > 0 else None


class ProbeGroup:
    """The ranks that run each probe together: this rank alone (``size`` 1: nothing to agree), or every
    rank of the default process group when the parameters are sharded or the probe is split."""

    def __init__(self, size: int = 1, *, prefer: torch.device | str | None = None, fault_timeout_s: float = FAULT_TIMEOUT_S,
                 layout: ProbeLayout | None = None):  # fmt: skip
        self.size = size
        self.layout = layout  # where this rank's probe runs (None: as the model is, a test's bare group)
        self.rank = 0
        self.device = torch.device("cpu")
        self.fault_timeout_s = fault_timeout_s  # how long a rank that faulted in a forward waits for the others' verdicts
        # whether a probe forward is itself a collective (sharded parameters: its all-gathers); under a
        # split DDP probe it is not, and a fault in it is an ordinary failed verdict, as in one process
        self.forwards_collective = True
        self.tp = None  # tensor parallelism (``TensorParallel``): block forwards are collectives of their own
        self._closed = False
        self._stretches = 0  # collective stretches entered (the same count on every rank while they run in step)
        self._id = 0
        if size > 1:
            import torch.distributed as dist

            global _GROUPS
            _GROUPS += 1  # every rank builds its groups in the same order (at setup): the same id everywhere
            self._id = _GROUPS
            self.rank = dist.get_rank() if dist.is_initialized() else 0
            self.device = group_device(str(dist.get_backend()), prefer)

    @classmethod
    def for_layout(cls, layout: ProbeLayout, *, prefer=None, fault_timeout_s: float = FAULT_TIMEOUT_S) -> ProbeGroup:
        """The group of this rank's ``layout``: every rank together when the parameters are sharded or the
        probe split (and there are several ranks), else alone. ``prefer``: the model's device; the
        agreements use it when the group carries it."""
        import torch.distributed as dist

        facts = layout.facts
        if facts.together and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = cls(dist.get_world_size(), prefer=prefer, fault_timeout_s=fault_timeout_s, layout=layout)
            group.forwards_collective = facts.sharding is not None or facts.tp is not None
            group.tp = facts.tp
            return group
        return cls(1, fault_timeout_s=fault_timeout_s, layout=layout)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    # ---- the protocol --------------------------------------------------------------------------
    def run(self, step: int | None, probe: Callable, *, target, check: Callable[[], str | None], quiet: bool = False) -> Outcome:
        """One probe of ``target`` (a ``ProbeTarget``) on every rank of the group, in step (see the module's docstring).

        ``check()``: this rank's pre-probe checks; returns the label every rank must send alike (the
        config hash), raises to say no (``ProbeNotReady``: not memory enough). ``probe(target, share)``:
        the probe (``Monitor.probe``), run on this rank's layout; ``target`` is then the target whose
        forwards run on the group's agreement, ``share`` this rank's ``ProbeShare`` (None alone). ``quiet``:
        a failure that is again only a lack of memory gathers nothing (a retry's). ``ProbeForwardBroken``
        propagates: the run cannot go on in step."""
        self._closed = False
        error: BaseException | None = None
        label = None
        try:
            label = check()
        except Exception as exc:  # noqa: BLE001 - the monitor must never stop training
            error = exc
        token = config_token(label)
        ok, short = self.agree(START if error is None else FAIL, token, flag=int(isinstance(error, ProbeNotReady)))
        value = None
        if ok:
            try:
                guarded = target if self.size == 1 else GroupForwards(target, self, step, token)
                share = self.share(step, token)
                if self.layout is None:
                    value = probe(guarded, share)
                else:
                    value = self.layout.run(
                        lambda: probe(guarded, share), device_type=target.device.type,
                        gathering=lambda: self.collective(step, "gathering the full parameters"),
                    )  # fmt: skip
                if step is not None:  # a probe, not the pre-flight one (which has no injection point)
                    fault_point("after", step)
            except ProbeForwardBroken:
                raise  # the other ranks wait inside a forward: never go on to training's collectives out of step
            except Exception as exc:  # noqa: BLE001
                error = exc
            ok, _ = self.agree(DONE if error is None else FAIL, token)  # nothing is written unless every rank succeeded
        if ok:
            return Outcome(True, value)
        own = None if isinstance(error, PeerFailed) else error
        faults = None if quiet and short else self.gather((describe(own), label))
        return Outcome(False, None, own, faults, bool(short))

    def agree(self, code: int, token: int, *, flag: int = 0) -> tuple[bool, int]:
        """One all-reduced verdict: (whether every rank sent this same code and token and the code is not
        FAIL, the largest ``flag`` any rank sent)."""
        if self.size == 1:
            return code != FAIL, flag
        if self._closed:
            return False, 0
        import torch.distributed as dist

        both = torch.tensor([code, -code, token, -token, -flag], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MIN)
        low, high, tlow, thigh, most = (int(v) for v in both.cpu())
        ok = low == -high == code and tlow == -thigh and code != FAIL
        self._closed = not ok
        return ok, -most

    def gather(self, item) -> list:
        """Every rank's ``item`` (picklable), in rank order."""
        if self.size == 1:
            return [item]
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, item)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group's ranks, in place (sent on the group's device)."""
        if self.size == 1:
            return
        import torch.distributed as dist

        sent = tensor.to(self.device)
        dist.all_reduce(sent, op=dist.ReduceOp.SUM)
        if sent is not tensor:
            tensor.copy_(sent.to(tensor.device))

    def share(self, step: int | None, token: int):
        """This rank's ``ProbeShare`` (None when alone): its all-reduce runs only on every rank's go
        (an agreement first: a rank that failed before it sends FAIL there instead, and no rank is
        left inside a sum the others never join)."""
        if self.size == 1:
            return None
        from ..probe.share import ProbeShare

        def combine(tensor: torch.Tensor) -> None:
            if not self.agree(COMBINE, token)[0]:
                raise PeerFailed("another rank stopped this probe")
            with self.collective(step, "combining the ranks' shares of the probe"):
                self.all_reduce_sum(tensor)

        if self.tp is not None:  # the ranks of a tensor-parallel group run their replica's share, each its own heads
            tp = self.tp
            return ProbeShare(rank=tp.dp_rank, size=tp.dp_size, all_reduce=combine, heads=(tp.rank, tp.size))
        return ProbeShare(rank=self.rank, size=self.size, all_reduce=combine)

    def broadcast_windows(self, windows: torch.Tensor | None) -> torch.Tensor | None:
        """Rank 0's (m, T) natural windows (or its None) on every rank of the group."""
        if self.size == 1:
            return windows
        import torch.distributed as dist

        header = torch.tensor(list(windows.shape) if windows is not None else [-1, 0], dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        m, T = (int(v) for v in header.cpu())
        if m < 0:
            return None
        data = windows.to(self.device, torch.int64) if self.is_root else torch.empty(m, T, dtype=torch.int64, device=self.device)
        dist.broadcast(data, src=0)
        return data.cpu()

    # ---- a stretch every rank runs in step -------------------------------------------------------
    @contextlib.contextmanager
    def collective(self, step: int | None, what: str, *, paired: bool = True, place: Callable[[], str] = str) -> Iterator[None]:
        """A stretch every rank runs in step (a forward of sharded parameters, a parameter gather): a
        fault escaping it on one rank leaves the others inside its collectives. Every such fault goes
        to the verdict on the c10d store: the same fault at the same place (``place()``) on every rank is
        ``ProbeFaultEverywhere`` (the probe is skipped, training goes on), anything else
        ``ProbeForwardBroken`` within ``fault_timeout_s``. ``paired`` False: the stretch issues no
        collective (a split probe's forward under DDP), and a fault in it passes as is (this rank's
        next agreement says FAIL for it)."""
        self._stretches += 1
        stretch = self._stretches
        try:
            yield
        except (PeerFailed, ProbeForwardBroken, ProbeFaultEverywhere):
            raise
        except Exception as exc:
            if self.size == 1 or not paired:
                raise
            where = place()
            verdict = self._fault_verdict(stretch, fault_signature(exc, where))
            at = f" ({where})" if where else ""
            if verdict is None:
                raise ProbeFaultEverywhere(
                    f"every rank raised the same fault in {what}{at} ({type(exc).__name__}: {exc}); the probe is skipped on "
                    "every rank and training goes on"
                ) from exc
            raise ProbeForwardBroken(
                f"sinkwatch: {what}{at} at step {step} failed on rank {self.rank} ({type(exc).__name__}: {exc}) while the "
                f"other ranks are inside its collectives ({verdict}); nothing can pair them again, so the run stops here "
                "instead of letting them pair with training's collectives (a hang or silently wrong numbers). Resume from "
                "the last checkpoint; after an out-of-memory, lower MonitorConfig(batch_tokens=...) (tokens per probe forward)."
            ) from exc

    def _fault_verdict(self, stretch: int, mine: str) -> str | None:
        """After a fault inside a collective stretch: None when every rank of the group posted the same
        signature for the same stretch, else why not. The verdict goes through the c10d store (keys, not
        collectives: it cannot pair with the model's collectives another rank is still inside), and waits
        at most ``fault_timeout_s`` for the other ranks."""
        import datetime

        import torch.distributed as dist

        try:
            store = dist.PrefixStore(f"sinkwatch/fault/{self._id}/{stretch}", dist.distributed_c10d._get_default_store())
            store.set(str(self.rank), mine)
            keys = [str(r) for r in range(self.size)]
            try:
                store.wait(keys, datetime.timedelta(seconds=self.fault_timeout_s))
            except Exception:  # noqa: BLE001 - a timeout: some rank never faulted here (it is inside a collective, or went on)
                posted = [r for r in range(self.size) if store.check([str(r)])]
                missing = sorted(set(range(self.size)) - set(posted))
                return f"ranks {missing} raised no fault there within {self.fault_timeout_s:g} s"
            theirs = {r: store.get(str(r)).decode() for r in range(self.size)}
        except Exception as err:  # noqa: BLE001 - no store (never under torchrun/srun): assume the worst
            return f"the verdict could not be reached: {type(err).__name__}: {err}"
        differ = [r for r, sig in theirs.items() if sig != mine]
        return None if not differ else f"ranks {differ} raised a different fault or at another place"
