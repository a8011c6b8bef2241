"""Which rank probes, which layouts are refused, and what the ranks that probe together agree on (SPEC §7).

Who probes. By default (``LiveConfig(split_probe=True)``) every data-parallel rank runs its share of
each probe's sequences and one all-reduce combines the shares (``sinkwatch.probe_share``, SPEC §9);
only global rank 0 reports. DDP: each rank probes the bare module (the DDP wrapper would wait for
the other ranks' backward and hang). FSDP (v1): every rank together, inside
``summon_full_params(recurse=False)`` on each outermost unit: that gathers the parameters no inner
unit owns, and each inner unit gathers its own in its forward, as in training. FSDP2 / HSDP
(``fully_shard``): every rank together; each sharded module all-gathers its own parameters in its
forward. With ``split_probe=False``: DDP's rank 0 probes alone while the others go on to wait at the
next training collective, and sharded ranks each run the whole probe.

Refused at setup (``check_layout``), with what to do instead: tensor parallelism (a rank holds only
some heads: a probe on rank 0 alone would hang in the row-parallel all-reduce, one on every rank
would measure its local heads only) and DeepSpeed ZeRO-3 (a probe on rank 0 alone would hang in
DeepSpeed's all-gather).

What the ranks that probe together agree on (``ProbeGroup``): the natural probe's windows (rank
0's, broadcast when they are frozen, so every rank runs the same forwards: the BOS-free twin
included), and before, during and after each probe one all-reduced verdict (same code and same
``config_hash`` on every rank, or no rank goes on): before (each rank's inputs and a memory check),
before each probe forward, before the shares are combined, and after (before anything is written). A fault in sinkwatch's own
statistics during a forward is held until that forward ends (the forward and its collectives run to
the end on every rank); a fault in the model's own layers during a forward cannot be undone (the
other ranks wait inside that forward's collectives): that rank raises ``ProbeForwardBroken`` and the
run stops, never pairing the waiting collectives with training's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .capture import ProbeTarget, UnsupportedModelError

FullParams = Callable[[], contextlib.AbstractContextManager]

# The codes of one agreement: every rank must send the same one (FAIL never agrees).
FAIL, DONE, FORWARD, START, COMBINE = 0, 1, 2, 3, 4

# Test-only fault injection: ``SINKWATCH_TEST_FAULT=POINT@RANK`` (or ``POINT@RANK@STEP``; several,
# comma-separated) raises ``InjectedFault`` on that global rank at that point of a probe, so the tests
# can show what a fault there does. Points: "memory" (the pre-probe check says no), "stats" (inside
# sinkwatch's statistics, during a forward), "between" (after a probe forward, before the next),
# "after" (after the probe, before the ranks agree to write), "model" (inside the model's own
# forward: its middle block).
FAULT_ENV = "SINKWATCH_TEST_FAULT"
FAULT_POINTS = ("memory", "stats", "between", "after", "model")


@dataclass(frozen=True)
class RankFacts:
    """What this rank does at a probe step, decided once at fit start."""

    is_global_zero: bool
    world_size: int
    sharding: str | None  # "fsdp" (v1), "fsdp2", or None (single device, DDP)
    split: bool = False  # every data-parallel rank probes its share of the sequences (``sinkwatch.probe_share``)

    @property
    def probes_here(self) -> bool:
        """Rank 0 always probes; with sharded parameters every rank must join the collective forward;
        with the probe split over the ranks every rank runs its share."""
        return self.is_global_zero or self.sharding is not None or self.split

    @property
    def together(self) -> bool:
        """Whether every rank of the default group runs each probe (sharded parameters or a split probe)."""
        return self.sharding is not None or self.split

    @property
    def reports_here(self) -> bool:
        return self.is_global_zero


def rank_facts(module, *, is_global_zero: bool, world_size: int = 1, split: bool = False) -> RankFacts:
    """The facts for this rank; ``module`` is the model as the strategy wraps it (FSDP shards show there).
    ``split``: share each probe's sequences over the ranks, when there are several in an initialised group."""
    import torch.distributed as dist

    world = max(1, int(world_size))
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    split = bool(split and grouped and world > 1)
    return RankFacts(is_global_zero=bool(is_global_zero), world_size=world, sharding=_fsdp_kind(module)[0], split=split)


