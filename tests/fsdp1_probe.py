"""Two CPU processes (gloo, torchrun) probe a model sharded by real FSDP v1 wrappers the way the
strategies shard it: each GPT-2 block its own unit, inside a root wrapper around a LightningModule
(Lightning's FSDPStrategy puts it there; it refuses CPU, so this script wraps as it does). Run by
tests/test_distributed.py:

    python -m torch.distributed.run --nproc_per_node 2 tests/fsdp1_probe.py OUT_DIR

The callback's core is handed the LightningModule and the root, as the Lightning adapter hands it
``pl_module`` and ``wrapped=trainer.strategy.model``; every rank probes, rank 0 writes OUT_DIR/sw.
"""

import faulthandler
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import planted  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ddp_lightning import PROBES  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402
from train_helpers import LitLM  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402

from sinkwatch.distributed import is_fsdp  # noqa: E402
from sinkwatch.live import LiveConfig, LiveMonitor  # noqa: E402


def main(out: str) -> None:
    faulthandler.dump_traceback_later(300, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    lit = LitLM(planted.p0_final())
    root = FSDP(lit, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), device_id=torch.device("cpu"), use_orig_params=True)
    assert is_fsdp(root)
    config = LiveConfig(every_n_steps=1, tokens_per_step=1, out_dir=os.path.join(out, "sw"), probes=PROBES, wandb="disabled", console=False)
    live = LiveMonitor(config)
    live.setup(lit, is_global_zero=dist.get_rank() == 0, wrapped=root)
    shards = [p.numel() for p in root.parameters()]
    live.step_end(0)
    live.step_end(1)  # twice: the first gather left the shards as they were
    assert [p.numel() for p in root.parameters()] == shards
    live.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
