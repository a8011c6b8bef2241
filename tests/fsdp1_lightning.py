"""Two-GPU FSDP (v1 wrappers) fit through Lightning's FSDPStrategy with an auto-wrap
policy and SinkWatchCallback; run by tests/test_distributed.py.

    python tests/fsdp1_lightning.py OUT_DIR      (2 GPUs: Lightning's FSDPStrategy refuses CPU;
                                                  benchmarks/gpu_check.sh runs it where there are two)

Each GPT-2 block is its own FSDP unit inside the root wrapper Lightning puts around the
LightningModule, so the probe must gather through that root (gathering one inner unit leaves the
other blocks and the embeddings sharded). At the end every rank joins the full state-dict gather and
rank 0 saves OUT_DIR/final for the single-process comparison.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import planted  # noqa: E402
from ddp_lightning import SlowLit, fit  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402


def main(out: str) -> None:
    strategy = FSDPStrategy(auto_wrap_policy={GPT2Block}, state_dict_type="full")
    trainer, lit = fit(out, lambda: SlowLit(planted.p0_final()), strategy, accelerator="gpu")
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    root = trainer.strategy.model
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        full = root.state_dict()  # a collective
    if trainer.is_global_zero:
        model = planted.p0_final()
        model.load_state_dict({k.removeprefix("model."): v for k, v in full.items()})
        model.save_pretrained(os.path.join(out, "final"))


def check(out: str) -> None:
    """The records equal a single-process probe of the saved final weights (as test_distributed does)."""
    import numpy as np
    from ddp_lightning import PROBES
    from transformers import GPT2LMHeadModel

    from sinkwatch import Monitor
    from sinkwatch.reporting.jsonl import read_jsonl

    records = read_jsonl(os.path.join(out, "sw", "records.jsonl"))
    assert [r["step"] for r in records] == [0, 5, 10], [r.get("step") for r in records]
    single = Monitor(PROBES).probe(GPT2LMHeadModel.from_pretrained(os.path.join(out, "final"))).to_record()
    for key in ("sink_alpha", "pr", "induction_score", "p0_norm_ratio"):
        np.testing.assert_allclose(np.array(records[-1][key], dtype=float), np.array(single[key], dtype=float), rtol=1e-4, atol=1e-6)
    print("fsdp1 lightning: records equal a single-process probe")


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        check(sys.argv[2])
    else:
        main(sys.argv[1])