# ---- layouts refused ---------------------------------------------------------------------------
def check_layout(module, *, zero3: bool = False) -> None:
    """Refuse, at setup, a layout no rank can probe: DeepSpeed ZeRO-3 (``zero3``: the framework's
    config says stage 3; or parameters carrying ZeRO-3's ``ds_id``) and tensor parallelism
    (parameters sharded by a layout other than FSDP's). ``module``: the model as the strategy wraps it."""
    params = list(module.parameters()) if module is not None else []
    if zero3 or any(hasattr(p, "ds_id") for p in params):
        raise ValueError(
            "sinkwatch cannot probe a DeepSpeed ZeRO-3 model live: its parameters are partitioned and a probe on "
            "one rank would hang in DeepSpeed's all-gather. Use ZeRO stage 1 or 2 (rank 0 probes its full copy), "
            "FSDP/FSDP2 (every rank probes together), or save checkpoints and probe them "
            "afterwards with `sinkwatch replay` / `sinkwatch probe`."
        )
    sliced = tensor_parallel_params(module)
    if sliced:
        example = next((n for n in sliced if "attn" in n or "attention" in n), sliced[0])
        raise ValueError(
            f"sinkwatch cannot probe a tensor-parallel model live: {len(sliced)} parameters (e.g. {example}) hold only this "
            "rank's slice, so each rank computes only some heads: a probe on rank 0 alone would hang in the row-parallel "
            "all-reduce, and a probe on every rank would measure its local heads only. Train with FSDP2/HSDP or DDP "
            "(tensor_parallel_size=1, no tp_plan), or save checkpoints and probe them afterwards with `sinkwatch replay` / "
            "`sinkwatch probe` (a live record at step N equals the probe of the checkpoint saved at step N)."
        )


