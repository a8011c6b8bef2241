"""Shared by the Fabric/LitGPT tests: the entry point as pyproject.toml declares it, installed into a
throw-away site folder (the venv's editable install may predate it), and LitGPT's own test pattern for
``litgpt.pretrain.setup`` (its dataloaders and ``save_hyperparameters`` stood in for, nothing else)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
GROUP = "lightning.fabric.callbacks_factory"  # lightning.fabric.Fabric._configure_callbacks loads this group

EVERY, MICRO, T = 4, 2, 64  # probe every 4 optimizer steps; 2 rows of 64 tokens per step (no accumulation)
TOKENS_PER_STEP = MICRO * T


def declared_entry_point() -> tuple[str, str]:
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python >= 3.11)
    section = text.split(f'[project.entry-points."{GROUP}"]', 1)[1].split("\n[", 1)[0]
    ((name, value),) = re.findall(r'^(\w+) = "([^"]+)"$', section, re.MULTILINE)
    return name, value


def entry_point_site(root: Path) -> Path:
    """A folder that, on sys.path / PYTHONPATH, makes importlib.metadata see sinkwatch's entry point (empty
    when the installed sinkwatch already declares it: two would give every Fabric two callbacks)."""
    from importlib import metadata

    name, value = declared_entry_point()
    Path(root).mkdir(parents=True, exist_ok=True)
    if any(ep.value == value for ep in metadata.entry_points(group=GROUP)):
        return Path(root)
    info = Path(root) / "sinkwatch_fabric_entry-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sinkwatch-fabric-entry\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{name} = {value}\n")
    return Path(root)


def env_options(store: Path, **extra) -> str:
    return json.dumps({"every_n_steps": EVERY, "out_dir": str(store), "wandb": "disabled", "console": False, **extra})


def tiny_config():
    from litgpt.config import Config

    return Config(
        name="tiny-llama",
        block_size=T,
        vocab_size=96,
        padded_vocab_size=128,
        n_layer=2,
        n_embd=32,
        n_head=4,
        n_query_groups=2,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=64,
    )


def dataset(n_rows: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (n_rows, T + 1), generator=g)


def eager_backend_compile():
    """``torch.compile`` with Dynamo's "eager" backend (Dynamo captures graphs as usual; inductor's C++
    build, about 80 s for this model on 2 CPU cores, is skipped). ``litgpt.pretrain`` compiles its model."""
    import functools
    from unittest import mock

    return mock.patch("torch.compile", functools.partial(torch.compile, backend="eager"))


def pretrain(out_dir: Path, steps: int, *, resume=False, devices: int = 1):
    """``litgpt.pretrain.setup`` for ``steps`` optimizer steps, a checkpoint every EVERY steps."""
    from unittest import mock

    from litgpt import pretrain as lp
    from litgpt.args import EvalArgs, TrainArgs
    from torch.utils.data import DataLoader

    class Loader(DataLoader):  # stateful, as LitGPT's litdata StreamingDataLoader is: fabric.save/load keep its state
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    loader = Loader(dataset(), batch_size=MICRO)
    train = TrainArgs(
        global_batch_size=MICRO * devices,
        micro_batch_size=MICRO,
        max_tokens=steps * TOKENS_PER_STEP * devices,
        save_interval=EVERY,
        log_interval=1,
        lr_warmup_steps=1,
        max_norm=1.0,
        min_lr=1e-4,
    )
    with (
        mock.patch.object(lp, "get_dataloaders", return_value=(loader, loader)),
        mock.patch.object(lp, "save_hyperparameters"),
        eager_backend_compile(),
    ):
        lp.setup(
            "pythia-14m",
            model_config=tiny_config(),
            out_dir=out_dir,
            precision="32-true",
            resume=resume,
            devices=devices,
            train=train,
            eval=EvalArgs(interval=1000, max_iters=1, final_validation=False),
            optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3}},
            logger_name="csv",
        )
