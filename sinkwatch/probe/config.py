"""How a probe runs: ``MonitorConfig``. Metric thresholds are the published ones (``sinkwatch.metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import metrics
from ..kernels import BACKENDS
from ..stages import StageConfig

PROTOCOLS = ("sinkwatch", "paper")
PAPER_PR_SEQUENCES = 500  # the paper's PR: the first 500 induction-probe sequences (its --n-examples 500)


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """How a probe runs. Metric thresholds are the published ones (``sinkwatch.metrics``)."""

    batch_tokens: int = 16384  # tokens per probe forward (micro-batch = batch_tokens // T sequences)
    n_first: int = metrics.SINK_PROFILE_K  # K: Sink_0 .. Sink_{K-1}
    sink_epsilon: float = metrics.SINK_EPSILON
    participation_ratio: bool = True
    classical_pr: bool = False  # also report the centered (sum l)^2 / sum l^2 PR as ``pr_classical``
    backend: str = "auto"  # attention_stats backend
    stages: StageConfig = field(default_factory=StageConfig)
    # "sinkwatch": float32 attention statistics, PR over every probe sequence. "paper": Xu 2026's
    # released protocol (docs/design.md §5, §8): PR on the first 500 sequences, float16 models' attention
    # rounded as eager float16 attention rounds it, ablation controls min(picks, eligible).
    protocol: str = "sinkwatch"

    def __post_init__(self) -> None:
        if not isinstance(self.batch_tokens, int) or self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be a positive int, got {self.batch_tokens!r}")
        if not isinstance(self.n_first, int) or self.n_first < 1:
            raise ValueError(f"n_first (K) must be a positive int, got {self.n_first!r}")
        if not 0 < self.sink_epsilon < 1:
            raise ValueError(f"sink_epsilon must be in (0, 1), got {self.sink_epsilon!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if not isinstance(self.stages, StageConfig):
            raise TypeError("stages must be a sinkwatch.StageConfig")
