"""The CPU demos (``sinkwatch demo``): induction heads forming in a byte-level Llama pretrained on the Python
standard library (``induction``), and a real model's P0-sink circuit regrown after its amplifier is knocked
out (``p0``). The pretraining data helpers are the recipes' too (recipes/)."""

from .induction import DEMO_CONTEXT, PRINTABLE, DemoWindows, add_pretrain_arguments, build_model, pretrain_corpus, run_demo, stdlib_bytes

__all__ = [
    "DEMO_CONTEXT",
    "PRINTABLE",
    "DemoWindows",
    "add_pretrain_arguments",
    "build_model",
    "pretrain_corpus",
    "run_demo",
    "stdlib_bytes",
]
