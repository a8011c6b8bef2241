"""Two-process FSDP2 (``fully_shard``, gloo, CPU) fit through Lightning's ModelParallelStrategy with
SinkWatchCallback; run by tests/test_distributed.py.

    python tests/fsdp2_lightning.py OUT_DIR

Every rank holds a shard of each block; the probe forward all-gathers them, so every rank probes
and rank 0 logs. At the end every rank joins in gathering the full state dict and rank 0 saves it
as OUT_DIR/final, so the test can probe the same weights in one process and compare.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import planted  # noqa: E402
from ddp_lightning import SlowLit, fit  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402


class ShardedLit(SlowLit):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def main(out: str) -> None:
    trainer, lit = fit(out, lambda: ShardedLit(planted.p0_final()), ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(lit.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # a collective
    if trainer.is_global_zero:
        model = planted.p0_final()
        model.load_state_dict(full)
        model.save_pretrained(os.path.join(out, "final"))


if __name__ == "__main__":
    main(sys.argv[1])
