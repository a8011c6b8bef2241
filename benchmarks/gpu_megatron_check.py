"""benchmarks/gpu_check.sh's Megatron stage: Transformer Engine's attention (``TEDotProductAttention``), which
needs CUDA and cannot be tested on the CPU suite's machine. One GPU, no CPU workaround (tests/megatron_helpers.py
has those for the CPU tests only).

Two megatron-core ``GPTModel``s with the same weights, the local layer spec each, one with its core attention
replaced by ``TEDotProductAttention`` (the same call, ``core_attention(q, k, v, mask, attn_mask_type=...)``),
each probed by ``SinkWatchMegatron`` at step 0 (float32); checked: the TE model's record equals the local
model's (sink alpha, P0 norm ratios, the induction score and the attention entropy within 1e-4; the same head
classes and head count).

    python3 benchmarks/gpu_megatron_check.py --requirements      # exit 0, or 3 and why the stage cannot run
    python3 -m torch.distributed.run --nproc_per_node 1 benchmarks/gpu_megatron_check.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def requirement_problem() -> str | None:
    """Why this machine cannot run the stage, or None."""
    try:
        import torch
    except ImportError:
        return "no torch"
    if not torch.cuda.is_available():
        return "no GPU"
    for module, why in (("megatron.core", "megatron-core is not installed"), ("transformer_engine", "Transformer Engine is not installed")):
        try:
            __import__(module)
        except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip
            return f"{why} ({type(exc).__name__}: {exc})"
    return None


def build(te: bool, seed: int = 0):
    import torch
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = get_gpt_layer_local_spec()
    if te:
        spec.submodules.self_attention.submodules.core_attention = TEDotProductAttention
    config = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=8, num_query_groups=2, attention_dropout=0.0, hidden_dropout=0.0
    )
    torch.manual_seed(seed)
    return GPTModel(config, spec, vocab_size=256, max_sequence_length=128, position_embedding_type="rope").cuda()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requirements", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    why = requirement_problem()
    if args.requirements:
        print(why or "ok")
        sys.exit(3 if why else 0)
    if why:
        sys.exit(f"cannot run: {why}")
    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from sinkwatch.megatron import SinkWatchMegatron

    out = Path(args.out)
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    local, te = build(False), build(True)
    te.load_state_dict(local.state_dict(), strict=False)  # core attention holds no weights; TE's extra state aside
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (4, 129), generator=g).cuda()
    records = {}
    for name, model in (("local", local), ("te", te)):
        sw = SinkWatchMegatron(model, every_n_steps=None, probe_at_end=False, out_dir=str(out / name), wandb="disabled", console=False)
        sw.read(tokens[:, :-1])
        sw.finish()
        records[name] = json.loads((out / name / "records.jsonl").read_text().splitlines()[0])
    a, b = records["local"], records["te"]
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    for key in ("sink_alpha", "p0_norm_ratio", "induction_score", "attention_entropy"):
        np.testing.assert_allclose(np.array(b[key], dtype=float), np.array(a[key], dtype=float), rtol=1e-4, atol=1e-4, err_msg=key)
    assert a["best_class"] == b["best_class"] and a["n_heads"] == b["n_heads"] == 8
    summary = {"ok": True, "keys_compared": 4, "n_heads": a["n_heads"], "te_model": b["model"]}
    (out / "gpu_megatron_check.json").write_text(json.dumps(summary))
    print("megatron TEDotProductAttention record equals the local attention's:", summary)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
