"""The probe split over data-parallel ranks (tests/test_probe_split.py): one torchrun launch, several cases.

    python -m torch.distributed.run --nproc_per_node W tests/probe_split.py OUT

Every rank holds the same tiny Llama (GQA) and runs the live core (``LiveMonitor``) at its defaults
but for small explicit probes whose sizes do not divide by W (and a natural probe of fewer windows
than ranks, so some rank has no sequence of its own and only pads). Cases, each under OUT/CASE:

- ``ddp``: the bare module on every rank (DDP's layout), float32;
- ``fsdp2``: the model sharded with ``fully_shard`` per block and at the root (every probe forward a
  collective), float32;
- ``bf16``: the bare module under bf16 autocast (``compute_dtype``, a ``bf16-mixed`` run);
- ``fault``: the bare module, a fault inside rank 1's model forward at step 2 (``SINKWATCH_TEST_FAULT``):
  under DDP a probe forward is no collective, so the probe is skipped on every rank and the next one
  is written.

Each rank writes ``rank{r}.json``: its probe forwards and tokens per probe step, its status; rank 0
also ``single.jsonl``: the same probes in one process (``world_size=1``: no split), the reference.
A watchdog guards each case (a hang dumps every stack and exits) and the process group times out.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CASE_TIMEOUT_S = 150
CASES = ("ddp", "fsdp2", "bf16", "fault")
VOCAB = 256


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def probes():
    """Sizes that do not divide by 3 (nor by 2); natural: 2 windows sharing a BOS (the twin runs too)."""
    from sinkwatch import InductionProbe, RepeatedRandomProbe
    from sinkwatch.probes import make_natural_probe

    g = torch.Generator().manual_seed(7)
    windows = torch.randint(3, VOCAB, (2, 40), generator=g)
    windows[:, 0] = 1
    return [
        InductionProbe(n=11, seq_len=64, vocab_range=(3, VOCAB)),
        RepeatedRandomProbe(n=7, seq_len=32, vocab_range=(3, VOCAB)),
        make_natural_probe(windows, n=2, seq_len=40, bos_token_id=1),
    ]


def live_config(out: Path, **kw):
    from sinkwatch import MonitorConfig
    from sinkwatch.live import LiveConfig

    return LiveConfig(
        probes=probes(), every_n_steps=2, out_dir=str(out), wandb="disabled", console=False, tokens_per_step=1,
        monitor=MonitorConfig(batch_tokens=192, classical_pr=True), **kw,
    )  # fmt: skip


def run_case(case: str, out: Path) -> dict:
    from sinkwatch.live import LiveMonitor

    rank = dist.get_rank()
    m = model()
    wrapped = None
    if case == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in m.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    dtype = torch.bfloat16 if case == "bf16" else None
    if case == "fault":
        os.environ["SINKWATCH_TEST_FAULT"] = "model@1@2"
    work: dict[int, dict] = {}
    step_now = {"step": None}

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        w = work.setdefault(step_now["step"], {"forwards": 0, "tokens": 0})
        w["forwards"] += 1
        w["tokens"] += int(ids.numel())

    hook = m.register_forward_pre_hook(count, with_kwargs=True)
    live = LiveMonitor(live_config(out / "sw"))
    live.setup(m, is_global_zero=rank == 0, wrapped=wrapped, world_size=dist.get_world_size(), compute_dtype=dtype)
    steps = (0, 2, 4) if case == "fault" else (0,)
    for step in steps:
        step_now["step"] = step
        live.step_end(step)
    hook.remove()
    live.finish()
    os.environ.pop("SINKWATCH_TEST_FAULT", None)
    if rank == 0 and case != "fsdp2":  # the reference: one process, the same probes (FSDP2's: the ddp case's model)
        ref = LiveMonitor(live_config(out / "single"))
        ref.setup(model(), is_global_zero=True, world_size=1, compute_dtype=dtype)
        for step in steps:
            ref.step_end(step)
        ref.finish()
    return {"work": {str(k): v for k, v in work.items()}, "split": live.rank.split}


def main(out: str) -> None:
    torch.set_num_threads(1)
    faulthandler.enable()
    dist.init_process_group("gloo", timeout=timedelta(seconds=CASE_TIMEOUT_S))
    rank = dist.get_rank()
    for case in CASES:
        d = Path(out) / case
        d.mkdir(parents=True, exist_ok=True)
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        try:
            result = {"status": "ok", **run_case(case, d)}
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        faulthandler.cancel_dump_traceback_later()
        (d / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
