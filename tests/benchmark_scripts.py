"""Load a script of benchmarks/ as a module, for the tests that check what it writes into the docs."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    """benchmarks/NAME.py as the module ``benchmarks_NAME`` (registered first: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
