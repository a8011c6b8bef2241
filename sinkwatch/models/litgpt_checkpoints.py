"""LitGPT checkpoint folders as replay revisions: ``step-NNNNNNNN/`` (and ``final/``) as
``litgpt pretrain`` writes them, each a ``lit_model.pth`` (``fabric.save`` of the training state,
the weights under ``"model"``; or a bare state dict, as ``litgpt download`` writes) beside the
``model_config.yaml`` of its model. Loaded into litgpt's own ``GPT`` and probed through the same
capture as the live callback (``sinkwatch.capture.litgpt``), so live = replay holds for LitGPT runs.

The step: the folder's name (``step-00000100``), else the state's ``step_count``. Tokens: a LitGPT
checkpoint does not carry sinkwatch's count; pass ``--tokens-per-step`` (LitGPT's own count is
``micro_batch_size x max_seq_length x devices`` per optimizer step without gradient accumulation).
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS = "lit_model.pth"
CONFIG = "model_config.yaml"


def is_litgpt_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / WEIGHTS).is_file() and (path / CONFIG).is_file()


def _load(path: Path) -> dict:
    import torch

    return torch.load(Path(path) / WEIGHTS, map_location="cpu", weights_only=False, mmap=True)


def saved_step(path: Path) -> int | None:
    """The optimizer steps of the training state in ``path`` (``step_count``), or None for bare weights."""
    data = _load(path)
    step = data.get("step_count") if isinstance(data, dict) and "model" in data else None
    return int(step) if step is not None else None


def load_litgpt(path: Path, *, dtype, device):
    """litgpt's ``GPT`` of ``model_config.yaml`` with the weights of ``lit_model.pth``, in eval mode."""
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
    except ImportError as exc:
        raise ImportError("replaying LitGPT checkpoints needs litgpt: pip install --no-deps litgpt 'jsonargparse[signatures]'") from exc
    config = Config.from_file(Path(path) / CONFIG)
    model = GPT(config)
    data = _load(path)
    state = data["model"] if isinstance(data, dict) and "model" in data else data
    model.load_state_dict(state)
    return model.to(dtype).to(device).eval()
