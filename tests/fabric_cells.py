"""Lightning Fabric cells of the parallel matrix (tests/test_fabric_parallel.py): one torchrun launch.

    python -m torch.distributed.run --nproc_per_node 2 tests/fabric_cells.py OUT CELL [CELL ...]

Each cell trains a tiny LitGPT ``GPT`` for 4 optimizer steps in a hand-written Fabric loop on 2 gloo
processes with ``SinkWatchFabricCallback`` at its defaults (only ``every_n_steps`` and ``out_dir`` set;
W&B "auto" = an offline run), each rank reading its own rows. Writes, under OUT/CELL, as
tests/parallel_matrix.py does: ``result-rank{r}.json``, ``first-rank{r}.pt``, ``natural-rank{r}.pt``
and rank 0's ``final.pt`` (the full final weights). A watchdog (``faulthandler.dump_traceback_later``)
ends a hang with every stack on stderr.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CELL_TIMEOUT_S = 150
STEPS, EVERY, MICRO, T = 4, 2, 4, 64


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rows(rank: int, n: int = 32) -> torch.Tensor:
    """Rank ``rank``'s own rows: (n, T + 1) tokens (inputs and shifted targets), different on each rank."""
    g = torch.Generator().manual_seed(2000 + rank)
    return torch.randint(0, 96, (n, T + 1), generator=g)


def tiny_gpt(seed: int = 0):
    from fabric_helpers import tiny_config
    from litgpt.model import GPT

    torch.manual_seed(seed)
    model = GPT(tiny_config())
    model.apply(model._init_weights)
    return model


def fsdp2(module, device_mesh):
    """``ModelParallelStrategy``'s parallelize_fn: FSDP2 on each block and on the root."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for block in module.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _train(cell: Path, strategy, *, watched: bool = True) -> tuple:
    from lightning.fabric import Fabric

    from sinkwatch.fabric import SinkWatchFabricCallback

    cb = SinkWatchFabricCallback(every_n_steps=EVERY, out_dir=str(cell / "sw")) if watched else None
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, callbacks=[cb] if watched else [])
    fabric.launch()
    model = fabric.setup(tiny_gpt())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    data = rows(_rank())
    first, losses = None, []
    for step in range(STEPS):
        batch = data[MICRO * step : MICRO * (step + 1)]
        first = batch[:, :-1].clone() if first is None else first
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if not watched:
        return fabric, model, losses
    torch.save({"input_ids": first}, cell / f"first-rank{_rank()}.pt")
    if cb.live.natural is not None:
        torch.save(cb.live.natural.tokens, cell / f"natural-rank{_rank()}.pt")
    cb.finish()
    return fabric, model, losses


def fabric_ddp(cell: Path) -> None:
    fabric, model, _ = _train(cell, "ddp")
    if _rank() == 0:
        torch.save({k: v.detach().clone() for k, v in model._original_module.state_dict().items()}, cell / "final.pt")


def fabric_fsdp2(cell: Path) -> None:
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    def full_state(model) -> dict:  # a collective
        return get_model_state_dict(model._original_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def strategy():
        return ModelParallelStrategy(fsdp2, data_parallel_size=dist.get_world_size(), tensor_parallel_size=1)

    # unmonitored first, then watched, from the same seed: the step-0 probe must change nothing
    _, plain_model, plain_losses = _train(cell, strategy(), watched=False)
    plain = full_state(plain_model)
    fabric, model, losses = _train(cell, strategy())
    full = full_state(model)
    if _rank() == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, cell / "final.pt")
        same = {k: torch.equal(v, full[k]) for k, v in plain.items()}
        (cell / "identical.json").write_text(json.dumps({"losses": losses, "plain_losses": plain_losses, "weights_identical": same}))
        sharded = [type(m).__name__ for m in model._original_module.modules() if "FSDP" in type(m).__name__]
        (cell / "sharded.json").write_text(json.dumps(sharded))


CELLS = {f.__name__: f for f in (fabric_ddp, fabric_fsdp2)}


def main(out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    faulthandler.enable()
    dist.init_process_group("gloo", timeout=timedelta(seconds=CELL_TIMEOUT_S))
    for name in names:
        cell = Path(out) / name
        cell.mkdir(parents=True, exist_ok=True)
        faulthandler.dump_traceback_later(CELL_TIMEOUT_S, exit=True)
        print(f"[rank {_rank()}] cell {name}", file=sys.stderr, flush=True)
        result = {"status": "ok"}
        try:
            CELLS[name](cell)
        except Exception as exc:  # noqa: BLE001 - the test reads what each cell raised
            result = {"status": "error", "type": type(exc).__name__, "error": str(exc), "traceback": traceback.format_exc()}
        (cell / f"result-rank{_rank()}.json").write_text(json.dumps(result))
        dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
