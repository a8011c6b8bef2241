"""Megatron-core on CPU for the tests (tests/test_megatron.py, tests/megatron_cells.py): the real modules
(``GPTModel`` with the local layer spec: ``SelfAttention`` -> ``DotProductAttention``, Column/RowParallelLinear,
VocabParallelEmbedding, vocab-parallel cross-entropy, RoPE) over gloo, with the CPU workarounds that live
here only (a user on GPUs needs none of them), and an independent float64 forward of the same weights.

The workarounds, each replacing one CUDA-only line of megatron-core 0.16.1:

- ``TransformerConfig(use_cpu_initialization=True)``: the weights are made on the CPU (the default makes
  them on ``torch.cuda.current_device()``); each rank draws the whole master weight and keeps its slice,
  so every tensor-parallel size holds the same master weights from the same seed;
- ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``: Megatron's public RNG set-up with
  its no-op tracker (the CUDA tracker forks ``torch.cuda`` RNG states around the tensor-parallel dropout);
- ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` unconditionally: the
  patched method is the same computation without that move;
- ``GlobalMemoryBuffer.get_tensor`` (core attention's score buffer, ``("mpu", dtype)``) allocates on
  ``torch.cuda.current_device()`` when it grows: the patched method is the same with the new buffer on the
  CPU (training's forwards and the probe's larger micro-batches grow it alike);
- with fewer key/value groups than tensor-parallel ranks, ``Attention`` gathers the QKV projection with
  ``mappings._gather_along_last_dim``, whose output is allocated on ``torch.cuda.current_device()``: the
  patched function is the same gather into a tensor on the input's device (only that model needs it).

Megatron's schedule (``forward_backward_no_pipelining``) hard-codes ``device="cuda"`` for its loss
bookkeeping, so ``train_step`` does the forward, backward and optimizer step by hand, as the schedule
does for one micro-batch without pipelining (and the data-parallel gradient all-reduce, which Megatron's
own DDP would do, needing ``torch.cuda.current_device``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH = 128, 64, 4  # the models' (padded) vocabulary and context; rows per step and rank


def cpu_megatron(tp: int, seed: int = 1234) -> None:
    """Megatron's model-parallel state on the gloo world (``tp`` x data parallel), with the CPU workarounds."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    # workaround: the no-op RNG tracker (the CUDA one forks torch.cuda RNG states)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    # workaround: get_emb without its move of inv_freq to torch.cuda.current_device()
    RotaryEmbedding.get_emb = _get_emb_on_cpu
    # workaround: the global memory buffer (core attention's scores) grown on the CPU (it would grow on CUDA)
    from megatron.core.utils import GlobalMemoryBuffer

    GlobalMemoryBuffer.get_tensor = _get_tensor_on_cpu
    # workaround: the QKV gather of fewer key/value groups than ranks, into a tensor on the input's device
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_last_dim = _gather_along_last_dim_here


def _gather_along_last_dim_here(input_, group):
    """megatron-core 0.16.1's ``mappings._gather_along_last_dim`` with its output on ``input_``'s device."""
    from megatron.core.tensor_parallel.mappings import dist_all_gather_func

    world_size = group.size()
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] * world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    dist_all_gather_func(output, input_.contiguous(), group=group)
    return torch.cat(output.chunk(world_size, dim=0), dim=-1).contiguous()


def _get_tensor_on_cpu(self, tensor_shape, dtype, name, mem_alloc_context=None):
    """megatron-core 0.16.1's ``GlobalMemoryBuffer.get_tensor`` with a buffer that grows on the CPU."""
    required = math.prod(tensor_shape)
    held = self.buffer.get((name, dtype))
    if held is None or held.numel() < required:
        self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
    return self.buffer[(name, dtype)][0:required].view(*tensor_shape)


