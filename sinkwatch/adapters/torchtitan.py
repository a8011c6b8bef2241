"""torchtitan 0.3.0 adapter: ``SinkWatchTrainer``, a ``torchtitan.trainer.Trainer`` subclass (docs/design.md §7).

torchtitan has no callback API; its own extensions (flux, torchft, the graph trainer) subclass
``Trainer``. This one overrides three methods and leaves training as it is:

- ``post_dataloading_process``: every micro-batch's (B, L) inputs go to the live core (the first
  freezes the natural windows, each is counted, times the data-parallel degree); on a fresh run's
  first batch, before any forward, the initial model is probed (step 0);
- ``train_step``: after the step (``self.step``, torchtitan's own counter), a probe when due, and the
  last step (``training.steps``) at the end;
- ``load_state_dict`` (the checkpointer restores the trainer's ``step``): the callback state is
  rebuilt from sinkwatch's own store in ``out_dir`` at that step, as the Fabric adapter does.

Probes run eagerly (``torch.compiler.set_stance("force_eager")``: per-block ``compile`` is torchtitan's
default) with hooks registered for the probe only (``sinkwatch.capture.torchtitan``); the probe forward
builds its masks with ``model.get_attention_masks`` as ``post_dataloading_process`` does. Scalars go to
``metrics_processor.logger`` (``sinkwatch/...`` at the probed step), records to ``out_dir``; under FSDP
parameter mixed precision (``training.mixed_precision_param``, bfloat16 by default) the probe computes in
that dtype, as training does, and records say ``probe_dtype``. llama3 and qwen3 only (others refused by
name). Tensor parallelism, with or without sequence parallelism: each rank computes its own heads' statistics,
gathered in global order (``sinkwatch.distributed.tensor_parallel``); pipeline and context parallelism refused
at construction. The options are the ``sinkwatch``
field of the config (``SinkWatchTrainer.Config``; ``sinkwatch_config(stock)`` wraps a stock
``Trainer.Config``).

This module imports torchtitan at import: import it only where torchtitan is installed (Python >= 3.11).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from torchtitan.trainer import Trainer

from ..live import LiveConfig, LiveMonitor
from ..reporters.base import Reporter

TESTED_TORCHTITAN = "0.3.0"
__all__ = ["TESTED_TORCHTITAN", "MetricsLoggerReporter", "SinkWatchOptions", "SinkWatchTrainer", "sinkwatch_config"]


_LIVE = {f.name: f.default for f in dataclasses.fields(LiveConfig)}  # the defaults, written once (LiveConfig)


@dataclass(kw_only=True, slots=True)
class SinkWatchOptions:
    """The live options a torchtitan config carries (scalars: they come from the command line too, as
    ``--sinkwatch.every_n_steps 100``; checked when the config is parsed, not after the Trainer is built).
    Their meanings and defaults are ``LiveConfig``'s (docs/live.md); torchtitan's parser needs each field
    declared here, so only the types are written twice."""

    every_n_steps: int | None = _LIVE["every_n_steps"]
    log_spaced: int | None = _LIVE["log_spaced"]
    probe_at_start: bool = _LIVE["probe_at_start"]
    probe_at_end: bool = _LIVE["probe_at_end"]
    out_dir: str = _LIVE["out_dir"]
    natural: bool = _LIVE["natural"]
    wandb: Literal["auto", "online", "offline", "disabled"] = _LIVE["wandb"]
    console: bool = _LIVE["console"]
    raise_on_error: bool = _LIVE["raise_on_error"]

    def __post_init__(self) -> None:
        self.live_config()  # a ValueError/TypeError naming the option, at parse time

    def live_config(self) -> LiveConfig:
        return LiveConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


class MetricsLoggerReporter(Reporter):
    """The ``sinkwatch/*`` scalars through torchtitan's ``metrics_processor.logger.log(metrics, step)``."""

    name = "torchtitan metrics logger"

    def __init__(self, metrics_processor):
        self.metrics_processor = metrics_processor

    def log_record(self, record: dict[str, Any]) -> None:
        from ..reporters.trackers import tracker_scalars

        metrics = tracker_scalars(record)
        if metrics:
            self.metrics_processor.logger.log(metrics, record.get("step") or 0)


class SinkWatchTrainer(Trainer):
    """``torchtitan.trainer.Trainer`` with sinkwatch's live monitor (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        sinkwatch: SinkWatchOptions = field(default_factory=SinkWatchOptions)

    def __init__(self, config: Config):
        super().__init__(config)
        self.sinkwatch_setup()

    def sinkwatch_setup(self, live_config: LiveConfig | None = None) -> None:
        """Refusals, then the live monitor on ``model_parts[0]``; ``live_config`` (programmatic use: probe
        sets, hooks, reporters) replaces the config's ``sinkwatch`` options."""
        pd = self.parallel_dims
        for kind, what, why in (
            ("pp", "pipeline", "a rank does not hold every layer (design: docs/design.md §9)"),
            ("cp", "context", "a rank holds a slice of the positions, and a head's attention row spans them all"),
        ):
            if getattr(pd, f"{kind}_enabled", False):
                raise ValueError(
                    f"sinkwatch cannot probe torchtitan under {what} parallelism ({why}); train with FSDP2/HSDP and tensor "
                    "(and sequence) parallelism only, or probe the checkpoints afterwards"
                )
        import torch.distributed as dist

        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        options = getattr(self.config, "sinkwatch", None) or SinkWatchOptions()
        self.sinkwatch = LiveMonitor(live_config or options.live_config())
        dp = max(1, int(getattr(pd, "dp_replicate", 1) or 1)) * max(1, int(getattr(pd, "dp_shard", 1) or 1))
        # under fully_shard's MixedPrecisionPolicy (training.mixed_precision_param, bf16 by default) the probe computes as
        # training does, in the dtype the all-gathers cast to, and its records say so (ProbeLayout)
        self.sinkwatch.setup(
            self.model_parts[0], is_global_zero=rank0, max_steps=self.config.training.steps, world_size=dp,
            tensor_parallel=_tensor_parallel(pd, self.config, dp),
        )  # fmt: skip
        if rank0:
            self.sinkwatch.add_reporter(MetricsLoggerReporter(self.metrics_processor))
        self._sinkwatch_start = True  # the first batch of a fresh run probes the initial model

    def post_dataloading_process(self, input_dict, labels):
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        batch = {"input_ids": inputs}
        self.sinkwatch.batch_start(batch)
        self.sinkwatch.batch_end(batch)
        if self._sinkwatch_start:
            self._sinkwatch_start = False
            if self.step <= 1:  # before the first forward: the weights are the initial ones
                self.sinkwatch.step_end(0)
        return inputs, labels, extra_kwargs

    def train_step(self, data_iterator):
        super().train_step(data_iterator)
        self.sinkwatch.step_end(self.step)
        if self.step >= self.config.training.steps:
            self.sinkwatch.train_end(self.step)
        if self.step >= self.config.training.steps:
            self.sinkwatch.finish()

    def load_state_dict(self, state_dict: dict[str, Any]):
        super().load_state_dict(state_dict)
        if getattr(self, "sinkwatch", None) is None or not self.step:
            return
        self._sinkwatch_start = False
        self.sinkwatch.resume_from_store(self.step)


def _tensor_parallel(pd, config, dp: int):
    """This rank's ``TensorParallel`` from torchtitan's meshes (None without tensor parallelism): its rank in the
    "tp" mesh, its replica's in the "batch" mesh (the data-parallel ranks that read different rows). Under
    sequence parallelism (``parallelism.enable_sequence_parallel``, torchtitan's default) the residual stream is a
    DTensor sharded over the positions: the capture gathers it whole for the P0 statistics (one all-gather of
    the tensor-parallel group per block output, ``capture.tensor_parallel.whole``)."""
    if not getattr(pd, "tp_enabled", False):
        return None
    backend = getattr(getattr(config, "parallelism", None), "spmd_backend", "partial_dtensor")
    if backend != "partial_dtensor":
        raise ValueError(
            f"sinkwatch probes torchtitan under tensor parallelism with parallelism.spmd_backend='partial_dtensor' only (got "
            f"{backend!r}): there the model's activations are DTensors whose placements say which heads, positions and "
            "vocabulary shard a rank holds; under 'spmd_types' they are plain tensors with SPMD annotations, 'full_dtensor' shards them "
            "over the data-parallel axes too, layouts sinkwatch has not been tested on. Set --parallelism.spmd_backend "
            "partial_dtensor, or probe the checkpoints afterwards"
        )
    from ..distributed import TensorParallel

    tp_mesh = pd.get_mesh("tp")
    batch = pd.get_optional_mesh("batch")
    return TensorParallel(tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size(), batch.get_local_rank() if batch else 0, dp)


def sinkwatch_config(stock: Trainer.Config, **options: Any) -> SinkWatchTrainer.Config:
    """A stock ``Trainer.Config`` (e.g. ``llama3_debugmodel()``) as a ``SinkWatchTrainer.Config``."""
    if type(stock) not in (Trainer.Config, SinkWatchTrainer.Config):
        raise TypeError(
            f"sinkwatch_config wraps torchtitan's stock Trainer.Config; got {type(stock).__qualname__}, another trainer's config "
            "(its own trainer class would be replaced by SinkWatchTrainer): subclass that trainer with SinkWatchTrainer's "
            "three overrides instead, or start from a stock config"
        )
    fields = {f.name: getattr(stock, f.name) for f in dataclasses.fields(stock) if f.name != "sinkwatch"}
    return SinkWatchTrainer.Config(**fields, sinkwatch=SinkWatchOptions(**options))


# ---- ``--module sinkwatch.torchtitan``: torchtitan's ConfigManager imports this module (there is no
# ``sinkwatch.torchtitan.config_registry``) and calls ``getattr(module, <--config>)()``. Every llama3 and
# qwen3 config function of torchtitan's own registries is offered here under its own name, wrapped.
CONFIG_FAMILIES = ("llama3", "qwen3")


def _stock_registry(family: str):
    import importlib

    return importlib.import_module(f"torchtitan.models.{family}.config_registry")


def _stock_config_names(family: str) -> list[str]:
    registry = _stock_registry(family)
    return sorted(
        n for n, f in vars(registry).items()
        if n.startswith(f"{family}_") and callable(f) and getattr(f, "__module__", None) == registry.__name__
    )  # fmt: skip


def __getattr__(name: str):
    family = name.split("_", 1)[0]
    if name.startswith("_") or family not in CONFIG_FAMILIES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    stock = getattr(_stock_registry(family), name, None)
    if stock is None or not callable(stock):
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r}: torchtitan.models.{family}.config_registry has no config function "
            f"{name!r} (it has {_stock_config_names(family)})"
        )

    def config() -> SinkWatchTrainer.Config:
        return sinkwatch_config(stock())

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan's ``{family}.config_registry.{name}()`` with SinkWatchTrainer (``--sinkwatch.*`` options)."
    return config


def __dir__() -> list[str]:  # what ConfigManager lists when --config names no function here
    names = set(__all__)
    for family in CONFIG_FAMILIES:
        with contextlib.suppress(ImportError):
            names.update(_stock_config_names(family))
    return sorted(names)
