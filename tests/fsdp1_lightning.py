"""Lightning's FSDPStrategy (FSDP v1 units, one per GPT-2 block, inside the root Lightning puts around
the LightningModule) with SinkWatchCallback at its defaults (natural probe on), on 1 or 2 GPUs: the
matrix cells fsdp1_* run the same gather through the live core on CPU, because FSDPStrategy refuses
CPU. Run by benchmarks/gpu_check.sh:

    python tests/fsdp1_lightning.py OUT_DIR [--flat] [--bf16]   (--flat: use_orig_params=False; --bf16: precision="bf16-mixed")
    python tests/fsdp1_lightning.py --check OUT_DIR [--bf16]    (records equal a single-process run)

Each rank reads its own rows (tests/parallel_matrix.py ``rows``: the first batches differ by rank);
rank 0 saves its first batch and the gathered final weights for the single-process comparison.
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import lightning.pytorch as pl  # noqa: E402
import parallel_matrix as pm  # noqa: E402
import torch  # noqa: E402

from sinkwatch.lightning import SinkWatchCallback  # noqa: E402

# the probe runs the Triton kernel here and the single-process run on the same device: float32 noise
RTOL, ATOL = 1e-4, 1e-6


def main(out: str, flat: bool, bf16: bool = False) -> None:
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cell = Path(out)
    cell.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("LOCAL_RANK", 0))  # Lightning's launcher starts rank 1 with it set
    seen: dict = {}

    class FirstBatch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("first", {k: v.detach().cpu().clone() for k, v in batch.items()})

    lit = pm._lightning_module(pm.tiny_gpt2())
    cb = SinkWatchCallback(**pm.options(cell))
    strategy = FSDPStrategy(auto_wrap_policy={GPT2Block}, state_dict_type="full", use_orig_params=not flat)
    trainer = pl.Trainer(
        accelerator="gpu", devices=min(2, torch.cuda.device_count()), strategy=strategy, max_steps=pm.STEPS, callbacks=[FirstBatch(), cb],
        precision="bf16-mixed" if bf16 else "32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(cell),
    )  # fmt: skip
    trainer.fit(lit, torch.utils.data.DataLoader(pm.rows(rank), batch_size=pm.BATCH, collate_fn=pm.collate))
    root = trainer.strategy.model
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        full = root.state_dict()  # a collective
    if trainer.is_global_zero:
        torch.save({k.removeprefix("model."): v.cpu() for k, v in full.items()}, cell / "final.pt")
        torch.save(seen["first"], cell / "first-rank0.pt")


def check(out: str, bf16: bool = False) -> None:
    """The records, written once by rank 0, equal the same core run in one process on rank 0's first
    batch and the final weights (on the same GPU: the same statistics backend). ``bf16``: the run used
    ``bf16-mixed`` (FSDP parameter mixed precision): records say bfloat16 and equal one process under
    bf16 autocast within bf16 tolerance (before, every such run stopped at the step-0 probe)."""
    from sinkwatch.reporting.jsonl import read_jsonl

    cell = Path(out)
    records = read_jsonl(cell / "sw" / "records.jsonl")
    assert [r.get("step") for r in records] == [0, pm.EVERY, pm.STEPS], records
    model = pm.tiny_gpt2()
    model.load_state_dict(torch.load(cell / "final.pt", weights_only=True))
    first = torch.load(cell / "first-rank0.pt", weights_only=True)
    dtype = torch.bfloat16 if bf16 else None
    single = pm.single_process_record(model.cuda().eval(), first, Path(tempfile.mkdtemp()), compute_dtype=dtype)
    if bf16:
        assert {r["probe_dtype"] for r in records} == {"bfloat16"}, records
    pm.assert_records_equal(records[-1], single, rtol=1e-2 if bf16 else RTOL, atol=1e-2 if bf16 else ATOL)
    print(f"fsdp1 lightning ({cell.name}, {'bf16-mixed' if bf16 else '32-true'}): records equal a single-process run on rank 0's windows")


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        check(sys.argv[2], bf16="--bf16" in sys.argv[3:])
    else:
        main(sys.argv[1], flat="--flat" in sys.argv[2:], bf16="--bf16" in sys.argv[2:])
