"""Generated attention_stats problems shared by the kernel tests (PyTorch path and Triton)."""

from __future__ import annotations

import math

import torch

# Named tolerances: both sides read the same (possibly low-precision) inputs, so errors are
# float32 accumulation only; the reference works in float64.
LSE_ATOL = 2e-5
ENTROPY_ATOL = 2e-5
PROB_ATOL = 2e-6
REFERENCE_RTOL = 1e-5  # on top of each atol, relative to the reference value

# Triton against the chunked PyTorch path: two float32 accumulations in different orders
TRITON_VS_TORCH_ATOL = 3e-5
TRITON_VS_TORCH_RTOL = 1e-4
TRITON_VS_TORCH_ATOL_LONG = 5e-5  # bf16 inputs at S = 1000 .. 4096 (GPU): longer sums drift further


# The output's tolerance, as a share of max |v| (a row of the output is a convex combination of v's
# rows): float32 accumulation for float32 inputs; one rounding to the dtype for 16-bit outputs.
OUTPUT_RTOL = {torch.float32: 2e-6, torch.float16: 2 * 2**-11, torch.bfloat16: 2 * 2**-8}


def values(k: torch.Tensor, Dv: int, seed: int) -> torch.Tensor:
    """v (B, Hkv, S, Dv) beside k, in the (B, S, H, D) layout models produce, transposed."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, S, _ = k.shape
    return torch.randn(B, S, Hkv, Dv, generator=g).to(k.dtype).transpose(1, 2)


def assert_output_close(got, ref, v: torch.Tensor):
    """A fused pass's output and lse (``AttentionOutput``) within the named tolerances of the float64 reference's."""
    assert got.output.dtype == v.dtype and got.lse.dtype == torch.float32
    assert got.output.shape == ref.output.shape and got.lse.shape == ref.lse.shape
    scale = float(v.abs().max()) if v.numel() else 1.0
    err = float((got.output.double() - ref.output).abs().max()) if v.numel() else 0.0
    assert err <= OUTPUT_RTOL[v.dtype] * scale, f"output off by {err:.3g} (max |v| {scale:.3g})"
    lse_err = (got.lse.double() - ref.lse).abs()
    assert bool((lse_err <= LSE_ATOL + 1e-5 * ref.lse.abs()).all()), f"lse off by {float(lse_err.max()):.3g}"


def case_id(B: int, S: int, H: int, D: int, *extra) -> str:
    """Readable parametrize ids in the flash-linear-attention style: ``B1-S64-H2-D128-...``."""
    return "-".join([f"B{B}-S{S}-H{H}-D{D}", *(str(e).replace("torch.", "") for e in extra)])


def make_inputs(B, Hq, Hkv, S, D, *, dtype=torch.float32, layout="contiguous", seed=0, scale=1.0, device="cpu"):
    """q (B, Hq, S, D), k (B, Hkv, S, D) with the requested memory layout.

    layout: "contiguous"; "bshd" (a transposed (B, S, H, D) buffer, as models produce);
    "sliced" (every other element of a wider head dim, inner stride 2).
    """
    g = torch.Generator().manual_seed(seed)

    def one(H):
        if layout == "bshd":
            return (torch.randn(B, S, H, D, generator=g) * scale).to(dtype).transpose(1, 2)
        if layout == "sliced":
            return (torch.randn(B, H, S, 2 * D, generator=g) * scale).to(dtype)[..., ::2]
        return (torch.randn(B, H, S, D, generator=g) * scale).to(dtype)

    q, k = one(Hq), one(Hkv)
    return q.to(device), k.to(device)


def sink_logits(Hq: int, S: int, seed: int) -> torch.Tensor:
    """Learned sink logits of real size, one per query head: around log S (where the sink takes about as
    much as all keys together, as trained gpt-oss sinks do) and from far below to far above it."""
    g = torch.Generator().manual_seed(seed)
    return math.log(max(S, 2)) + 4.0 * torch.randn(Hq, generator=g, dtype=torch.float64)


def assert_close_to_reference(got, ref):
    """Every output cell written, finite, and within the named tolerances of the float64 reference."""
    for name, a, b, atol in (
        ("lse", got.lse, ref.lse, LSE_ATOL),
        ("entropy", got.entropy, ref.entropy, ENTROPY_ATOL),
        ("first", got.first, ref.first, PROB_ATOL),
        ("gathered", got.gathered, ref.gathered, PROB_ATOL),
    ):
        assert a.dtype == torch.float32, name
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert not torch.isnan(a).any(), f"{name}: unwritten (NaN) cells"
        a64 = a.double().cpu()
        err = (a64 - b.cpu()).abs()
        tol = atol + REFERENCE_RTOL * b.cpu().abs()
        assert (err <= tol).all(), f"{name}: max error {float(err.max()):.3g} (atol {atol})"
