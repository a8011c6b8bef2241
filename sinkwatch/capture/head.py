"""Per-token losses from the final hidden states, through the model's own output head, in row chunks.

The repeated-random probe's ICL score (docs/design.md §5) needs the next-token loss at every position. Taking
it from the model's all-position logits costs rows x T x V floats at once (8.5 GB for 64 x 128 at
V = 262,144, plus a transposed copy and the log-softmax), so it grows with the vocabulary. Instead
(docs/design.md §9) the probe forward asks the model for its last position's logits only, and ``HeadTap``,
hooked for that forward:

- keeps the final hidden states ``(B, S, d)`` (the output of the module that feeds the head);
- when the head runs, computes every position's logits from them in chunks of rows with the head's
  weights as they are at that moment — inside the forward, so under FSDP the weights are the
  gathered ones (no collective of its own) — applies what the model does after the head (Gemma's
  final soft-cap, Cohere's ``logit_scale``, Granite's ``logits_scaling``, ...), and keeps only the
  losses ``(B, S-1)``;
- checks the reproduction against the model's own output: the head's input must be the kept
  hidden states at the last position, and the post-processed last-position logits must equal the
  logits the model returned. A model whose head cannot be reproduced so (an unknown scaling, a head
  that is not one linear layer) gets its losses from extra forwards of a few rows each, with every
  position's logits, while the capture is muted (``CaptureSession.muted``): slower, still bounded
  in memory, never wrong. A NaN or infinite logit (a diverged or overflowed model) must come out
  as the same NaN or infinity; such logits are no reason to fall back, and get their own warning.

Peak memory of the losses: one chunk of ``LOSS_CHUNK_BYTES`` of float32 logits and its
log-softmax, whatever V is.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

LOSS_CHUNK_BYTES = 32 * 2**20  # float32 logits per loss chunk; cross-entropy's temporaries make it ~3x this
FALLBACK_BYTES = 256 * 2**20  # all-position logits per extra forward when the head cannot be reproduced


class ProbeForward(NamedTuple):
    """What a captured forward returns: the last position's logits (B, 1, V) — every position's
    (B, S, V) when ``all_logits`` was asked — and, when ``token_losses`` was asked, the next-token
    loss at every position (B, S-1) float32: ``token_losses[:, t]`` is the loss of predicting
    ``ids[:, t+1]``."""

    logits: torch.Tensor
    token_losses: torch.Tensor | None = None


@dataclass(frozen=True)
class GroupForward:
    """How a captured forward runs among ranks that probe together, whose forwards are collectives
    (FSDP's all-gathers): set by ``sinkwatch.distributed`` around each of their forwards. ``hold`` keeps
    a fault of the head-loss tap until the forward has ended (the forward, and every collective in it,
    then runs to the end, as for a fault in the statistics); ``extra_forwards(n)`` turns this rank's
    count of extra all-logits forwards into the count every rank runs (the largest), so the extra
    forwards' collectives pair whatever each rank's row count."""

    hold: Callable[[BaseException], None]
    extra_forwards: Callable[[int], int]


GROUP_FORWARD: ContextVar[GroupForward | None] = ContextVar("sinkwatch_group_forward", default=None)


def loss_chunk_rows(vocab_size: int) -> int:
    """Rows of hidden states per loss chunk: ``LOSS_CHUNK_BYTES`` of float32 logits."""
    return max(1, LOSS_CHUNK_BYTES // (4 * int(vocab_size)))


def fallback_rows(seq_len: int, vocab_size: int) -> int:
    """Sequences per extra all-logits forward: ``FALLBACK_BYTES`` of float32 logits (at least one)."""
    return max(1, FALLBACK_BYTES // (4 * int(seq_len) * int(vocab_size)))


def chunked_token_losses(
    hidden: torch.Tensor, ids: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], vocab_size: int
) -> torch.Tensor:
    """Next-token losses (B, S-1) float32 from final hidden states ``hidden`` (B, S, d) and
    ``head``: (rows, d) -> logits (rows, V), applied ``loss_chunk_rows(V)`` rows at a time."""
    B, S, d = hidden.shape
    h = hidden[:, :-1].reshape(-1, d)  # (B*(S-1), d): a view where hidden is contiguous
    targets = ids[:, 1:].reshape(-1).to(hidden.device)
    out = torch.empty(h.shape[0], dtype=torch.float32, device=hidden.device)
    step = loss_chunk_rows(vocab_size)
    for r0 in range(0, h.shape[0], step):
        logits = head(h[r0 : r0 + step]).float()  # (rows, V)
        out[r0 : r0 + step] = F.cross_entropy(logits, targets[r0 : r0 + step], reduction="none")
    return out.view(B, S - 1)


def losses_from_logits(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token losses (B, S-1) float32 from all-position logits (B, S, V), a few rows at a time."""
    B, S, V = logits.shape
    out = torch.empty(B, S - 1, dtype=torch.float32, device=logits.device)
    step = max(1, loss_chunk_rows(V) // max(1, S - 1))
    for b0 in range(0, B, step):
        chunk = logits[b0 : b0 + step, :-1].float()  # (rows, S-1, V)
        targets = ids[b0 : b0 + step, 1:].reshape(-1).to(logits.device)
        out[b0 : b0 + step] = F.cross_entropy(chunk.reshape(-1, V), targets, reduction="none").view(-1, S - 1)
    return out


# ---- what a model does after its head -------------------------------------------------------------
def hf_logit_post(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What transformers' causal LMs do to ``lm_head``'s output before returning it, read off the
    model's config: a multiplier (Cohere ``logit_scale``, ``output_multiplier``, Falcon-H1
    ``lm_head_multiplier``), a divisor (Granite ``logits_scaling``), then the final soft-cap
    ``cap * tanh(x / cap)`` (Gemma 2/3, ``final_logit_softcapping``), in the head's dtype as the models
    compute it. What it misses, the check against the model's own logits catches (``HeadTap``)."""
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "text_config", None) or cfg
    multiply = 1.0
    for owner, name in ((model, "logit_scale"), (text, "output_multiplier"), (getattr(model, "model", None), "lm_head_multiplier")):
        value = getattr(owner, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            multiply *= float(value)
    divide = getattr(text, "logits_scaling", None)
    divide = float(divide) if isinstance(divide, (int, float)) and not isinstance(divide, bool) else 1.0
    cap = getattr(text, "final_logit_softcapping", None)
    cap = float(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0 else None

    def post(logits: torch.Tensor) -> torch.Tensor:
        if multiply != 1.0:
            logits = logits * multiply
        if divide != 1.0:
            logits = logits / divide
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return post


def _same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Whether reproduced last-position logits are the model's own, to the rounding of its dtype. A
    non-finite logit (a diverged or overflowed model) must be reproduced as the same NaN or infinity:
    NaN == NaN is false, and a model's NaN is no sign that its head was not reproduced."""
    if ours.shape != theirs.shape:
        return False
    a, b = ours.float(), theirs.float()
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return False
    if not finite.all():  # NaN where NaN, +inf where +inf, -inf where -inf (nan_to_num maps each to its own value)
        if not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()):
            return False
        a, b = a[finite], b[finite]
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    tol = 1e-4 if theirs.dtype == torch.float32 else 2e-2
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return math.isfinite(diff) and diff <= tol * scale


class HeadTap:
    """Hooks for one captured forward: the final hidden states from ``hidden_module`` (its output, or
    its input with ``from_input``), and the losses computed when ``head`` — one linear layer — runs.

    Usage: ``with tap.armed(ids):`` around the model call; then ``tap.losses(model_logits)`` returns
    the losses (B, S-1), or None when the reproduction failed its check (the caller then takes the
    losses from extra forwards)."""

    def __init__(self, hidden_module: nn.Module, head: nn.Module, post: Callable[[torch.Tensor], torch.Tensor], *, from_input=False):
        self.hidden_module, self.head, self.post, self.from_input = hidden_module, head, post, from_input
        self.reproducible = isinstance(head, nn.Linear)
        self._reset(None)

    def _reset(self, ids) -> None:
        self.faulted = False  # the losses raised inside the head's forward and the fault is held (``GroupForward``)
        self._ids = ids
        self._hidden = None
        self._losses = None
        self._head_out = None
        self._input_ok = False

    def _keep_hidden(self, _module, args, output=None):
        hidden = (args[0] if args else None) if self.from_input else (output[0] if isinstance(output, (tuple, list)) else output)
        if hasattr(hidden, "last_hidden_state"):
            hidden = hidden.last_hidden_state
        self._hidden = hidden if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None

    def _before_head(self, module, args):
        x = args[0] if args else None
        h = self._hidden
        if self._ids is None or h is None or not isinstance(x, torch.Tensor) or x.dim() != 3 or h.shape[:2] != self._ids.shape:
            return None
        self._input_ok = x.shape[-1] == h.shape[-1] and torch.equal(x[:, -1], h[:, -1])
        if not self._input_ok:
            return None
        weight, bias = module.weight, module.bias  # gathered here under FSDP (this runs inside the head's forward)
        vocab = weight.shape[0]
        try:
            self._losses = chunked_token_losses(h, self._ids, lambda rows: self.post(F.linear(rows, weight, bias)), vocab)
        except Exception as exc:
            group = GROUP_FORWARD.get()
            if group is None:
                raise
            group.hold(exc)  # an out-of-memory in a loss chunk: raised once the forward has ended
            self.faulted = True
        return None

    def _after_head(self, _module, _args, output):
        self._head_out = output if isinstance(output, torch.Tensor) else None

    @contextlib.contextmanager
    def armed(self, ids: torch.Tensor) -> Iterator[HeadTap]:
        """A context: the hooks live for one forward of ``ids`` (B, S)."""
        self._reset(ids)
        if self.from_input:
            keep = self.hidden_module.register_forward_pre_hook(lambda m, a: self._keep_hidden(m, a))
        else:
            keep = self.hidden_module.register_forward_hook(self._keep_hidden)
        handles = [keep, self.head.register_forward_pre_hook(self._before_head), self.head.register_forward_hook(self._after_head)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._hidden = None

    def losses(self, model_logits: torch.Tensor) -> torch.Tensor | None:
        """The losses of the forward just run, if the head was reproduced: its input was the kept
        hidden states, and ``post`` of its last-position output equals ``model_logits[:, -1]``."""
        if not self.reproducible or self._losses is None or not self._input_ok or self._head_out is None:
            return None
        if not _same_logits(self.post(self._head_out[:, -1]), model_logits[:, -1]):
            return None
        return self._losses


_WARNED: set[str] = set()


def warn_unreproducible(model_name: str, rows: int) -> None:
    if model_name in _WARNED:
        return
    _WARNED.add(model_name)
    warnings.warn(
        f"sinkwatch: {model_name}'s output head could not be reproduced from its final hidden states (a head that is not one "
        "linear layer, or a scaling after it that sinkwatch does not know); the repeated probe's losses come from extra forwards "
        f"of {rows} sequence(s) each with every position's logits: slower, same numbers",
        RuntimeWarning,
        stacklevel=3,
    )


_WARNED_NONFINITE: set[str] = set()


def warn_nonfinite(model_name: str) -> None:
    """Once per model: its logits hold NaN or infinity, so its losses (the ICL score) do too."""
    if model_name in _WARNED_NONFINITE:
        return
    _WARNED_NONFINITE.add(model_name)
    warnings.warn(
        f"sinkwatch: {model_name}'s logits are not finite (NaN or inf): the repeated probe's per-token losses and ICL score "
        "are NaN or inf as the model's own logits make them, not a fault of the probe. The weights or activations have "
        "diverged or overflowed: check the training loss for a spike or NaN, load or probe in bfloat16 or float32 rather than "
        "float16 (which overflows past 65504), and check the checkpoint's weights with torch.isfinite",
        RuntimeWarning,
        stacklevel=3,
    )


def extra_forward_losses(
    session,
    run_all_logits: Callable[[torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    vocab_size: int,
    name: str,
    *,
    own: bool = True,
    forwards: int | None = None,
) -> torch.Tensor | None:
    """Losses (B, S-1) from the model's own all-position logits, ``fallback_rows`` sequences per
    forward, with the capture muted (these forwards are not measured again). ``forwards``: how many
    extra forwards to run in all (every rank of a group the same): after this rank's own (none when
    not ``own``: None is returned), one-sequence forwards whose results count for nothing."""
    rows = fallback_rows(ids.shape[1], vocab_size)
    starts = range(0, ids.shape[0], rows) if own else range(0)
    if own:
        warn_unreproducible(name, rows)
    parts = []
    with session.muted():
        for b0 in starts:
            sub = ids[b0 : b0 + rows]
            parts.append(losses_from_logits(run_all_logits(sub), sub))
        for _ in range(len(starts), forwards if forwards is not None else len(starts)):
            run_all_logits(ids[:1])
    return torch.cat(parts) if parts else None


def captured_forward(
    session,
    tap: HeadTap | None,
    run: Callable[[torch.Tensor, bool], torch.Tensor],
    input_ids: torch.Tensor,
    *,
    all_logits: bool,
    token_losses: bool,
    vocab_size: int,
    name: str,
) -> ProbeForward:
    """One measured forward of a target whose ``run(ids, all_logits)`` returns the model's logits
    (B, S or 1, V), with the per-token losses taken through ``tap`` where it reproduces the head."""
    session.begin()
    losses = None
    if token_losses and not all_logits and tap is not None and tap.reproducible:
        with tap.armed(input_ids):
            logits = run(input_ids, False)
        losses = tap.losses(logits)
    else:
        logits = run(input_ids, all_logits)
        if token_losses and logits.shape[1] == input_ids.shape[1]:  # every position's logits came back anyway
            losses = losses_from_logits(logits, input_ids)
    session.end()
    if token_losses:
        # the head could not be reproduced: a few rows per extra forward (not for a held fault of the tap's)
        own = losses is None and not (tap is not None and tap.faulted)
        if own and tap is not None:
            tap.reproducible = False
        need = -(-input_ids.shape[0] // fallback_rows(input_ids.shape[1], vocab_size)) if own else 0
        group = GROUP_FORWARD.get()
        forwards = group.extra_forwards(need) if group is not None else need
        if forwards:
            extra = extra_forward_losses(session, lambda ids: run(ids, True), input_ids, vocab_size, name, own=own, forwards=forwards)
            losses = extra if own else losses
    if token_losses and losses is not None and not (torch.isfinite(logits[:, -1]).all() and torch.isfinite(losses).all()):
        warn_nonfinite(name)
    return ProbeForward(logits, losses)