def _get_emb_on_cpu(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """megatron-core 0.16.1's ``RotaryEmbedding.get_emb`` minus its first two lines (the move to CUDA)."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def build_gpt(
    *, layers: int = 2, hidden: int = 64, heads: int = 4, groups: int = 2, seed: int = 0, vocab: int = VOCAB, other=False, dropout=0.0
):
    """A Megatron ``GPTModel`` (local spec, RoPE, biases, an output layer of its own: Megatron's defaults) from ``seed``.
    ``dropout``: attention and hidden dropout (with the no-op RNG tracker they draw from the CPU RNG).
    ``other``: a Llama-like variant (RMSNorm, SwiGLU, QK layer norm, no biases, tied embeddings,
    ``apply_query_key_layer_scaling``) of 3 layers, 6 query heads in 2 groups, width 96."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra: dict = {}
    if other:
        layers, hidden, heads, groups = 3, 96, 6, 2
        extra = {
            "normalization": "RMSNorm", "gated_linear_unit": True, "activation_func": torch.nn.functional.silu, "add_bias_linear": False,
            "apply_query_key_layer_scaling": True, "ffn_hidden_size": 160, "qk_layernorm": True,
        }  # fmt: skip
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        use_cpu_initialization=True,  # workaround: weights made on the CPU
        attention_dropout=dropout, hidden_dropout=dropout, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(qk_layernorm=other, normalization="RMSNorm" if other else None)
    return GPTModel(
        config, spec, vocab_size=vocab, max_sequence_length=SEQ, position_embedding_type="rope", share_embeddings_and_output_weights=other
    )


def causal_mask(S: int) -> torch.Tensor:
    """Megatron GPT pretraining's mask: (1, 1, S, S), True where masked."""
    return torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]


def train_step(model, optimizer, tokens: torch.Tensor, dp_group=None) -> float:
    """One optimizer step on ``tokens`` (B, S+1): forward with labels (the vocab-parallel loss), backward,
    the QK norms' gradients summed over the tensor-parallel group and every gradient averaged over the
    data-parallel group (what Megatron's ``finalize_model_grads`` does here), the optimizer step. Returns the loss."""
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    B, S = ids.shape
    losses = model(ids, torch.arange(S).expand(B, S), causal_mask(S), labels=labels)  # (B, S)
    loss = losses.float().mean()
    loss.backward()
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    if model.config.qk_layernorm and dist.get_world_size(tp_group) > 1:
        # as Megatron's finalize_model_grads (_allreduce_non_tensor_model_parallel_grads): the QK norms are replicated,
        # and each tensor-parallel rank's gradient holds its own heads' part: summed over the group
        for name, p in model.named_parameters():
            if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=tp_group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dist.get_world_size(dp_group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def batches(dp_rank: int, steps: int, seed: int = 7) -> list[torch.Tensor]:
    """Data-parallel replica ``dp_rank``'s (BATCH, SEQ + 1) token rows for each step (tensor-parallel peers read the same)."""
    g = torch.Generator().manual_seed(seed + 1000 * dp_rank)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(steps + 1)]


def master_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (the tensor-parallel slices concatenated along their ``partition_dim``), by name."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().contiguous()
        if size > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t, group=group)
            if _glu(model, name):  # each rank holds [its gate rows; its up rows]: the whole is [every gate; every up]
                halves = [part.chunk(2, dim=0) for part in parts]
                t = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.clone()
    return out


def _glu(model, name: str) -> bool:
    """A gated MLP's first projection (SwiGLU): Megatron splits its gate and its up rows over the ranks separately."""
    return bool(model.config.gated_linear_unit) and "linear_fc1" in name


def load_master(model, weights: dict[str, torch.Tensor]) -> None:
    """This rank's slices of ``weights`` into ``model`` (the inverse of ``master_weights``)."""
    from megatron.core import parallel_state as ps

    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = weights[name]
            if size > 1 and getattr(p, "tensor_model_parallel", False):
                if _glu(model, name):
                    gate, up = w.chunk(2, dim=0)
                    w = torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
                else:
                    w = w.chunk(size, dim=p.partition_dim)[rank]
            p.copy_(w)


