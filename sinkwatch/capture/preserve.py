"""Leaving the model as we found it: training flags and every global RNG."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore every global RNG afterwards: torch CPU and CUDA, Python's ``random``, numpy's."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py_rng = random.getstate()
    np_rng = np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """eval + no_grad for the probe, then restore every module's training flag and all RNG states."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad(), preserved_rng():
            yield
    finally:
        for m, mode in modes:
            m.training = mode
