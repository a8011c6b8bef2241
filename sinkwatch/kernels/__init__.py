"""Attention statistics without the S x S matrix (docs/kernels.md).

``attention_stats`` dispatches to a Triton kernel on CUDA, a chunked PyTorch path elsewhere, or
the float64 materialising reference that the tests compare against. ``attention_output`` is the
fused pass: the attention output and every row's lse from one pass over the keys, from which
``attention_stats(..., fused=...)`` reads the statistics without a second one.
"""

from .api import BACKENDS, attention_output, attention_stats, output_backend, resolve_backend
from .contract import AttentionOutput, AttentionStats

__all__ = ["BACKENDS", "AttentionOutput", "AttentionStats", "attention_output", "attention_stats", "output_backend", "resolve_backend"]
