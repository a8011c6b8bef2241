"""Megatron-core cells (tests/test_megatron.py): one torchrun launch on 2 gloo processes (or 4: tensor
parallelism 2 x data parallelism 2, each replica reading its own rows), several cells.

    python -m torch.distributed.run --nproc_per_node 2 tests/megatron_cells.py OUT CELL [CELL ...]

Cells (each under a watchdog, ``faulthandler.dump_traceback_later``: a hang dumps every stack and exits;
the process group times out too):

- ``tp2``: tensor parallelism 2 (GQA: 4 query heads, 2 key/value groups; attention and hidden dropout 0.1).
  ``STEPS`` optimizer steps by hand
  (tests/megatron_helpers.train_step) with ``SinkWatchMegatron`` at its defaults but the schedule (probes at
  0, 2 and 4) and a fault injected in sinkwatch's statistics on tensor-parallel rank 1 at step 2; then the
  same steps from the same initial weights and batches without it. Writes each rank's losses and whether
  its final parameters are ``torch.equal`` to the plain run's, and on rank 0 the master weights (initial,
  final), the probe sets and the records (``sw/``);
- ``tp1``: the same model at tensor parallelism 1 (data parallelism 2) from ``tp2``'s final master weights,
  probed once with ``tp2``'s probe sets (``sw/``): the record the tensor-parallel one must equal;
- ``other2`` / ``other1``: a Llama-like variant (RMSNorm, SwiGLU, QK layer norm, no biases, tied embeddings, query-key
  layer scaling; 3 layers, 6 heads in 2 groups) trained two steps at tensor parallelism 2 with the monitor at its
  defaults (probes at 0 and the last step), then its final master weights probed at tensor parallelism 1;
- ``refusals``: what cannot be probed live, refused at construction with the reason (each error's text);
- ``tpfault`` (a launch of its own, it ends the processes): a fault in a block's own forward on tensor-parallel
  rank 1, which raises ``ProbeForwardBroken`` within ``fault_timeout_s``;
- ``gqa1``: tensor parallelism 2 with one key/value group for 4 query heads (fewer groups than ranks:
  Megatron gathers the projection and each rank keeps its query heads), probed at step 0 (``sw/``, the
  master weights, the probe sets).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import megatron_helpers as mh  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CELL_TIMEOUT_S = 120
STEPS, EVERY = 4, 2
FAULT = "stats@1@2"  # sinkwatch's statistics raise on global rank 1 (tensor-parallel rank 1) at step 2
OPTIONS = {"wandb": "disabled", "console": False}
DROPOUT = 0.1  # tp2's attention and hidden dropout
FAULT_TIMEOUT_S = 5.0  # tpfault: how long the faulting rank waits for the verdict


def _rank() -> int:
    return dist.get_rank()


def _save(obj, path: Path) -> None:
    if _rank() == 0:
        torch.save(obj, path)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def tp2(cell: Path) -> dict:
    from megatron.core import parallel_state as ps

    from sinkwatch.megatron import SinkWatchMegatron

    mh.cpu_megatron(tp=2)
    data = mh.batches(ps.get_data_parallel_rank(), STEPS)
    # dropout 0.1: training draws from the CPU RNG (the no-op tracker), so a probe that moved it would show below
    model = mh.build_gpt(groups=2, dropout=DROPOUT)
    _save(mh.master_weights(model), cell / "initial.pt")
    optimizer = _optimizer(model)
    os.environ["SINKWATCH_TEST_FAULT"] = FAULT
    try:
        sw = SinkWatchMegatron(model, max_steps=STEPS, every_n_steps=EVERY, out_dir=str(cell / "sw"), **OPTIONS)
        watched = []
        for it in range(STEPS):
            sw.read(data[it][:, :-1])
            watched.append(mh.train_step(model, optimizer, data[it], ps.get_data_parallel_group()))
            sw.step(it + 1)
    finally:
        os.environ.pop("SINKWATCH_TEST_FAULT", None)
    _save(mh.master_weights(model), cell / "final.pt")
    _save(sw.live.monitor.probe_sets(mh.VOCAB), cell / "sets.pt")
    plain_model = mh.build_gpt(groups=2, dropout=DROPOUT)
    plain_opt = _optimizer(plain_model)
    plain = [mh.train_step(plain_model, plain_opt, data[it], ps.get_data_parallel_group()) for it in range(STEPS)]
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    return {"watched": watched, "plain": plain, "same_params": same, "tp_rank": ps.get_tensor_model_parallel_rank()}


def tp1(cell: Path) -> dict:
    from sinkwatch.megatron import SinkWatchMegatron

    mh.cpu_megatron(tp=1)
    model = mh.build_gpt(groups=2, seed=99)  # other weights, replaced by tp2's final ones
    source = cell.parent / "tp2"
    mh.load_master(model, torch.load(source / "final.pt", weights_only=True))
    sets = torch.load(source / "sets.pt", weights_only=False)
    sw = SinkWatchMegatron(
        model, max_steps=STEPS, start_step=0, probes=sets, probe_at_start=False, every_n_steps=None, out_dir=str(cell / "sw"), **OPTIONS
    )
    sw.step(STEPS)  # the last step: probed (probe_at_end)
    return {}


def gqa1(cell: Path) -> dict:
    from megatron.core import parallel_state as ps

    from sinkwatch.megatron import SinkWatchMegatron

    mh.cpu_megatron(tp=2)
    model = mh.build_gpt(groups=1, seed=5)
    _save(mh.master_weights(model), cell / "initial.pt")
    sw = SinkWatchMegatron(model, every_n_steps=None, probe_at_end=False, out_dir=str(cell / "sw"), **OPTIONS)
    sw.read(mh.batches(ps.get_data_parallel_rank(), 1)[0][:, :-1])
    _save(sw.live.monitor.probe_sets(mh.VOCAB), cell / "sets.pt")
    sw.finish()
    return {"local_heads": model.decoder.layers[0].self_attention.core_attention.num_attention_heads_per_partition}


def other2(cell: Path) -> dict:
    """The Llama-like variant (``megatron_helpers.build_gpt(other=True)``) at tensor parallelism 2: two steps by hand,
    probed at 0 and 2; its final master weights and probe sets saved for ``other1``."""
    from megatron.core import parallel_state as ps

    from sinkwatch.megatron import SinkWatchMegatron

    mh.cpu_megatron(tp=2)
    data = mh.batches(ps.get_data_parallel_rank(), 2)
    model = mh.build_gpt(other=True)
    _save(mh.master_weights(model), cell / "initial.pt")
    optimizer = _optimizer(model)
    sw = SinkWatchMegatron(model, max_steps=2, out_dir=str(cell / "sw"), **OPTIONS)
    for it in range(2):
        sw.read(data[it][:, :-1])
        mh.train_step(model, optimizer, data[it], ps.get_data_parallel_group())
        sw.step(it + 1)
    _save(mh.master_weights(model), cell / "final.pt")
    _save(sw.live.monitor.probe_sets(mh.VOCAB), cell / "sets.pt")
    return {}


def other1(cell: Path) -> dict:
    from sinkwatch.megatron import SinkWatchMegatron

    mh.cpu_megatron(tp=1)
    model = mh.build_gpt(other=True, seed=99)
    source = cell.parent / "other2"
    mh.load_master(model, torch.load(source / "final.pt", weights_only=True))
    sets = torch.load(source / "sets.pt", weights_only=False)
    sw = SinkWatchMegatron(model, max_steps=2, probes=sets, probe_at_start=False, every_n_steps=None, out_dir=str(cell / "sw"), **OPTIONS)
    sw.step(2)
    return {}


def refusals(cell: Path) -> dict:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sinkwatch.live import LiveConfig, LiveMonitor
    from sinkwatch.megatron import SinkWatchMegatron

    mh.cpu_megatron(tp=2)
    errors = {}

    def refused(name, fn):
        try:
            fn()
            errors[name] = None
        except (ValueError, TypeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"

    model = mh.build_gpt()
    refused("no_layout", lambda: LiveMonitor(LiveConfig(**OPTIONS, out_dir=str(cell / "a"))).setup(model, is_global_zero=_rank() == 0))
    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        window_size=(16, 0),
    )  # fmt: skip
    windowed = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=mh.VOCAB, max_sequence_length=mh.SEQ, position_embedding_type="rope")
    refused("window", lambda: SinkWatchMegatron(windowed, out_dir=str(cell / "b"), **OPTIONS))
    # sequence parallelism cannot be built here (torch's LayerNorm refuses it; Apex/TE are CUDA-only): the flag is set
    # on a built model's config, as a GPU run's config carries it
    model.config.sequence_parallel = True
    refused("sequence_parallel", lambda: SinkWatchMegatron(model, out_dir=str(cell / "c"), **OPTIONS))
    return {"errors": errors}


def tpfault(cell: Path) -> dict:
    """A fault inside a block's own forward on tensor-parallel rank 1 (the middle block's pre-hook, step 0): the
    block cannot be skipped on one rank (it would unpair the row-parallel all-reduces), so rank 1 waits
    ``fault_timeout_s`` for the verdict and raises ``ProbeForwardBroken`` while rank 0 waits in the block's
    all-reduce. Rank 1 writes its result and exits non-zero, so the launcher ends rank 0 (the last cell)."""
    from megatron.core import parallel_state as ps

    from sinkwatch.megatron import SinkWatchMegatron

    mh.cpu_megatron(tp=2)
    model = mh.build_gpt(groups=2)
    sw = SinkWatchMegatron(
        model, every_n_steps=None, probe_at_end=False, preflight=False, fault_timeout_s=FAULT_TIMEOUT_S, out_dir=str(cell / "sw"), **OPTIONS
    )
    os.environ["SINKWATCH_TEST_FAULT"] = "model@1@0"
    t0 = time.perf_counter()
    try:
        sw.read(mh.batches(ps.get_data_parallel_rank(), 1)[0][:, :-1])  # the first read probes step 0
        raised = None
    except Exception as exc:  # noqa: BLE001 - what rank 1 raised, for the test
        raised = f"{type(exc).__name__}: {exc}"
    result = {"status": "ok", "raised": raised, "seconds": time.perf_counter() - t0}
    (cell / f"result-rank{_rank()}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(3 if raised else 0)  # the run stops here, as a training loop's uncaught ProbeForwardBroken would


CELLS = {f.__name__: f for f in (tp2, tp1, gqa1, other2, other1, refusals, tpfault)}


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=CELL_TIMEOUT_S))
    for name in sys.argv[2:]:
        cell = out / name
        cell.mkdir(parents=True, exist_ok=True)
        faulthandler.dump_traceback_later(CELL_TIMEOUT_S, exit=True)
        t0 = time.perf_counter()
        try:
            result = {"status": "ok", **CELLS[name](cell)}
        except Exception as exc:  # noqa: BLE001 - written for the test to show
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        faulthandler.cancel_dump_traceback_later()
        result["seconds"] = time.perf_counter() - t0
        (cell / f"result-rank{_rank()}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
