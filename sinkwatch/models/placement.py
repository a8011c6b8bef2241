"""Where a model fits, decided before anything is downloaded (docs/design.md §8).

``ModelShape`` sizes a model from its config alone: built with accelerate's ``init_empty_weights``
(parameters on the meta device, nothing allocated) and sized with ``compute_module_sizes``. ``place``
decides where it goes: the worker's device when it holds the weights plus one probe micro-batch's
activations; else, with several visible GPUs, a ``device_map`` splitting the layers across them
(``infer_auto_device_map`` under each GPU's budget); else it is refused, saying what would fit.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .loading import DTYPES, default_device

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """``24GiB``, ``500MB``, ``1e9`` or a number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]?I?B?)\s*", str(value), flags=re.IGNORECASE)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"a memory size is a number of bytes or like 24GiB / 500MB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---- a model's size from its config ------------------------------------------------------------------------------
@dataclass
class ModelShape:
    """Sizes of one architecture, from its config with empty weights (nothing allocated)."""

    config: object
    params: int
    weights: dict[str, int]  # dtype -> bytes of parameters and buffers
    no_split: list[str]
    empty: object = field(repr=False)  # the model on the meta device, for infer_auto_device_map

    @classmethod
    def from_config(cls, config) -> ModelShape:
        from accelerate import init_empty_weights
        from accelerate.utils import compute_module_sizes
        from transformers import AutoModelForCausalLM

        with init_empty_weights():
            empty = AutoModelForCausalLM.from_config(config)
        weights = {name: int(compute_module_sizes(empty, dtype=dt)[""]) for name, dt in DTYPES.items()}
        params = sum(p.numel() for p in empty.parameters())
        no_split = list(getattr(empty, "_no_split_modules", None) or [])
        return cls(config, params, weights, no_split, empty)

    def activations(self, dtype: str, batch_tokens: int, seq_len: int) -> int:
        """An upper estimate of one probe micro-batch's activations (no gradients): the MLP and
        residual tensors of one block, the logits (model dtype and a float32 copy), and the attention
        scores where the attention materialises them (eager, sdpa's math path on CPU)."""
        c = self.config
        b = DTYPES[dtype].itemsize
        hidden = int(getattr(c, "hidden_size", 0) or getattr(c, "n_embd", 0))
        inter = int(getattr(c, "intermediate_size", 0) or getattr(c, "n_inner", 0) or 4 * hidden)
        vocab = int(getattr(c, "vocab_size", 0))
        heads = int(getattr(c, "num_attention_heads", 0) or getattr(c, "n_head", 0))
        return batch_tokens * ((4 * hidden + inter) * b + vocab * (b + 4)) + batch_tokens * seq_len * heads * 4

    def need(self, dtype: str, batch_tokens: int, seq_len: int) -> int:
        return self.weights[dtype] + self.activations(dtype, batch_tokens, seq_len)


# ---- where a model goes ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """``device_map`` for ``from_pretrained`` (None: refused, ``reason`` says why and what to do)."""

    device_map: dict | None
    need: int
    budgets: dict
    reason: str

    @property
    def fits(self) -> bool:
        return self.device_map is not None

    @property
    def split(self) -> bool:
        return self.fits and len(set(self.device_map.values())) > 1


def device_budgets(device: str | None = None, max_memory: int | str | None = None, local_rank: int | None = None) -> dict:
    """Memory each device this worker may use has free: {"cpu": bytes} or {gpu_index: bytes}.

    A worker with a local rank (one worker per GPU) uses its own GPU; a lone worker on a multi-GPU
    host may use every visible GPU. ``max_memory`` replaces the measured free memory of each device."""
    dev = device or default_device()
    cap = parse_bytes(max_memory) if max_memory is not None else None
    if not str(dev).startswith("cuda"):
        return {"cpu": cap if cap is not None else _host_available()}
    import torch

    if ":" in str(dev):
        gpus = [int(str(dev).split(":")[1])]
    elif local_rank is not None:
        gpus = [local_rank % torch.cuda.device_count()]
    else:
        gpus = list(range(torch.cuda.device_count()))
    return {i: cap if cap is not None else int(torch.cuda.mem_get_info(i)[0]) for i in gpus}


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def place(shape: ModelShape, dtype: str, budgets: dict, *, batch_tokens: int, seq_len: int) -> Placement:
    """Where a model of ``shape`` in ``dtype`` goes under ``budgets`` (see the module doc)."""
    act = shape.activations(dtype, batch_tokens, seq_len)
    need = shape.weights[dtype] + act
    for dev, budget in budgets.items():
        if budget >= need:
            return Placement({"": "cpu" if dev == "cpu" else f"cuda:{dev}"}, need, dict(budgets), f"fits on {device_label(dev)}")
    gpus = [d for d in budgets if d != "cpu"]
    if len(gpus) > 1 and sum(budgets[d] - act for d in gpus) >= shape.weights[dtype]:
        from accelerate.utils import infer_auto_device_map

        # each GPU keeps room for the activations: the micro-batch runs through every block in turn
        cap = {d: max(0, budgets[d] - act) for d in gpus}
        device_map = infer_auto_device_map(shape.empty, max_memory=cap, no_split_module_classes=shape.no_split, dtype=DTYPES[dtype])
        if set(device_map.values()) <= set(gpus):
            used = sorted(set(device_map.values()))
            return Placement(
                {k: f"cuda:{v}" for k, v in device_map.items()}, need, dict(budgets), f"split over GPUs {used} (one cannot hold it)"
            )
    return Placement(None, need, dict(budgets), _advice(shape, dtype, budgets, batch_tokens, seq_len))


def device_label(dev) -> str:
    return "the CPU" if dev == "cpu" else f"GPU {dev}"


def _advice(shape: ModelShape, dtype: str, budgets: dict, batch_tokens: int, seq_len: int) -> str:
    best = max(budgets.values())
    act = shape.activations(dtype, batch_tokens, seq_len)
    parts = [
        f"needs about {human(shape.weights[dtype] + act)} ({human(shape.weights[dtype])} of {dtype} weights + ~{human(act)} of "
        f"activations at batch_tokens={batch_tokens}) and the largest device has {human(best)} free "
        f"({', '.join(f'{device_label(d)} {human(b)}' for d, b in budgets.items())}). It was not downloaded. What would fit:"
    ]
    for other in ("bfloat16", "float16"):
        if other != dtype and shape.need(other, batch_tokens, seq_len) <= best:
            parts.append(f"--dtype {other} ({human(shape.need(other, batch_tokens, seq_len))})")
            break
    smaller = batch_tokens
    while smaller > seq_len and shape.need(dtype, smaller, seq_len) > best:
        smaller //= 2
    if smaller < batch_tokens and shape.need(dtype, smaller, seq_len) <= best:
        parts.append(f"--batch-tokens {smaller}")
    gpus_needed = math.ceil((shape.weights[dtype]) / max(1, best - act)) if best > act else None
    if gpus_needed and gpus_needed > 1:
        parts.append(f"one worker per host with {gpus_needed}+ such GPUs visible (CUDA_VISIBLE_DEVICES), so the layers are split")
    parts.append("or a device with more memory")
    return parts[0] + " " + "; ".join(parts[1:])
