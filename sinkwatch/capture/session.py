"""The probe-time capture session, shared by every kind of target (docs/design.md §2).

A ``CaptureSession`` maps each attention call to the decoder block it runs in (a forward pre-hook
on every block says which block is running), so blocks without softmax attention (Mamba, linear
attention, convolutions in hybrid stacks) simply see no call, and one attention module shared by
several blocks (Zamba2) counts once per block it runs in. It fans every call out to the
``Collector``; ``activate`` makes it the one session the attention entry points see.

What a head writes (PR, docs/design.md §5) is read where the model hands it to its output projection, when
the target names that module: gated attention (Qwen3-Next, OLMo-core) multiplies the attention
output by a gate between the two, and the ratio of the two tensors is the gate itself.

Where a target hands ``attend`` the values too, sinkwatch computes the attention output itself in
the pass that gives the statistics (``kernels.attention_output``, on CPU by default; docs/kernels.md),
so a probe forward runs one attention per block, not two. The first such call for each kind of
attention module (dtype, device, window, soft-cap, sinks) in a process is compared with the model's
own attention; a mismatch is warned about once and that kind keeps the model's attention.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from ..kernels import AttentionOutput, attention_output, output_backend
from ..kernels.api import output_tolerance
from .sublayers import find_sublayers, norm_children
from .tensor_parallel import whole


class Collector(Protocol):
    """What a probe computes from one forward; every method sees one micro-batch."""

    def on_attention(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        scaling: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> None:
        """query (B, Hq, S, D) post-RoPE, key (B, Hkv, S, D) before repeat_kv, sinks (Hq,) learned
        sink logits or None. ``layer`` is the index of the block the call ran in."""

    def on_fused_attention(self, layer: int, fused: AttentionOutput) -> None:
        """Optional: called just before ``on_attention`` of the same call when sinkwatch computed the
        attention output itself, in one pass over the keys (``kernels.attention_output``). Its lse
        lets the statistics skip a pass of their own (``attention_stats(..., fused=...)``); a
        collector without this method is as correct, its statistics make their own pass."""

    def on_attention_output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        """output (B, S, Hq, Dv): the attention output. Return it (possibly ablated)."""

    def on_head_output(self, layer: int, output: torch.Tensor) -> None:
        """output (B, S, Hq, Dv): what each head writes, after the gate of gated attention (the
        input of the output projection)."""

    def on_gate(self, layer: int, gate: torch.Tensor) -> None:
        """gate (B, S, Hq, Dv) float32: the factor gated attention applied to each output element
        (NaN where the attention output was exactly 0 and the factor cannot be read)."""

    def on_block_output(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden (B, S, d): the residual stream after block ``layer``."""

    def on_block_input(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden (B, S, d): the residual stream entering block ``layer`` (block 0: the embeddings
        as the blocks see them, after any scaling or embedding norm)."""

    def on_sublayer_output(self, layer: int, kind: str, output: torch.Tensor) -> None:
        """output (B, S, d): what block ``layer``'s sublayer ``kind`` (``"attention"``, ``"mlp"``)
        writes into the residual stream (``capture/sublayers.py``)."""


class UnsupportedModelError(TypeError):
    """The model cannot be probed: it does not expose its attention to sinkwatch."""


_ACTIVE: CaptureSession | None = None
# (attention class, dtype, device type, window?, soft-cap?, sinks?) -> whether sinkwatch's fused
# output matched the model's own attention on its first call in this process
_FUSION_AGREES: dict[tuple, bool] = {}


def active_session() -> CaptureSession | None:
    """The session of the probe running now, or None outside a probe."""
    return _ACTIVE


@dataclass
class CaptureSession:
    """Maps attention calls to the block they run in and fans them out to the collector.

    ``hooks()`` installs the block hooks (which block is running; the residual stream after it);
    ``begin()``/``end()`` bracket one forward. The blocks that ran softmax attention in the first
    forward are ``softmax_layers``; every later forward must see the same ones.
    """

    collector: Collector
    blocks: nn.ModuleList
    model_name: str
    softmax_layers: tuple[int, ...] | None = None
    _block: int | None = None  # the block running now
    _called: set = field(default_factory=set)  # blocks that ran attention in this forward
    _kinds: set = field(default_factory=set)  # classes of the modules that called attention
    _pending: dict = field(default_factory=dict)  # id(output projection) -> (layer, attention output)
    _projections: dict = field(default_factory=dict)  # id(output projection) -> hook handle
    _muted: bool = False  # extra forwards (losses of a head sinkwatch cannot reproduce) are not measured
    _written: dict = field(default_factory=dict)  # kind -> (layer, sublayer output) not yet handed on
    _post_norm: dict = field(default_factory=dict)  # id(norm) -> (layer, kind): a norm consuming a sublayer output

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """Forwards inside this context reach no collector: attention delegates, block hooks pass."""
        was, self._muted = self._muted, True
        try:
            yield
        finally:
            self._muted = was

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    # ---- one forward ----
    def begin(self) -> None:
        self._block = None
        self._called = set()
        self._pending = {}
        self._written = {}
        self._post_norm = {}

    def end(self) -> None:
        called = tuple(sorted(self._called))
        if not called:
            raise UnsupportedModelError(
                f"{self.model_name}: sinkwatch saw no softmax attention in any of its {self.n_layers} blocks; its attention "
                "bypasses sinkwatch (transformers' AttentionInterface or sinkwatch.attend)"
            )
        if self.softmax_layers is None:
            self._check_no_block_bypassed(called)
            self.softmax_layers = called
        elif called != self.softmax_layers:
            raise UnsupportedModelError(
                f"{self.model_name}: attention ran in blocks {list(called)} in this forward but in {list(self.softmax_layers)} "
                "in the first; sinkwatch needs the same blocks to run softmax attention in every forward"
            )

    def _check_no_block_bypassed(self, called: tuple[int, ...]) -> None:
        """A block holding an attention module of a kind that reached sinkwatch elsewhere must have
        called it too: otherwise its attention bypassed sinkwatch, and a null row would hide it."""
        kinds = tuple(self._kinds)
        for i, block in enumerate(self.blocks):
            if i in called:
                continue
            held = next((m for m in block.modules() if type(m) in kinds), None)
            if held is not None:
                raise UnsupportedModelError(
                    f"{self.model_name}: block {i} holds a {type(held).__name__} like blocks {list(called)}, but its attention never "
                    "reached sinkwatch (it bypasses transformers' AttentionInterface or sinkwatch.attend)"
                )

    # ---- the attention entry point of every target ----
    def attend(
        self,
        delegate: Callable[[], torch.Tensor],
        module,
        query,
        key,
        scaling: float,
        window,
        softcap,
        sinks: torch.Tensor | None = None,
        output_projection: nn.Module | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Statistics from query/key (and learned sink logits), then ``delegate()`` -> (B, S, Hq, Dv),
        returned possibly ablated. ``output_projection``: the module the model hands the (gated)
        head outputs to next, so that what each head writes is read there.

        ``value`` (B, Hkv, S, Dv), not repeated: the target lets sinkwatch compute the output
        itself — plain causal attention with exactly these scaling, window, soft-cap and sinks, no
        dropout, no other mask — and ``delegate`` is then called only where sinkwatch does not
        (``kernels.output_backend``: the model's own attention on GPU by default)."""
        if self._muted:
            return delegate()
        layer = self._block
        if layer is None:
            raise UnsupportedModelError(
                f"{self.model_name}: attention ran outside its decoder blocks; sinkwatch maps every attention call to the block it runs in"
            )
        if layer in self._called:
            raise UnsupportedModelError(
                f"{self.model_name}: block {layer} ran softmax attention twice in one forward; sinkwatch measures one attention per block"
            )
        self._called.add(layer)
        if module is not None:
            self._kinds.add(type(module))
        fused = self._fused(module, delegate, query, key, value, float(scaling), window, softcap, sinks) if value is not None else None
        hand = getattr(self.collector, "on_fused_attention", None)
        if fused is not None and hand is not None:
            hand(layer, fused)
        self.collector.on_attention(layer, query, key, float(scaling), window, softcap, sinks)
        out = delegate() if fused is None else fused.output.transpose(1, 2).contiguous()  # (B, S, Hq, Dv) as delegates give it
        del fused  # the lse and the (B, Hq, S, Dv) layout go now; the output lives on in the model
        out = self.collector.on_attention_output(layer, out)
        if output_projection is None:
            self.collector.on_head_output(layer, out)
        else:
            self._read_at(output_projection, layer, out)
        return out

    def _fused(self, module, delegate, query, key, value, scaling, window, softcap, sinks) -> AttentionOutput | None:
        """sinkwatch's own output and lse, or None where the model's attention computes the output."""
        if not (query.dtype == key.dtype == value.dtype):
            # mixed dtypes: autocast is on (e.g. RoPE in float32 on bf16 projections); the model's
            # attention applies autocast's casts, which are part of the forward it would run
            return None
        backend = output_backend(query.device, query.dtype)
        if backend is None:
            return None
        fused = attention_output(query, key, value, scaling, window=window, softcap=softcap, sinks=sinks, backend=backend)
        kind = (type(module), query.dtype, query.device.type, window is not None, softcap is not None, sinks is not None)
        if kind not in _FUSION_AGREES:
            _FUSION_AGREES[kind] = _agrees(kind, fused.output.transpose(1, 2), delegate(), value)
        return fused if _FUSION_AGREES[kind] else None

    def _read_at(self, projection: nn.Module, layer: int, out: torch.Tensor) -> None:
        key = id(projection)
        self._pending[key] = (layer, out)
        if key not in self._projections:
            self._projections[key] = projection.register_forward_pre_hook(self._projection_hook(key))

    def _projection_hook(self, key: int):
        def hook(_module, args):
            pending = self._pending.pop(key, None)
            if pending is None or not args or not isinstance(args[0], torch.Tensor):
                return None
            layer, out = pending
            x = args[0]
            local = _dtensor_heads(x)  # a tensor-parallel rank's own heads, side by side
            x = local if local is not None else whole(x)
            B, S = out.shape[:2]
            if x.shape[:2] != (B, S) or x.numel() != out.numel():
                self.collector.on_head_output(layer, out)  # not the heads side by side: read the attention output
                return None
            written = x.reshape(out.shape)  # (B, S, Hq, Dv)
            self.collector.on_head_output(layer, written)
            if not torch.equal(written, out):  # gated attention: the factor between the two is the gate
                pre = out.float()
                gate = torch.where(pre != 0, written.float() / torch.where(pre != 0, pre, 1.0), float("nan"))
                self.collector.on_gate(layer, gate)
            return None

        return hook

    def _flush(self, layer: int) -> None:
        """A block ended without handing its attention output to the projection: read it as it was."""
        for key, (l, out) in list(self._pending.items()):
            if l == layer:
                del self._pending[key]
                self.collector.on_head_output(layer, out)

    # ---- block hooks ----
    def hooks(self) -> list:
        """Pre-hooks saying which block runs (block 0's also reads the embeddings); hooks handing each
        block's output (the residual stream) and its sublayers' outputs to the collector. Remove them
        (and the output-projection hooks) with ``remove``."""
        handles = []
        for i, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(self._enter(i), with_kwargs=True))
            handles.append(block.register_forward_hook(self._leave(i)))
            for kind, sublayer in find_sublayers(block).items():
                handles.append(sublayer.register_forward_hook(self._sublayer_out(i, kind)))
            for norm in norm_children(block):
                handles.append(norm.register_forward_pre_hook(self._norm_in))
                handles.append(norm.register_forward_hook(self._norm_out))
        return handles

    def _enter(self, i: int):
        def hook(_module, args, kwargs):
            if self._muted:
                return
            self._block = i
            if i == 0:
                hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
                if isinstance(hidden, torch.Tensor):
                    self.collector.on_block_input(i, whole(hidden))

        return hook

    def _leave(self, i: int):
        def hook(_module, _args, output):
            if self._muted:
                return
            self._flush(i)
            for kind, (layer, out) in list(self._written.items()):  # no post-norm took it: written as it is
                if layer == i:
                    del self._written[kind]
                    self.collector.on_sublayer_output(i, kind, out)
            self._block = None
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            self.collector.on_block_output(i, whole(hidden))  # a replicated DTensor's own copy under tensor parallelism

        return hook

    def _sublayer_out(self, i: int, kind: str):
        def hook(_module, _args, output):
            if self._muted:
                return
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor):
                self._written[kind] = (i, whole(out))

        return hook

    def _norm_in(self, module, args):
        """A norm whose input is a sublayer's very output tensor is that sublayer's post-norm."""
        if self._muted or not args:
            return
        for kind, (layer, out) in list(self._written.items()):
            if args[0] is out:
                del self._written[kind]
                self._post_norm[id(module)] = (layer, kind)

    def _norm_out(self, module, _args, output):
        taken = self._post_norm.pop(id(module), None)
        if taken is not None and isinstance(output, torch.Tensor):
            self.collector.on_sublayer_output(taken[0], taken[1], whole(output))

    def remove_projection_hooks(self) -> None:
        for h in self._projections.values():
            h.remove()
        self._projections = {}


