"""The probe forwards of ranks that probe together: one agreement before each, faults held to its end.

``GroupForwards`` is the target a probe runs through in a group (``ProbeGroup.run`` hands it to the
probe): every forward starts on every rank's go (FORWARD), and runs to its end on every rank even when
it faults, so that every collective in it (FSDP's all-gathers) is paired:

- a fault in sinkwatch's statistics (the capture's collector) or in the head-loss tap is held;
- a fault inside a block's own forward is held too, where the forward is a collective: the block's
  output is its input, the blocks after it skip their compute, and FSDP's hooks around each block
  (its all-gather and reshard) still run, so the rank issues the same collectives as its peers (not under
  tensor parallelism, whose collectives are inside the blocks' compute: there it goes to the verdict);
- the extra all-logits forwards of a head sinkwatch cannot reproduce number the same on every rank
  (the largest count any rank needs; the others pad with throw-away forwards);

then the held fault is raised after the forward, and this rank's next agreement says FAIL: the probe
is skipped on every rank and training goes on. What the held fault makes fail later in the same
forward (the capture's check that every block ran its attention, on the stand-in outputs) is its
consequence, past the blocks' collectives: this rank's alone too. A fault outside all of these (FSDP's
own hooks, the embedding, the head, a block before its output kind is known) goes to the verdict on
the c10d store (``ProbeGroup.collective``).
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch

from ..capture import ProbeTarget
from ..capture.head import GROUP_FORWARD, GroupForward
from .protocol import FORWARD, PeerFailed
from .testing import FAULT_ENV, fault_point

_MISSING = object()


class _Held:
    """The first fault of one forward on this rank, and where the forward is (for the verdict's signature)."""

    def __init__(self):
        self.fault: BaseException | None = None
        self.forward = 0  # the ordinal of this forward in the probe (the same on every rank)
        self.block: int | None = None  # the block whose forward (or whose hooks) is running

    def begin(self, ordinal: int) -> None:
        self.fault, self.forward, self.block = None, ordinal, None

    def hold(self, exc: BaseException) -> None:
        if self.fault is None:
            self.fault = exc

    def place(self) -> str:
        return f"probe forward {self.forward}, " + (f"block {self.block}" if self.block is not None else "outside the blocks")


class _HeldFaults:
    """The probe's collector, with faults in sinkwatch's own statistics held until the forward ends."""

    def __init__(self, inner, held: _Held, step: int | None):
        self.inner, self.held, self.step = inner, held, step

    def _call(self, method: str, *args):
        if self.held.fault is None:
            try:
                if method == "on_attention":
                    fault_point("stats", self.step)
                return getattr(self.inner, method)(*args)
            except Exception as exc:  # noqa: BLE001 - raised once the forward is over
                self.held.hold(exc)
        return args[-1] if method == "on_attention_output" else None

    # one method per hook of capture's ``Collector`` protocol: a hook missing here would be lost to the probe
    def on_attention(self, layer, query, key, scaling, window, softcap, sinks=None):
        self._call("on_attention", layer, query, key, scaling, window, softcap, sinks)

    def on_fused_attention(self, layer, fused):
        if hasattr(self.inner, "on_fused_attention"):  # optional in the protocol: absent, statistics make their own pass
            self._call("on_fused_attention", layer, fused)

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


class GroupForwards(ProbeTarget):
    """``inner`` as the probe of ``step`` runs it in ``group``: each forward on the group's unanimous go,
    faults held to the end of the forward (see the module's docstring)."""

    def __init__(self, inner: ProbeTarget, group, step: int | None, token: int):
        self.inner, self.group, self.step, self.token = inner, group, step, token
        self.module, self.name = inner.module, inner.name
        self._forwards = 0

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
        group, held = self.group, _Held()
        collective = group.forwards_collective and group.size > 1
        with contextlib.ExitStack() as stack:
            if collective:
                # under tensor parallelism a block's own compute holds collectives (the row-parallel all-reduces):
                # skipping it would unpair them, so a fault there goes to the verdict instead of being held
                stack.enter_context(_held_blocks(self.inner, held, hold_compute=getattr(group, "tp", None) is None))
            if os.environ.get(FAULT_ENV):  # the "model" test point: a fault in the middle block's hooks (not held)
                blocks = self.inner.blocks()
                hook = blocks[len(blocks) // 2].register_forward_pre_hook(lambda *_: fault_point("model", self.step))
                stack.callback(hook.remove)
            forward = stack.enter_context(self.inner.capture(_HeldFaults(collector, held, self.step)))
            policy = GroupForward(hold=held.hold, extra_forwards=self._agreed_count) if collective else None

            def agreed_forward(input_ids: torch.Tensor, **kw):
                if not group.agree(FORWARD, self.token)[0]:
                    raise PeerFailed("another rank stopped this probe")
                self._forwards += 1
                held.begin(self._forwards)
                token = GROUP_FORWARD.set(policy)
                try:
                    with group.collective(self.step, "a probe forward", paired=group.forwards_collective, place=held.place):
                        try:
                            out = forward(input_ids, **kw)
                        except Exception:
                            if held.fault is None:
                                raise
                            # a consequence of the held fault (the capture's check that every block ran attention, a
                            # stand-in output): the blocks' collectives ran to the end, so it is this rank's alone
                            out = None
                finally:
                    GROUP_FORWARD.reset(token)
                if held.fault is not None:
                    raise held.fault
                fault_point("between", self.step)
                return out

            yield agreed_forward

    def _agreed_count(self, mine: int) -> int:
        """The extra forwards every rank runs (the most any rank needs), agreed before any of them."""
        ok, most = self.group.agree(FORWARD, self.token, flag=mine)
        if not ok:
            raise PeerFailed("another rank stopped this probe")
        return most


@contextlib.contextmanager
def _held_blocks(target: ProbeTarget, held: _Held, *, hold_compute: bool = True):
    """For one probe set: each block marks where the forward is (a pre-hook before FSDP's own), and each
    block's own forward holds its fault (``_held_forward``) where that can keep the collectives paired."""
    handles, patched = [], []
    try:
        for i, block in enumerate(target.blocks()):

            def enter(_module, _args, i=i):
                held.block = i

            def leave(_module, _args, _out):
                held.block = None

            handles.append(block.register_forward_pre_hook(enter, prepend=True))
            handles.append(block.register_forward_hook(leave))  # not on a fault: the verdict names the block
            inner = _compute_of(block) if hold_compute else None
            if inner is not None:
                patched.append((inner, inner.__dict__.get("forward", _MISSING)))
                inner.forward = _held_forward(inner, inner.forward, held)
        yield
    finally:
        for h in handles:
            h.remove()
        for inner, before in patched:
            if before is _MISSING:
                inner.__dict__.pop("forward", None)
            else:
                inner.forward = before


def _compute_of(block) -> torch.nn.Module | None:
    """The module whose ``forward`` is the block's own compute: through an FSDP (v1) unit, a checkpoint
    or compile wrapper, to the block inside; None when a sharded module sits inside it (skipping its
    forward would skip that module's all-gather and unpair the collectives)."""
    from .layout import _fsdp1_class

    FSDP = _fsdp1_class()
    inner = block
    while True:
        nxt = (
            getattr(inner, "_fsdp_wrapped_module", None)
            or getattr(inner, "_checkpoint_wrapped_module", None)
            or getattr(inner, "_orig_mod", None)
        )
        if not isinstance(nxt, torch.nn.Module):
            break
        inner = nxt
    from torch.distributed.fsdp import FSDPModule

    for m in inner.modules():
        if m is not inner and (isinstance(m, FSDPModule) or (FSDP is not None and isinstance(m, FSDP))):
            return None
    return inner


def _held_forward(owner: torch.nn.Module, original, held: _Held):
    """``owner``'s forward that, on a fault (or after an earlier one in this forward), returns its input
    hidden states in place of its output, so the forward goes on through every later block's hooks. The
    output's kind (a tensor, or a tuple led by the hidden states) is learnt from the block's last
    successful forward (the pre-flight probe's at the latest); before one, a fault goes to the verdict."""

    def forward(*args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
        kind = _OUTPUTS.get(owner)
        stands_in = isinstance(hidden, torch.Tensor) and kind is not None
        if held.fault is not None and stands_in:
            return _stand_in(hidden, kind)  # an earlier fault: skip the compute, keep the collectives
        try:
            out = original(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - raised once the forward is over
            if not stands_in:
                raise  # nothing known to stand in for its output: the verdict decides
            held.hold(exc)
            return _stand_in(hidden, kind)
        _OUTPUTS[owner] = (type(out), len(out)) if isinstance(out, (tuple, list)) else (torch.Tensor, 1)
        return out

    return forward


_OUTPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block -> (output type, length)


def _stand_in(hidden: torch.Tensor, kind: tuple[type, int]):
    out_type, n = kind
    return hidden if out_type is torch.Tensor else out_type((hidden, *([None] * (n - 1))))
