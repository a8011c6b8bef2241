"""Two CPU processes (gloo) under torchrun: an OLMo-core Trainer with FSDP2 (``dp=fsdp``) or HSDP
with and without the sinkwatch callback, then the parallelisms sinkwatch refuses. Rank 0 writes
out/result.pt: both runs' final weights, the metrics the trainer logged, and each refusal's error.
Exits after 300 s with stack dumps rather than hang (a rank that skipped a probe's all-gather)."""

from __future__ import annotations

import faulthandler
import sys
from pathlib import Path

import torch
import torch.distributed as dist

faulthandler.dump_traceback_later(300, exit=True)


def refusals() -> dict[str, str]:
    """Each parallelism sinkwatch refuses, applied for real on the 2-rank mesh, and the error."""
    from olmo_core_helpers import model_config
    from torch.distributed.device_mesh import init_device_mesh

    from sinkwatch.capture import OLMoCoreTarget, UnsupportedModelError

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for kind in ("tensor", "context", "pipeline", "expert"):
        model = model_config(moe=kind == "expert").build(init_device="cpu")
        if kind == "tensor":
            model.apply_tp(mesh)
        elif kind == "context":
            from olmo_core.train.train_module.transformer.config import TransformerContextParallelConfig

            model.apply_cp(mesh, uly=TransformerContextParallelConfig.ulysses(degree=2).uly)  # ring needs flash attention
        elif kind == "pipeline":
            model.apply_pp(mesh)
        else:
            model.apply_ep(mesh)
        try:
            OLMoCoreTarget(model)
            out[kind] = "accepted"
        except UnsupportedModelError as exc:
            out[kind] = str(exc)
    return out


def main(out: str, dp: str) -> None:
    import olmo_core.distributed.parallel as olmo_parallel
    from olmo_core_helpers import build_trainer, metrics_log_callback, model_state

    from sinkwatch.olmo_core import SinkWatchCallback
    from sinkwatch.probes import InductionProbe, RepeatedRandomProbe

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out_dir = Path(out)
    logged: dict[int, dict] = {}
    from olmo_core_helpers import token_file

    for name in ("plain", "watched"):  # one token file per run directory, written once
        if rank == 0:
            (out_dir / name / "data").mkdir(parents=True, exist_ok=True)
            token_file(out_dir / name / "data")
        dist.barrier()
    result = {}
    for name in ("plain", "watched"):
        cbs = {"metrics": metrics_log_callback(logged)}
        if name == "watched":
            probes = [InductionProbe(n=8, seq_len=64), RepeatedRandomProbe(n=8, seq_len=32)]
            cbs["sinkwatch"] = SinkWatchCallback(
                every_n_steps=2, out_dir=str(out_dir / "sw"), probes=probes, wandb="disabled", console=False, raise_on_error=True
            )
        # OLMo-core builds one world mesh per process; training twice in one launch (half the
        # start-up time of two launches) needs its module-level mesh cleared in between.
        olmo_parallel._WORLD_MESH = None
        trainer = build_trainer(out_dir / name, cbs, steps=4, dp=dp, global_seqs=4, micro_seqs=1)
        trainer.fit()
        result[name] = model_state(trainer)
        if name == "watched":
            from torch.distributed.fsdp import FSDPModule

            result["sharded"] = [type(m).__name__ for m in trainer.train_module.model.modules() if isinstance(m, FSDPModule)]
    result["logged"] = logged
    result["refused"] = refusals()
    if rank == 0:
        torch.save(result, out_dir / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
