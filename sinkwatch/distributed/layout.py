"""The parallel layout a live probe runs on: who probes, what is refused, how a sharded model is gathered.

Who probes (``RankFacts``). By default (``LiveConfig(split_probe=True)``) every data-parallel rank runs
its share of each probe's sequences and one all-reduce combines the shares (``sinkwatch.probe.share``);
only global rank 0 reports. DDP: each rank probes the bare module (the DDP wrapper would wait for the
other ranks' backward and hang). FSDP (v1): every rank together, inside
``summon_full_params(recurse=False)`` on each outermost unit: that gathers the parameters no inner unit
owns, and each inner unit gathers its own in its forward, as in training (under parameter mixed
precision the probe runs inside the root unit's own forward instead: ``ProbeLayout``). FSDP2 / HSDP
(``fully_shard``): every rank together; each sharded module all-gathers its own parameters in its
forward. With ``split_probe=False``: DDP's rank 0 probes alone while the others go on to wait at the
next training collective, and sharded ranks each run the whole probe.

Whatever a probe gathers is given back before training resumes (``ProbeLayout.run``): FSDP v1's root
keeps its flat parameter unsharded after a forward (it expects the backward next), ``SHARD_GRAD_OP``
units keep theirs, and so does FSDP2's root; left so, the optimizer would update the shards and the
next training forward would skip its all-gather and compute on the pre-update parameters.

Tensor parallelism (``TensorParallel``, given by the adapter that knows the mesh: Megatron-core,
torchtitan): every rank probes together, the ranks of a tensor-parallel group the same sequences (their
data-parallel replica's share), each its own heads, gathered in global order (``sinkwatch.distributed.
tensor_parallel``). Refused at setup (``check_layout``), with what to do instead: tensor parallelism no
adapter described (a rank holds only some heads: a probe on rank 0 alone would hang in the row-parallel
all-reduce, one on every rank would measure its local heads only) and DeepSpeed ZeRO-3 (a probe on rank 0
alone would hang in DeepSpeed's all-gather).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .tensor_parallel import TensorParallel, hand_sliced_params


@dataclass(frozen=True)
class RankFacts:
    """What this rank does at a probe step, decided once at fit start."""

    is_global_zero: bool
    world_size: int
    sharding: str | None  # "fsdp" (v1), "fsdp2", or None (single device, DDP)
    split: bool = False  # every data-parallel rank probes its share of the sequences (``sinkwatch.probe.share``)
    tp: TensorParallel | None = None  # tensor parallelism: this rank's heads and data-parallel replica

    @property
    def probes_here(self) -> bool:
        """Rank 0 always probes; with sharded parameters every rank must join the collective forward;
        with the probe split over the ranks every rank runs its share; under tensor parallelism every rank
        computes its heads."""
        return self.is_global_zero or self.sharding is not None or self.split or self.tp is not None

    @property
    def together(self) -> bool:
        """Whether every rank of the default group runs each probe (sharded parameters, a split probe,
        tensor parallelism)."""
        return self.sharding is not None or self.split or self.tp is not None

    @property
    def reports_here(self) -> bool:
        return self.is_global_zero


def rank_facts(
    module, *, is_global_zero: bool, world_size: int = 1, split: bool = False, tp: TensorParallel | None = None
) -> RankFacts:
    """The facts for this rank; ``module`` is the model as the strategy wraps it (FSDP shards show there).
    ``split``: share each probe's sequences over the ranks, when there are several in an initialised group.
    ``tp``: tensor parallelism (then ``world_size`` is its data-parallel size, and the probe is split over it)."""
    import torch.distributed as dist

    world = max(1, int(world_size if tp is None else tp.dp_size))
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    split = bool(split and grouped and world > 1)
    if tp is not None and tp.size > 1:  # (one tensor-parallel rank: data parallelism as any other)
        return RankFacts(is_global_zero=bool(is_global_zero), world_size=world, sharding=None, split=split, tp=tp)
    return RankFacts(is_global_zero=bool(is_global_zero), world_size=world, sharding=_sharding(module), split=split)


# ---- layouts refused ---------------------------------------------------------------------------
def check_layout(module, *, zero3: bool = False, tensor_parallel: TensorParallel | None = None) -> None:
    """Refuse, at setup, a layout no rank can probe: DeepSpeed ZeRO-3 (``zero3``: the framework's
    config says stage 3; or parameters carrying ZeRO-3's ``ds_id``) and tensor parallelism no adapter
    described (``tensor_parallel`` None: parameters sharded by a layout other than FSDP's, or marked
    tensor-parallel by Megatron-core). ``module``: the model as the strategy wraps it."""
    params = list(module.parameters()) if module is not None else []
    if zero3 or any(hasattr(p, "ds_id") for p in params):
        raise ValueError(
            "sinkwatch cannot probe a DeepSpeed ZeRO-3 model live: its parameters are partitioned and a probe on "
            "one rank would hang in DeepSpeed's all-gather. Use ZeRO stage 1 or 2 (rank 0 probes its full copy), "
            "FSDP/FSDP2 (every rank probes together), or save checkpoints and probe them "
            "afterwards with `sinkwatch replay` / `sinkwatch probe`."
        )
    if tensor_parallel is not None:
        _check_tensor_parallel(tensor_parallel)
        return
    sliced = tensor_parallel_params(module) or hand_sliced_params(module)
    if sliced:
        example = next((n for n in sliced if "attn" in n or "attention" in n), sliced[0])
        raise ValueError(
            f"sinkwatch cannot probe a tensor-parallel model live: {len(sliced)} parameters (e.g. {example}) hold only this "
            "rank's slice, so each rank computes only some heads: a probe on rank 0 alone would hang in the row-parallel "
            "all-reduce, and a probe on every rank would measure its local heads only. sinkwatch gathers each rank's heads "
            "where the framework defines the plan (sinkwatch.megatron, sinkwatch.torchtitan), not under a plan applied by "
            "hand (parallelize_module, tp_plan), whose heads' layout, sequence-parallel residual stream and output sharding "
            "the strategy does not describe. Train with FSDP2/HSDP or DDP (tensor_parallel_size=1, no tp_plan), or save "
            "checkpoints and probe them afterwards with `sinkwatch replay` / `sinkwatch probe` (a live record at step N "
            "equals the probe of the checkpoint saved at step N)."
        )


def _check_tensor_parallel(tp: TensorParallel) -> None:
    """Every rank of the job is one tensor-parallel rank of one data-parallel replica (no pipeline or
    context parallelism on top, which would leave ranks outside both)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if tp.size * tp.dp_size != world:
        raise ValueError(
            f"sinkwatch: tensor parallelism {tp.size} x data parallelism {tp.dp_size} is not the {world} ranks of the job; "
            "every rank must be one tensor-parallel rank of one data-parallel replica (pipeline and context parallelism "
            "are not supported live: docs/live.md, \"Distributed training\")"
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


# ---- how the probe runs on this layout ---------------------------------------------------------
@dataclass(frozen=True)
class ProbeLayout:
    """How this rank runs a probe, decided once at setup: ``facts`` (who probes), the dtype the probe
    forwards compute in (the record's ``probe_dtype``) and whether autocast makes it so, and ``outer``,
    the model as the strategy wraps it (where FSDP shows)."""

    facts: RankFacts
    dtype: torch.dtype = torch.float32
    autocast: bool = False
    outer: torch.nn.Module | None = None

    @classmethod
    def of(
        cls, module, outer, *, is_global_zero: bool, world_size: int = 1, split: bool = False, compute_dtype=None,
        tp: TensorParallel | None = None,
    ) -> ProbeLayout:  # fmt: skip
        """``module``: what is probed; ``outer``: the model as the strategy wraps it. ``compute_dtype``:
        the trainer's autocast dtype under mixed precision (Lightning ``bf16-mixed``, HF ``bf16=True``,
        OLMo-core ``autocast_precision``): the probe forwards run under autocast in it, statistics
        accumulating in float32. None: FSDP parameter mixed precision's ``param_dtype`` if any (the
        units cast their own parameters, as in training: no autocast), else the model's own dtype."""
        facts = rank_facts(outer, is_global_zero=is_global_zero, world_size=world_size, split=split, tp=tp)
        if compute_dtype is None:
            cast = fsdp1_param_dtype(outer) or fsdp2_param_dtype(outer)
            if cast is not None:
                return cls(facts, cast, False, outer)
        return cls(facts, *probe_compute_dtype(module, compute_dtype), outer)

    def run(self, fn: Callable[[], object], *, device_type: str, gathering=contextlib.nullcontext) -> object:
        """``fn()`` (the probe) where it runs on this layout: eagerly through compiled modules, in the
        probe's dtype, with what a sharded model needs gathered first (``gathering()``: the context of
        that collective stretch) and everything it gathered given back after. Whatever ``fn`` raises is
        raised after the gathered parameters are given back."""
        autocast = (
            torch.autocast(device_type, dtype=self.dtype, cache_enabled=False)  # no cast copy of every weight held for the probe
            if self.autocast
            else contextlib.nullcontext()
        )
        try:
            with eager_forwards(), autocast:
                root = _fsdp1_mixed_root(self.outer)
                if root is not None:
                    return _in_root_forward(root, fn, gathering)
                with _summoned(self.outer, gathering):
                    return fn()
        finally:
            reshard(self.outer)


def eager_forwards() -> contextlib.AbstractContextManager:
    """Probe forwards run eagerly through compiled modules (``torch.compiler.set_stance("force_eager")``):
    under per-block ``torch.compile`` (OLMo-core's ``apply_compile``, ``module.compile()``) Dynamo
    would otherwise trace each block again with sinkwatch's hooks on it (2 -> 44 graphs after one
    probe of a 2-block model), and a ``fullgraph=True`` block would fail the probe. Training's own
    graphs stay as they were; the stance is restored on the way out."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def probe_compute_dtype(module, compute_dtype: torch.dtype | None) -> tuple[torch.dtype, bool]:
    """(the dtype the probe forward computes in, whether autocast must make it so). The model's own
    floating dtype when no compute dtype is given or it equals that (bf16-true weights: no autocast)."""
    own = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    if compute_dtype is None or compute_dtype == own:
        return own, False
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise TypeError(f"compute_dtype must be a floating torch.dtype (torch.bfloat16, torch.float16), got {compute_dtype!r}")
    return compute_dtype, True


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the record's ``probe_dtype``)."""
    return str(dtype).removeprefix("torch.")


def fsdp1_param_dtype(module) -> torch.dtype | None:
    """The dtype FSDP (v1) units compute in under parameter mixed precision
    (``MixedPrecision(param_dtype=...)``: Lightning's ``FSDPStrategy(precision="bf16-mixed")``,
    accelerate's ``mixed_precision="bf16"``), or None (no FSDP v1, or full precision)."""
    FSDP = _fsdp1_class()
    if FSDP is None or module is None:
        return None
    dtypes = {getattr(getattr(m, "mixed_precision", None), "param_dtype", None) for m in module.modules() if isinstance(m, FSDP)}
    dtypes.discard(None)
    dtypes.discard(torch.float32)
    return dtypes.pop() if len(dtypes) == 1 else (torch.bfloat16 if torch.bfloat16 in dtypes else None)


def fsdp2_param_dtype(module) -> torch.dtype | None:
    """The dtype ``fully_shard``'s ``MixedPrecisionPolicy(param_dtype=...)`` casts the parameters to at
    every all-gather, probe forwards included (OLMo-core's and torchtitan's standard configuration),
    where it differs from the parameters' own; None where nothing is sharded or cast."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if module is None:
        return None
    dtypes = set()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()  # where fully_shard keeps its policy (no public accessor in torch 2.13)
            dtypes.add(getattr(getattr(state, "_mp_policy", None), "param_dtype", None))
    dtypes.discard(None)
    own = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    dtypes.discard(own)
    return dtypes.pop() if len(dtypes) == 1 else None


def is_fsdp(module) -> bool:
    """Whether ``module`` holds FSDP or FSDP2 shards (then every rank probes together)."""
    return _sharding(module) is not None


def reshard(module) -> None:
    """Give back what a probe left gathered: every FSDP2 module's parameters (``FSDPModule.reshard``;
    the root keeps them after a forward), and every FSDP (v1) unit's flat parameter still unsharded
    (the root after its forward, ``SHARD_GRAD_OP`` units after theirs). No collective: each rank frees
    its own copy."""
    if module is None:
        return
    FSDP = _fsdp1_class()
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
        elif FSDP is not None and isinstance(m, FSDP):
            handle = getattr(m, "_handle", None)
            if handle is not None and handle.uses_sharded_strategy and not handle.needs_unshard():
                from torch.distributed.fsdp._runtime_utils import _reshard  # FSDP v1 has no public reshard

                _reshard(m, handle, True)


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


# ---- FSDP: who gathers what --------------------------------------------------------------------
def _fsdp1_class():
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return FullyShardedDataParallel


def _sharding(module) -> str | None:
    if module is None:
        return None
    FSDP = _fsdp1_class()
    if FSDP is None:
        return None
    if _outermost(module, FSDP):
        return "fsdp"
    from torch.distributed.fsdp import FSDPModule

    return "fsdp2" if any(isinstance(m, FSDPModule) for m in module.modules()) else None


@contextlib.contextmanager
def _summoned(module, gathering):
    """FSDP (v1) without parameter mixed precision: ``summon_full_params(recurse=False)`` on each outermost
    unit gathers the parameters that no inner unit owns (the probe calls the inner model, not the root's
    forward, which would have gathered them); each inner unit's forward then gathers its own, as in
    training. Gathering every unit up front (``recurse=True``) breaks with ``use_orig_params=False`` (the
    inner forwards find their flat parameters already unsharded: "Expects tensor to be unsharded"). The
    gather is a collective (inside ``gathering()``); giving back is not. FSDP2 and no FSDP: nothing."""
    FSDP = _fsdp1_class()
    units = _outermost(module, FSDP) if module is not None and FSDP is not None else []
    with contextlib.ExitStack() as stack:
        if units:
            # the outermost units (the root, when ``module`` is the strategy's wrapper) own whatever no
            # inner unit does; touching an inner unit first would make FSDP take it for the root
            with gathering():
                for unit in units:
                    stack.enter_context(FSDP.summon_full_params(unit, writeback=False, recurse=False))
        yield


def _fsdp1_mixed_root(module):
    """The FSDP (v1) root unit under parameter mixed precision, or None.

    ``summon_full_params`` hands back full-precision parameters and autocast does not bridge the gap (CPU
    autocast leaves ``layer_norm`` alone: bfloat16 weights on float32 activations fail), so under
    ``MixedPrecision(param_dtype=...)`` the probe runs inside the root's own forward, where its parameters
    are gathered and cast as in training and every inner unit computes on activations of its dtype."""
    if fsdp1_param_dtype(module) is None:
        return None
    units = _outermost(module, _fsdp1_class())
    return units[0] if len(units) == 1 else None


def _in_root_forward(root, fn: Callable[[], object], gathering) -> object:
    """``fn()`` inside ``root``'s forward: its wrapped module's ``forward`` is replaced for this one call by
    one that restores it and runs ``fn``. The root's forward (its all-gather) runs inside ``gathering()``;
    whatever ``fn`` raises is re-raised after that forward has ended."""
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
        with gathering(), torch.no_grad():
            root()
    finally:
        inner.__dict__.pop("forward", None)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _outermost(module, kind) -> list:
    """The instances of ``kind`` in ``module`` (itself included) that no other instance contains."""
    if isinstance(module, kind):
        return [module]
    found = []
    for child in module.children():
        found.extend(_outermost(child, kind))
    return found