def tensor_parallel_params(module) -> list[str]:
    """Names of the parameters that hold a slice along a mesh dimension FSDP does not gather.

    A parameter sharded by tensor parallelism (torch's ``parallelize_module``, transformers'
    ``tp_plan``) is a DTensor with a non-replicated placement; under FSDP2 on top (the 2-D recipe)
    FSDP adds exactly one sharded placement of its own (HSDP: a replicated one and a sharded one),
    so only a second one is tensor parallelism."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    if module is None:
        return []
    fsdp2 = any(isinstance(m, FSDPModule) for m in module.modules())
    found = []
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            sharded = sum(not (pl.is_replicate() or pl.is_partial()) for pl in p.placements)
            if sharded > (1 if fsdp2 else 0):
                found.append(name)
    return found


# ---- FSDP: who gathers what --------------------------------------------------------------------
def fsdp_full_params(module) -> FullParams:
    """The context a sharded model's probe forward runs in; every rank must run it (a collective).

    FSDP (v1) wrappers: ``summon_full_params(recurse=False)`` on each outermost unit gathers the
    parameters that no inner unit owns (the probe calls the inner model, not the root's forward,
    which would have gathered them); each inner unit's forward then gathers its own, as in training.
    Gathering every unit up front (``recurse=True``) breaks with ``use_orig_params=False`` (the
    inner forwards find their flat parameters already unsharded: "Expects tensor to be unsharded").
    FSDP2 (``fully_shard``): each sharded module's forward pre-hook all-gathers its own parameters,
    so the forward needs nothing around it. Neither: a no-op context."""
    return _fsdp_kind(module)[1]


def fsdp1_param_dtype(module) -> torch.dtype | None:
    """The dtype FSDP (v1) units compute in under parameter mixed precision
    (``MixedPrecision(param_dtype=...)``: Lightning's ``FSDPStrategy(precision="bf16-mixed")``,
    accelerate's ``mixed_precision="bf16"``), or None (no FSDP v1, or full precision).

    The probe calls the model inside the root wrapper, not the root's forward: the root's own
    parameters (embeddings, head, final norm) stay in float32 under ``summon_full_params`` while
    each inner unit casts its own to ``param_dtype``, so the first block met float32 activations
    with bfloat16 weights on every rank ("mixed dtype (CPU): expect parameter to have scalar type
    of Float") and every run stopped at the step-0 probe. The probe then runs under autocast in
    this dtype, as the units compute in training."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if module is None:
        return None
    dtypes = {getattr(getattr(m, "mixed_precision", None), "param_dtype", None) for m in module.modules() if isinstance(m, FSDP)}
    dtypes.discard(None)
    dtypes.discard(torch.float32)
    return dtypes.pop() if len(dtypes) == 1 else (torch.bfloat16 if torch.bfloat16 in dtypes else None)


def fsdp1_root_runner(module) -> Callable[[Callable[[], object]], object] | None:
    """Under FSDP (v1) parameter mixed precision: a runner that calls ``fn`` (the whole probe)
    inside the root unit's own forward, so the root's parameters are gathered and cast to
    ``param_dtype`` exactly as in training and every inner unit computes on activations of its
    dtype; None otherwise (``fsdp_full_params`` then gathers with ``summon_full_params``).

    ``summon_full_params`` hands back full-precision parameters and autocast does not bridge the
    gap (CPU autocast leaves ``layer_norm`` alone: bfloat16 weights on float32 activations fail),
    so the probe runs where the root's forward would run its wrapped module: that module's
    ``forward`` is replaced for this one call by one that restores it and runs ``fn``. Whatever
    ``fn`` raises is re-raised after the root's forward has ended (its parameters resharded)."""
    if fsdp1_param_dtype(module) is None:
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = _outermost(module, FSDP)
    if len(units) != 1:
        return None
    root = units[0]

    def run(fn: Callable[[], object]) -> object:
        inner = root._fsdp_wrapped_module
        box: dict = {}

        def probe_in_root(*args, **kwargs):
            inner.__dict__.pop("forward", None)  # the probe's own forwards call the model's real forward
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised once the root's forward has ended
                box["error"] = exc
            return torch.zeros((), device=root.compute_device or "cpu")

        inner.forward = probe_in_root
        try:
            with torch.no_grad():
                root()
        finally:
            inner.__dict__.pop("forward", None)
        if "error" in box:
            raise box["error"]
        return box["value"]

    return run


def is_fsdp(module) -> bool:
    """Whether ``module`` holds FSDP or FSDP2 shards (then every rank probes together)."""
    return _fsdp_kind(module)[0] is not None


def _fsdp_kind(module) -> tuple[str | None, FullParams]:
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - torch without distributed
        return None, contextlib.nullcontext
    units = _outermost(module, FSDP)
    if units:
        # the outermost units (the root, when ``module`` is the strategy's wrapper) own whatever no
        # inner unit does; touching an inner unit first would make FSDP take it for the root
        def gather() -> contextlib.AbstractContextManager:
            stack = contextlib.ExitStack()
            for unit in units:
                stack.enter_context(FSDP.summon_full_params(unit, writeback=False, recurse=False))
            return stack

        return "fsdp", gather
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return "fsdp2", contextlib.nullcontext
    return None, contextlib.nullcontext


def _outermost(module, kind) -> list:
    """The instances of ``kind`` in ``module`` (itself included) that no other instance contains."""
    if isinstance(module, kind):
        return [module]
    found = []
    for child in module.children():
        found.extend(_outermost(child, kind))
    return found


# ---- the ranks that probe together -------------------------------------------------------------
class InjectedFault(RuntimeError):
    """A fault raised on purpose by ``SINKWATCH_TEST_FAULT`` (tests only)."""


class PeerFailed(RuntimeError):
    """Another rank could not go on with this probe; this rank stops it too (no message of its own)."""


class ProbeForwardBroken(RuntimeError):
    """A probe forward failed inside the model's own layers on this rank while the other ranks are
    inside that forward's collectives: nothing can pair them again, so the run must stop."""


class ProbeFaultEverywhere(RuntimeError):
    """Every rank of the group raised the same fault at the same place of a probe forward (the
    verdict on the c10d store): no collective was left unpaired, so the probe is skipped everywhere
    and training goes on."""


class ProbeNotReady(RuntimeError):
    """This rank cannot start a probe (the pre-probe check)."""


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


def config_token(config_hash: str | None) -> int:
    """The 48-bit integer of a 12-hex-digit config hash (0: none yet), as the agreements carry it."""
    return int(config_hash[:12], 16) if config_hash else 0


def group_device(backend: str, prefer: torch.device | str | None = None) -> torch.device:
    """The device of the tensors sinkwatch's collectives send over a group of ``backend``.

    ``backend`` is what ``dist.get_backend()`` says: one name ("nccl", "gloo") or per-device pairs
    ("cpu:gloo,cuda:nccl", OLMo-core's default). Each backend carries tensors of some device types
    only (NCCL: CUDA; gloo: CPU and CUDA): ``prefer`` (the model's device) when the group carries
    its type, else CPU when it does, else the first type it carries. Never a CPU tensor to an
    NCCL-only group (which fails), never a needless device copy."""
    from torch.distributed import Backend

    text = backend.strip().lower()
    if ":" in text:  # "cpu:gloo,cuda:nccl": the device types are named
        types = [pair.split(":", 1)[0].strip() for pair in text.split(",") if pair.strip()]
    else:
        types = list(Backend.backend_capability.get(text, ["cpu"]))
    want = torch.device(prefer).type if prefer is not None else None
    kind = want if want in types else ("cpu" if "cpu" in types else types[0])
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if want == kind and prefer is not None and torch.device(prefer).index is not None:
        return torch.device(prefer)
    return torch.device(kind)


class ProbeGroup:
    """The ranks that run each probe together: this rank alone (``size`` 1: nothing to agree), or
    every rank of the default process group when the parameters are sharded.

    Every collective here is issued by every rank of the group at the same point of the same
    probe: ``broadcast_windows`` when the natural probe is frozen, then per probe a sequence of
    ``agree`` calls (START, FORWARD before each forward, DONE) that all ranks see the same verdict
    of; after the first verdict that is not unanimous no rank sends another, so a rank that stops
    early never leaves one unpaired. ``gather`` then tells rank 0 who failed and why."""

    def __init__(self, size: int = 1, *, prefer: torch.device | str | None = None):
        self.size = size
        self.rank = global_rank() if size > 1 else 0
        self._closed = False
        self.device = torch.device("cpu")
        self.fault_timeout_s = FAULT_TIMEOUT_S  # how long a rank that faulted in a forward waits for the others' verdicts
        self._stretches = 0  # collective stretches entered (the same count on every rank while they run in step)
        # whether a probe forward is itself a collective (sharded parameters: its all-gathers); under a
        # split DDP probe it is not, and a fault in it is an ordinary failed verdict, as in one process
        self.forwards_collective = True
        self._id = 0
        if size > 1:
            import torch.distributed as dist

            global _GROUPS
            _GROUPS += 1  # every rank builds its groups in the same order (at setup): the same id everywhere
            self._id = _GROUPS
            self.device = group_device(str(dist.get_backend()), prefer)

    @classmethod
    def for_rank(cls, facts: RankFacts, *, prefer: torch.device | str | None = None) -> ProbeGroup:
        """Every rank together when the parameters are sharded (and there are several ranks), else alone.
        ``prefer``: the model's device; the agreements use it when the group carries its tensors."""
        import torch.distributed as dist

        if facts.together and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = cls(dist.get_world_size(), prefer=prefer)
            group.forwards_collective = facts.sharding is not None
            return group
        return cls(1)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def begin(self) -> None:
        """A new probe: agreements count again."""
        self._closed = False

    def agree(self, code: int, token: int) -> bool:
        """One all-reduced verdict: True when every rank sent this same code and token, and the code is not FAIL."""
        if self.size == 1:
            return code != FAIL
        if self._closed:
            return False
        import torch.distributed as dist

        both = torch.tensor([code, -code, token, -token], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MIN)
        low, high, tlow, thigh = (int(v) for v in both.cpu())
        ok = low == -high == code and tlow == -thigh and code != FAIL
        self._closed = not ok
        return ok

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
        from .probe_share import ProbeShare

        def combine(tensor: torch.Tensor) -> None:
            if not self.agree(COMBINE, token):
                raise PeerFailed("another rank stopped this probe")
            with self.collective(step, "combining the ranks' shares of the probe"):
                self.all_reduce_sum(tensor)

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

    def guard(self, target: ProbeTarget, step: int, token: int) -> ProbeTarget:
        """``target`` as the probe of ``step`` runs it in this group (itself when alone)."""
        return target if self.size == 1 else _GuardedTarget(target, self, step, token)

    @contextlib.contextmanager
    def collective(self, step: int, what: str, *, paired: bool = True) -> Iterator[None]:
        """A stretch every rank runs in step (a forward, a parameter gather): a fault escaping it on
        one rank leaves the others inside its collectives, so it becomes ``ProbeForwardBroken``.
        ``paired`` False: the stretch issues no collective (a split probe's forward under DDP), and a
        fault in it passes as is (the next agreement says FAIL for it).
        ``UnsupportedModelError``/``ValueError``/``TypeError`` (sinkwatch's checks of the model and the
        probe batch) pass: they come from inputs every rank shares, so every rank raises them alike."""
        self._stretches += 1
        stretch = self._stretches
        try:
            yield
        except (UnsupportedModelError, ValueError, TypeError, PeerFailed, ProbeForwardBroken, ProbeFaultEverywhere):
            raise
        except Exception as exc:
            if self.size == 1 or not paired:
                raise
            verdict = self._fault_verdict(stretch, exc)
            if verdict is None:
                raise ProbeFaultEverywhere(
                    f"every rank raised the same fault in {what} ({type(exc).__name__}: {exc}); the probe is skipped on every "
                    "rank and training goes on"
                ) from exc
            raise ProbeForwardBroken(
                f"sinkwatch: {what} at step {step} failed on rank {self.rank} ({type(exc).__name__}: {exc}) while the other "
                f"ranks are inside its collectives ({verdict}); nothing can pair them again, so the run stops here instead of "
                "letting them pair with training's collectives (a hang or silently wrong numbers). Resume from the last "
                "checkpoint; after an out-of-memory, lower MonitorConfig(batch_tokens=...) (tokens per probe forward)."
            ) from exc

    def _fault_verdict(self, stretch: int, exc: BaseException) -> str | None:
        """After a fault inside a collective stretch: None when every rank of the group posted the same
        fault at the same place of the same stretch, else why not. The verdict goes through the c10d
        store (keys, not collectives: it cannot pair with the model's collectives another rank is still
        inside), and waits at most ``fault_timeout_s`` for the other ranks."""
        import datetime

        import torch.distributed as dist

        try:
            store = dist.PrefixStore(f"sinkwatch/fault/{self._id}/{stretch}", dist.distributed_c10d._get_default_store())
            mine = fault_signature(exc)
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


FAULT_TIMEOUT_S = 60.0  # default wait for the other ranks' fault verdicts (LiveConfig.fault_timeout_s)
_GROUPS = 0  # ProbeGroups of several ranks built in this process (their ids name their store keys)


def fault_signature(exc: BaseException) -> str:
    """What makes two ranks' faults "the same fault at the same place": the exception type, its
    message with rank and device numbers blanked, and the line that raised it (innermost frame)."""
    import re

    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"
    message = re.sub(r"(rank|cuda:|GPU|device)\s*\d+", r"\1 N", str(exc))
    return f"{type(exc).__name__}: {message} @ {where}"


class _HeldFaults:
    """The probe's collector, with faults in sinkwatch's own statistics held until the forward ends:
    the forward, and so every collective in it, then runs to the end on every rank."""

    def __init__(self, inner, step: int):
        self.inner, self.step = inner, step
        self.fault: BaseException | None = None

    def _call(self, method: str, *args):
        if self.fault is None:
            try:
                if method == "on_attention":
                    fault_point("stats", self.step)
                return getattr(self.inner, method)(*args)
            except Exception as exc:  # noqa: BLE001 - raised once the forward is over
                self.fault = exc
        return args[-1] if method == "on_attention_output" else None

    # one method per hook of capture's ``Collector`` protocol: a hook missing here would be lost to the probe
    def on_attention(self, layer, query, key, scaling, window, softcap, sinks=None):
        self._call("on_attention", layer, query, key, scaling, window, softcap, sinks)

    def on_attention_output(self, layer, output):
        return self._call("on_attention_output", layer, output)

    def on_head_output(self, layer, output):
        self._call("on_head_output", layer, output)

    def on_gate(self, layer, gate):
        self._call("on_gate", layer, gate)

    def on_block_output(self, layer, hidden):
        self._call("on_block_output", layer, hidden)

    def on_block_input(self, layer, hidden):
        self._call("on_block_input", layer, hidden)

    def on_sublayer_output(self, layer, kind, output):
        self._call("on_sublayer_output", layer, kind, output)


class _GuardedTarget(ProbeTarget):
    """A target whose probe forwards run only on the group's unanimous go, with statistics faults held."""

    def __init__(self, inner: ProbeTarget, group: ProbeGroup, step: int, token: int):
        self.inner, self.group, self.step, self.token = inner, group, step, token
        self.module, self.name = inner.module, inner.name

    def blocks(self):
        return self.inner.blocks()

    @property
    def n_layers(self) -> int:
        return self.inner.n_layers

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def context(self) -> int | None:
        return self.inner.context

    @contextlib.contextmanager
    def capture(self, collector):
        held = _HeldFaults(collector, self.step)
        hooks = []
        if os.environ.get(FAULT_ENV):  # the "model" test point: a fault inside the model's own forward
            blocks = self.inner.blocks()
            hooks.append(blocks[len(blocks) // 2].register_forward_pre_hook(lambda *_: fault_point("model", self.step)))
        try:
            with self.inner.capture(held) as forward:

                def agreed_forward(input_ids: torch.Tensor, **kw):
                    if not self.group.agree(FORWARD, self.token):
                        raise PeerFailed("another rank stopped this probe")
                    with self.group.collective(self.step, "a probe forward", paired=self.group.forwards_collective):
                        out = forward(input_ids, **kw)
                    if held.fault is not None:
                        raise held.fault
                    fault_point("between", self.step)
                    return out

                yield agreed_forward
        finally:
            for h in hooks:
                h.remove()


def check_probe_memory(target: ProbeTarget, sets, batch_tokens: int, step: int) -> None:
    """The pre-probe check of this rank: on a CUDA device, the memory the probe's largest micro-batch
    allocates (``probe_memory.estimate``) against free memory plus the caching allocator's unused
    reserve, else ``ProbeNotReady`` naming a ``batch_tokens`` that fits; also the "memory" test
    fault point."""
    fault_point("memory", step)
    device = target.device
    if device.type != "cuda":
        return
    from .probe_memory import available_bytes, memory_verdict

    verdict = memory_verdict(target, sets, batch_tokens, available_bytes(device))
    if verdict is not None:
        raise ProbeNotReady(verdict)
