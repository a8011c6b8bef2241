"""Two CPU processes (gloo) in one tensor-parallel group: Lightning's ModelParallelStrategy with
``data_parallel_size=1, tensor_parallel_size=2``; run by tests/test_distributed.py.

    python tests/tp_lightning.py OUT_DIR

Both ranks read the same batch (the sampler splits over the data-parallel mesh only), so the tokens
seen are one rank's batches, not twice them. The model is left whole on each rank (no TP plan): the
token count is what is under test, and it depends only on the strategy's meshes.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import planted  # noqa: E402
from ddp_lightning import SlowLit, fit  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402


class WholeLit(SlowLit):
    def configure_model(self):
        pass  # ModelParallelStrategy requires the hook; the test needs no TP plan


if __name__ == "__main__":
    fit(sys.argv[1], lambda: WholeLit(planted.p0_final()), ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2))
