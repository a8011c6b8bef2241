"""Attention statistics without the S x S matrix (SPEC §4).

``attention_stats`` dispatches to a Triton kernel on CUDA, a chunked PyTorch path elsewhere, or
the float64 materialising reference that the tests compare against.
"""

from .api import BACKENDS, AttentionStats, attention_stats, resolve_backend

__all__ = ["BACKENDS", "AttentionStats", "attention_stats", "resolve_backend"]
