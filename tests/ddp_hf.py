"""Two-process DDP (gloo, CPU) run of transformers.Trainer with SinkWatchTrainerCallback; run by
tests/test_distributed.py through torchrun:

    python -m torch.distributed.run --nproc_per_node 2 tests/ddp_hf.py OUT_DIR

The Trainer wraps the model in DistributedDataParallel; the callback is handed the bare model, and
only the world-process-zero probes and reports. The final weights go to OUT_DIR/final.
"""

import faulthandler
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import planted  # noqa: E402
import torch  # noqa: E402
from ddp_lightning import PROBES, dataset, user_hooks  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from sinkwatch.hf import SinkWatchTrainerCallback  # noqa: E402


def main(out: str) -> None:
    faulthandler.dump_traceback_later(300, exit=True)  # a hung collective fails with stacks, not a stalled CI
    torch.set_num_threads(1)
    cb = SinkWatchTrainerCallback(
        every_n_steps=5, out_dir=os.path.join(out, "sw"), probes=PROBES, wandb="offline", console=False, **user_hooks(out)
    )
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), max_steps=10, per_device_train_batch_size=4, learning_rate=1e-3,
        use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no", logging_steps=5, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=planted.p0_final(), args=args, train_dataset=dataset(), callbacks=[cb])
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))  # world process zero writes


if __name__ == "__main__":
    main(sys.argv[1])
