import os

import torch

# Triton decides interpreter-or-compiler when triton.language is first imported (transformers and
# accelerate may import it early), so on a machine without CUDA the switch must come first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def char_tokenizer():
    from bytelevel import byte_tokenizer

    return byte_tokenizer()


class _TrainedModels:
    """Each family trained once per session on the copy task (600 steps: induction forms, ICL < -5 nats)."""

    def __init__(self):
        self._cache = {}

    def get(self, family, steps=600):
        import copy

        from tiny_models import build, train

        if (family, steps) not in self._cache:
            model = build(family)
            train(model, steps)
            self._cache[(family, steps)] = model
        return copy.deepcopy(self._cache[(family, steps)])


@pytest.fixture(scope="session")
def trained_models():
    return _TrainedModels()


@pytest.fixture(scope="session")
def trajectory_run(tmp_path_factory):
    """One real training run to induction formation: per-step records and saved checkpoints."""
    from trajectory import SAVE_STEPS, train_with_probes

    ckpt = tmp_path_factory.mktemp("trajectory")
    records = train_with_probes(save_dir=ckpt, save_steps=SAVE_STEPS)
    return records, {f"step{s}": ckpt / f"step{s}" for s in SAVE_STEPS}