# ---- an independent float64 forward of the same weights ------------------------------------------
def eager64(weights: dict[str, torch.Tensor], *, layers: int, heads: int, groups: int, eps: float = 1e-5, other: bool = False):
    """``eager(tokens)`` as tests/independent.py's ``check_record`` reads it: the GPT forward of Megatron's
    local spec written out in float64 from the master weights (LayerNorm, fused QKV laid out per query
    group [q heads of the group, k, v], RoPE on the halves, causal softmax, GELU MLP, the output layer),
    sharing nothing with Megatron or sinkwatch. ``other``: ``build_gpt(other=True)``'s variant: RMSNorm
    (weight only), SwiGLU (``linear_fc1`` = [gate; up], ``silu(gate) * up``), the q and k of each head
    RMS-normed before RoPE, no biases, the output layer tied to the embedding (query-key layer scaling
    cancels: nothing to write)."""
    W = {k: v.double() for k, v in weights.items()}
    emb = W["embedding.word_embeddings.weight"]
    d = emb.shape[1]
    D = d // heads
    per = heads // groups
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))

    def ln(x, name):
        if other:
            w = W[f"{name}.weight"]
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        return torch.nn.functional.layer_norm(x, (d,), W[f"{name}.weight"], W[f"{name}.bias"], eps)

    def mlp(x, p):
        h = lin(x, f"{p}.mlp.linear_fc1")
        if other:
            gate, up = h.chunk(2, dim=-1)
            return lin(torch.nn.functional.silu(gate) * up, f"{p}.mlp.linear_fc2")
        return lin(torch.nn.functional.gelu(h), f"{p}.mlp.linear_fc2")

    def lin(x, name):
        b = W.get(f"{name}.bias")
        return x @ W[f"{name}.weight"].T + (0 if b is None else b)

    def rope(x):  # (N, S, h, D)
        S = x.shape[1]
        f = torch.outer(torch.arange(S, dtype=torch.float64), inv)
        f = torch.cat((f, f), dim=-1)[None, :, None, :]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * torch.cos(f) + torch.cat((-x2, x1), dim=-1) * torch.sin(f)

    def run(tokens: torch.Tensor) -> dict:
        N, S = tokens.shape
        x = emb[tokens]
        first = x.clone()
        attn, resid, oproj, wa, wm = [], [], [], [], []
        mask = torch.ones(S, S, dtype=torch.bool).triu(1)
        for l in range(layers):
            p = f"decoder.layers.{l}"
            qkv = lin(ln(x, f"{p}.input_layernorm"), f"{p}.self_attention.linear_qkv").view(N, S, groups, (per + 2) * D)
            q = qkv[..., : per * D].reshape(N, S, heads, D)
            k = qkv[..., per * D : (per + 1) * D]
            v = qkv[..., (per + 1) * D :]
            if other:  # QK layer norm: each head's q and k RMS-normed over its D, before RoPE
                q, k = ln(q, f"{p}.self_attention.q_layernorm"), ln(k, f"{p}.self_attention.k_layernorm")
            q, k = rope(q), rope(k)
            k, v = k.repeat_interleave(per, dim=2), v.repeat_interleave(per, dim=2)
            scores = torch.einsum("nshd,nthd->nhst", q, k) / math.sqrt(D)
            probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
            ctx = torch.einsum("nhst,nthd->nshd", probs, v).reshape(N, S, heads * D)
            a = lin(ctx, f"{p}.self_attention.linear_proj")
            x = x + a
            m = mlp(ln(x, f"{p}.pre_mlp_layernorm"), p)
            x = x + m
            attn.append(probs)
            resid.append(x)
            oproj.append(ctx)
            wa.append(a)
            wm.append(m)
        logits = ln(x, "decoder.final_layernorm") @ W.get("output_layer.weight", emb).T  # tied when it has none of its own
        stack = lambda xs: torch.stack(xs, dim=1).numpy()  # noqa: E731
        return {
            "attn": stack(attn), "resid": stack(resid), "oproj": stack(oproj), "logits": logits.numpy(), "emb": first.numpy(),
            "written": {"attention": stack(wa), "mlp": stack(wm)},
        }  # fmt: skip

    return run


class ProbeSets:
    """What ``independent.check_record`` reads off a monitor: its probe sets and stage thresholds."""

    def __init__(self, sets, config):
        self.sets, self.config = sets, config

    def probe_sets(self, vocab: int):
        return self.sets


def numbers(record: dict) -> dict:
    """A record's values that describe the weights (not how, where or when they were probed)."""
    skip = {"probe_seconds", "probe_split", "tensor_parallel", "versions", "device", "step", "tokens", "tracker_since_step"}
    skip.add("natural_probe")  # what the frozen windows hold: a record of explicit probe sets has none
    return {k: v for k, v in record.items() if k not in skip}


def as_array(v):
    return np.asarray(v, dtype=float)
