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

Faults real runs produce, under FSDP2 (every probe forward a collective), each at step 2 of probes at
0, 2 and 4 (``FAULT_CASES``): ``oom`` (every rank an out-of-memory in the middle block, its message with
this rank's PID and byte counts, after the block's all-gather), ``shapes`` (a real shape error in the
middle block on every rank, its numbers this rank's row count), ``value`` (a ``ValueError`` in rank 1's
middle block only), ``fallback`` (a head sinkwatch cannot reproduce: the repeated probe's losses come
from extra forwards of one sequence each, as many as each rank's share has rows). Each run finishes and
probes 0 and 4 are written. Besides: ``paper`` (``protocol="paper"``, its first-N PR with N inside rank
0's share) and ``fsdp2_mp`` (``MixedPrecisionPolicy(param_dtype=bf16)``: records say bfloat16).

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
FAULT_CASES = ("oom", "shapes", "value", "fallback")
CASES = ("ddp", "fsdp2", "bf16", "fault", *FAULT_CASES, "paper", "fsdp2_mp")
PAPER_PR = 4  # the paper case's first-N PR: rows 0..3, all in rank 0's share of 11 (4, 4, 3)
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


def live_config(out: Path, **monitor):
    from sinkwatch import MonitorConfig
    from sinkwatch.live import LiveConfig

    return LiveConfig(
        probes=probes(), every_n_steps=2, out_dir=str(out), wandb="disabled", console=False, tokens_per_step=1,
        monitor=MonitorConfig(batch_tokens=192, classical_pr=True, **monitor), fault_timeout_s=10,
    )  # fmt: skip


def scaled_logits(m):
    """``m`` with its logits scaled after the head (its forward wrapped), so the head cannot be reproduced."""
    import functools

    forward = m.forward

    @functools.wraps(forward)  # its signature still takes logits_to_keep: the last position's logits only, the tap armed
    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 1.5
        return out

    m.forward = scaled
    return m


STEP = {"now": None}  # the step the live core is probing (the fault cases' faults fire at step 2)


def plant_fault(case: str, m) -> None:
    """The fault of a FAULT_CASES case, in the middle block at step 2 (the probe forwards run in eval mode)."""
    import os

    rank = dist.get_rank()
    block = m.model.layers[len(m.model.layers) // 2]
    if case == "oom":  # after FSDP's all-gather (appended to its pre-hooks), every rank: its own PID and byte counts

        def oom(module, args):
            if STEP["now"] == 2 and not module.training:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {20 + rank}.00 MiB. GPU {rank} has a total capacity of 79.19 GiB of "
                    f"which {3 + rank}.50 MiB is free. Process {os.getpid()} has 79.18 GiB memory in use."
                )

        block.register_forward_pre_hook(oom)
        return
    forward = block.forward

    def faulty(hidden_states, *args, **kwargs):
        if STEP["now"] == 2 and not block.training:
            if case == "shapes" and hidden_states.shape[1] == 32:  # the repeated probe's one forward: 3, 3 and 1 rows
                hidden_states.view(hidden_states.shape[0], 33, -1)  # a real shape error, its numbers this rank's rows
            if case == "value" and rank == 1:
                raise ValueError(f"rank {rank}'s rows cannot run here")
        return forward(hidden_states, *args, **kwargs)

    block.forward = faulty


def run_case(case: str, out: Path) -> dict:
    from sinkwatch.live import LiveMonitor

    rank = dist.get_rank()
    m = scaled_logits(model()) if case == "fallback" else model()
    wrapped = None
    if case in ("fsdp2", "fsdp2_mp", *FAULT_CASES):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if case == "fsdp2_mp" else MixedPrecisionPolicy()
        for block in m.model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(m, mesh=mesh, mp_policy=mp)
    if case in FAULT_CASES and case != "fallback":
        plant_fault(case, m)
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
    monitor = {"protocol": "paper"} if case == "paper" else {}
    live = LiveMonitor(live_config(out / "sw", **monitor))
    live.setup(m, is_global_zero=rank == 0, wrapped=wrapped, world_size=dist.get_world_size(), compute_dtype=dtype)
    steps = (0, 2, 4) if case in ("fault", *FAULT_CASES) else (0,)
    for step in steps:
        step_now["step"] = STEP["now"] = step
        live.step_end(step)
    hook.remove()
    live.finish()
    os.environ.pop("SINKWATCH_TEST_FAULT", None)
    # the reference: one process, the same probes and model (FSDP2's and the planted faults': the ddp case's)
    if rank == 0 and case in ("ddp", "bf16", "fault", "fallback", "paper"):
        ref = LiveMonitor(live_config(out / "single", **monitor))
        ref.setup(scaled_logits(model()) if case == "fallback" else model(), is_global_zero=True, world_size=1, compute_dtype=dtype)
        for step in steps:
            ref.step_end(step)
        ref.finish()
    return {"work": {str(k): v for k, v in work.items()}, "split": live.rank.split}


def main(out: str) -> None:
    import sinkwatch.capture.head
    import sinkwatch.probe.runs

    sinkwatch.probe.runs.PAPER_PR_SEQUENCES = PAPER_PR  # the paper's 500, scaled to these probes
    sinkwatch.capture.head.FALLBACK_BYTES = 1  # one sequence per extra forward: as many as each rank's share has rows
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
