"""Megatron-core adapter: ``SinkWatchMegatron``, the live monitor of a megatron-core model in the training
loop its users write (docs/live.md, "Megatron-core"; docs/design.md §7, §9).

megatron-core has no trainer and no callback API: the loop is the user's (or Megatron-LM's ``train()``,
or a Megatron-Bridge ``Callback``). Two lines go in it::

    sw = SinkWatchMegatron(model, max_steps=train_iters, every_n_steps=100)   # once the model is built
    for iteration in range(start, train_iters):
        sw.read(tokens)            # each training micro-batch's (B, S) token ids, before its forward
        ...forward, backward, optimizer step...
        sw.step(iteration + 1)     # after the optimizer step: optimizer steps done so far

``read`` hands the batch to the live core (the first one freezes the natural windows, each is counted,
times the data-parallel size); the first ``read`` of a fresh run, before any forward, probes the initial
model (step 0). ``step(n)`` probes the weights after ``n`` optimizer steps when due (every ``every_n_steps``,
log-spaced, ...), and at ``n == max_steps`` the last step (``probe_at_end``) and closes the reporters
(``finish()`` does that for a loop that ends otherwise). Never between a backward and its optimizer step.

Tensor parallelism: every rank constructs and calls the monitor alike. Each tensor-parallel rank computes
the statistics of its own heads (``sinkwatch.capture.megatron``: the q and k of ``core_attention``, after
RoPE), the probe's sequences are split over the data-parallel replicas, and one all-reduce assembles the
record with the heads in their global order (``sinkwatch.distributed.tensor_parallel``). Global rank 0
writes it. Refused at construction, with the reason: pipeline parallelism (no rank holds every layer) and
context parallelism with a ``ValueError`` (``megatron_parallel``); sequence parallelism and attention the
capture cannot read (``sinkwatch.capture.megatron``) with ``UnsupportedModelError`` (a ``TypeError``).

Resuming: ``SinkWatchMegatron(..., start_step=iteration)`` with the iteration the checkpoint restored
rebuilds the monitor's state (probe sets, natural windows, stage tracker) from its own store in
``out_dir``, as the Fabric adapter does. Options: those of every adapter (``LiveConfig``).

This module imports megatron-core only inside functions (the model passed in is already one).
"""

from __future__ import annotations

from typing import Any

from ..live import LiveConfig, LiveMonitor

TESTED_MEGATRON_CORE = "0.16.1"
__all__ = ["TESTED_MEGATRON_CORE", "SinkWatchMegatron", "megatron_parallel"]


def megatron_parallel(model):
    """This rank's ``TensorParallel`` from the model's process groups (``GPTModel.pg_collection``, Megatron's
    ``parallel_state`` for what it lacks); a ``ValueError`` under pipeline or context parallelism."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ..distributed import TensorParallel

    pg = getattr(model, "pg_collection", None)
    refusals = (  # (the group's name in pg_collection, parallel_state's fallback, what, why and what to do)
        ("pp", ps.get_pipeline_model_parallel_world_size, "pipeline", "no rank holds every layer, and Megatron's forward-only "
         'schedule needs CUDA (docs/design.md §9, "Pipeline parallelism"). Train with tensor and data parallelism only, or '
         "probe the checkpoints afterwards"),
        ("cp", ps.get_context_parallel_world_size, "context", "each rank holds a slice of the positions, and a head's attention "
         "row spans them all. Probe the checkpoints afterwards"),
    )  # fmt: skip
    for kind, fallback, what, why in refusals:
        group = getattr(pg, kind, None)
        size = dist.get_world_size(group) if group is not None else fallback()
        if size > 1:
            raise ValueError(f"sinkwatch cannot probe a Megatron model under {what} parallelism live ({what} size {size}): {why}")
    tp = getattr(pg, "tp", None) or ps.get_tensor_model_parallel_group()
    dp_size = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    return TensorParallel(tp, dist.get_rank(tp), dist.get_world_size(tp), dp_rank, dp_size)


class SinkWatchMegatron:
    """The live monitor of a megatron-core ``GPTModel`` (see the module docstring).

    ``model``: the ``GPTModel``, possibly inside Megatron's ``DistributedDataParallel`` / ``Float16Module``
    (or a one-item list of them, as Megatron-LM holds its model chunks). ``config`` / ``**overrides``: the
    options of every adapter (``LiveConfig``: ``every_n_steps``, ``out_dir``, ``probes``, ...).
    ``max_steps``: the run's optimizer steps (the last is probed; log-spaced steps need it).
    ``start_step``: the optimizer steps a restored checkpoint holds (0: a fresh run)."""

    def __init__(self, model, config: LiveConfig | None = None, *, max_steps: int | None = None, start_step: int = 0, **overrides: Any):
        import torch.distributed as dist

        if isinstance(model, (list, tuple)):
            if len(model) != 1:
                raise ValueError(
                    f"sinkwatch: {len(model)} model chunks (virtual pipeline parallelism): no rank holds every layer in one "
                    "module; pass the one GPTModel of a run without pipeline parallelism"
                )
            model = model[0]
        from ..capture.megatron import find_megatron_model

        inner = find_megatron_model(model)
        if inner is None:
            raise TypeError(
                f"SinkWatchMegatron needs a megatron.core GPTModel (or Megatron's DDP / Float16Module around one), got "
                f"{type(model).__name__}"
            )
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be a non-negative int (optimizer steps done), got {start_step!r}")
        self.config = LiveConfig.with_overrides(config, overrides)
        self.model = inner
        self.max_steps = max_steps
        self.live = LiveMonitor(self.config)
        distributed = dist.is_available() and dist.is_initialized()
        tp = megatron_parallel(inner) if distributed else None
        self.live.setup(
            inner, is_global_zero=not distributed or dist.get_rank() == 0, max_steps=max_steps,
            world_size=tp.dp_size if tp is not None else 1, tensor_parallel=tp,
        )  # fmt: skip
        self.iteration = start_step
        self._started = start_step > 0
        self._finished = False
        if start_step > 0:
            self.live.resume_from_store(start_step)

    def read(self, tokens) -> None:
        """A training micro-batch's (B, S) token ids (a tensor, or a dict with ``tokens`` / ``input_ids``),
        before its forward: the first freezes the natural windows and, in a fresh run, probes step 0."""
        batch = {"input_ids": tokens.get("tokens", tokens.get("input_ids"))} if isinstance(tokens, dict) else {"input_ids": tokens}
        self.live.batch_start(batch)
        if not self._started:
            self._started = True
            self.live.step_end(0)  # before the first forward: the initial weights
        self.live.batch_end(batch)

    def step(self, iteration: int) -> None:
        """After the optimizer step that makes ``iteration`` steps done: a probe when due; at ``max_steps``
        the last step and the end of the run."""
        self.iteration = int(iteration)
        if not self._started:  # no batch was read: the initial weights are gone, the schedule starts here
            self._started = True
        self.live.step_end(self.iteration)
        if self.max_steps is not None and self.iteration >= self.max_steps:
            self.finish()

    def finish(self) -> None:
        """The last step (``probe_at_end``) and the reporters closed; called at ``max_steps`` by ``step``."""
        if self._finished:
            return
        self._finished = True
        self.live.train_end(self.iteration)
        self.live.finish()

    def state_dict(self) -> dict:
        return self.live.state_dict()