def _dtensor_heads(x):
    """The local tensor of a DTensor sharded on its last axis (a tensor-parallel rank's heads side by side at
    the output projection's input), else None."""
    placements = getattr(x, "placements", None)
    if placements is None or not hasattr(x, "to_local"):
        return None
    if any(not p.is_replicate() and getattr(p, "dim", None) not in (x.dim() - 1, -1) for p in placements):
        return None
    return x.to_local()


def _agrees(kind: tuple, fused: torch.Tensor, own: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether sinkwatch's output (B, S, Hq, Dv) equals the model's own within ``output_tolerance``
    of max |v|; warns when it does not (that kind of attention then keeps the model's own)."""
    scale = float(value.abs().max()) if value.numel() else 1.0
    same = fused.shape == own.shape
    err = float((fused.double() - own.double()).abs().max()) if same and fused.numel() else 0.0 if same else float("inf")
    tol = output_tolerance(value.dtype) * (scale or 1.0)
    if err <= tol:
        return True
    name = getattr(kind[0], "__name__", "attention")
    warnings.warn(
        f"sinkwatch: its fused attention output differs from {name}'s own (max error {err:.3g}, shapes {tuple(fused.shape)} "
        f"vs {tuple(own.shape)}, tolerance {tol:.3g}); probes of this attention keep the model's own output (one more "
        "attention per block). Please report the model class.",
        RuntimeWarning,
        stacklevel=5,
    )
    return False


@contextlib.contextmanager
def capturing(session: CaptureSession) -> Iterator[None]:
    """Activate ``session`` with its block hooks for the duration; remove every hook afterwards."""
    handles = []
    try:
        with activate(session):
            handles = session.hooks()
            yield
    finally:
        for h in handles:
            h.remove()
        session.remove_projection_hooks()


@contextlib.contextmanager
def activate(session: CaptureSession) -> Iterator[None]:
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a sinkwatch capture is already active; probes cannot be nested")
    _ACTIVE = session
    try:
        yield
    finally:
        _ACTIVE = None
