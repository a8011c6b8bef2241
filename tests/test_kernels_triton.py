"""The Triton kernel against the float64 reference and the PyTorch path.

Without CUDA these run on CPU tensors through the Triton interpreter (TRITON_INTERPRET=1 is set
here, before the kernel module is imported); with CUDA the same cases run compiled, plus
realistic shapes.
"""

import functools
import itertools
import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # conftest sets it before anything imports triton; this is for direct runs

triton = pytest.importorskip("triton")

from kernel_cases import (  # noqa: E402
    TRITON_VS_TORCH_ATOL,
    TRITON_VS_TORCH_ATOL_LONG,
    TRITON_VS_TORCH_RTOL,
    assert_close_to_reference,
    assert_output_close,
    case_id,
    make_inputs,
    sink_logits,
    values,
)

from sinkwatch import attention_stats  # noqa: E402
from sinkwatch.kernels import attention_output  # noqa: E402
from sinkwatch.kernels.api import output_tolerance  # noqa: E402
from sinkwatch.kernels.triton_aot import compiler_env  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA:
    import sinkwatch.kernels.triton_stats as _ts  # noqa: E402

    if not _ts._INTERPRET:  # imported earlier in this process without the interpreter
        pytest.skip("the Triton kernel module was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)


SEQS = (1, 7, 64, 129, 300)
DIMS = (64, 128, 256)
GROUPS = (1, 2, 4)
VARIANTS = ("all_rows", "rows_cols", "window_softcap")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("contiguous", "bshd", "sliced")

# 45 cases: every (S, head dim) pair, each variant, with groups, dtypes and layouts cycling through.
CASES = [
    (S, D, GROUPS[i % 3], variant, DTYPES[i % 3], LAYOUTS[(i // 3) % 3])
    for i, (S, D, variant) in enumerate(itertools.product(SEQS, DIMS, VARIANTS))
]
CASE_IDS = [case_id(1, S, groups, D, variant, dtype, layout) for S, D, groups, variant, dtype, layout in CASES]


def variant_kwargs(variant, B, S, seed):
    g = torch.Generator().manual_seed(seed)
    if variant == "all_rows":
        return dict(n_first=S + 3)  # n_first > S
    if variant == "rows_cols":
        Q, G = 3, 4
        rows = torch.randint(0, S, (B, Q), generator=g)
        cols = torch.randint(-1, S, (B, Q, G), generator=g)  # -1 and positions after the query
        cols[:, :, 0] = -1
        cols[:, :, 1] = rows  # the query itself (self)
        return dict(rows=rows.to(DEVICE), cols=cols.to(DEVICE), n_first=8)
    return dict(window=max(1, S // 3), softcap=5.0, n_first=4)


def _on_cpu(kw: dict) -> dict:
    return {name: (v.cpu() if torch.is_tensor(v) else v) for name, v in kw.items()}


@functools.cache
def _case(S, D, groups, variant, dtype, layout):
    """(q, k, kwargs, Triton outputs) of one case, computed once for the tests that compare them."""
    B, Hkv = 1, 1
    q, k = make_inputs(B, Hkv * groups, Hkv, S, D, dtype=dtype, layout=layout, seed=S * D + groups, device=DEVICE)
    kw = variant_kwargs(variant, B, S, seed=S + D)
    return q, k, kw, attention_stats(q, k, D**-0.5, backend="triton", **kw)  # outputs pre-filled with NaN


@pytest.mark.parametrize("S, D, groups, variant, dtype, layout", CASES, ids=CASE_IDS)
def test_triton_matches_reference(S, D, groups, variant, dtype, layout):
    """Every cell the kernel writes is within the named tolerances of the float64 reference."""
    q, k, kw, tri = _case(S, D, groups, variant, dtype, layout)
    ref = attention_stats(q.cpu(), k.cpu(), D**-0.5, backend="reference", **_on_cpu(kw))
    assert_close_to_reference(tri, ref)


@pytest.mark.parametrize("S, D, groups, variant, dtype, layout", CASES, ids=CASE_IDS)
def test_triton_matches_torch(S, D, groups, variant, dtype, layout):
    """The kernel and the chunked PyTorch path agree on every output."""
    q, k, kw, tri = _case(S, D, groups, variant, dtype, layout)
    tor = attention_stats(q, k, D**-0.5, backend="torch", **kw)
    for a, b in zip(tri, tor):
        torch.testing.assert_close(a, b, atol=TRITON_VS_TORCH_ATOL, rtol=TRITON_VS_TORCH_RTOL)


# Learned sink logits (gpt-oss, OLMo-core) over the same awkward shapes, S <= 129 (the S = 300
# cases cost most of the interpreter's time and add no sink-specific path): the kernel sees keys
# only and the sink is folded in through each row's lse, while the reference materialises it.
SINK_CASES = [c for c in CASES if c[0] <= 129]
SINK_IDS = [case_id(1, S, groups, D, variant, dtype, layout, "sinks") for S, D, groups, variant, dtype, layout in SINK_CASES]


@pytest.mark.parametrize("S, D, groups, variant, dtype, layout", SINK_CASES, ids=SINK_IDS)
def test_triton_with_sinks_matches_reference_and_torch(S, D, groups, variant, dtype, layout):
    """With learned sink logits the kernel equals the float64 reference (sink column materialised) and the torch path."""
    q, k = make_inputs(1, groups, 1, S, D, dtype=dtype, layout=layout, seed=S * D + groups, device=DEVICE)
    kw = {**variant_kwargs(variant, 1, S, seed=S + D), "sinks": sink_logits(groups, S, seed=S + D).float().to(DEVICE)}
    tri = attention_stats(q, k, D**-0.5, backend="triton", **kw)
    ref = attention_stats(q.cpu(), k.cpu(), D**-0.5, backend="reference", **_on_cpu(kw))
    assert_close_to_reference(tri, ref)
    tor = attention_stats(q, k, D**-0.5, backend="torch", **kw)
    for a, b in zip(tri, tor):
        torch.testing.assert_close(a, b, atol=TRITON_VS_TORCH_ATOL, rtol=TRITON_VS_TORCH_RTOL)


@pytest.mark.parametrize("D", (40, 80, 96))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_head_dims_that_are_not_powers_of_two(D, dtype):
    # BLOCK_D rounds up (64/128): the tail of the head dim is masked, both when q is held whole
    # (16-bit inputs) and when it is re-read in 32-wide chunks (float32 inputs)
    """Head dims 40/80/96: the masked tail of the head dim matches the reference."""
    q, k = make_inputs(1, 2, 1, 37, D, dtype=dtype, layout="sliced", seed=D, device=DEVICE)
    kw = variant_kwargs("rows_cols", 1, 37, seed=D)
    tri = attention_stats(q, k, D**-0.5, backend="triton", **kw)
    ref = attention_stats(q.cpu(), k.cpu(), D**-0.5, backend="reference", **_on_cpu(kw))
    assert_close_to_reference(tri, ref)


def test_gqa_reads_the_right_kv_head():
    """Query heads read their own kv head under GQA."""
    q, k = make_inputs(2, 4, 2, 33, 64, seed=9, device=DEVICE)
    k[:, 1] *= 3.0  # kv heads differ strongly
    tri = attention_stats(q, k, 0.125, backend="triton")
    ref = attention_stats(q.cpu(), k.cpu(), 0.125, backend="reference")
    assert_close_to_reference(tri, ref)


def test_import_never_touches_a_gpu_driver():
    """Importing the kernel module needs no GPU driver."""
    code = "import os; os.environ.pop('TRITON_INTERPRET', None); import sinkwatch.kernels.triton_stats; print('ok')"
    env = compiler_env()
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# Triton on CPU tensors without the interpreter: a real launch failure, which attention_stats answers
# by falling back to the torch path once (tests/test_kernel_fallback.py).


# ---- realistic shapes, GPU only ---------------------------------------------------------------------
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


REALISTIC = [(1024, 128, 16, 16), (2048, 64, 12, 12), (2048, 256, 8, 8), (4096, 128, 32, 8), (1000, 128, 8, 2)]
REALISTIC_IDS = [case_id(2, S, Hq, D, f"KV{Hkv}") for S, D, Hq, Hkv in REALISTIC]


def _realistic(S, D, Hq, Hkv):
    q, k = make_inputs(2, Hq, Hkv, S, D, dtype=torch.bfloat16, layout="bshd", seed=1, device="cuda")
    rows = torch.stack([torch.arange(S - 8, S), torch.arange(0, 8)]).cuda()
    cols = torch.randint(-1, S, (2, 8, 60), device="cuda")
    return q, k, rows, cols


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("S, D, Hq, Hkv", REALISTIC, ids=REALISTIC_IDS)
def test_gpu_auto_is_the_triton_kernel(S, D, Hq, Hkv):
    """On CUDA tensors backend="auto" runs the Triton kernel: bit-identical outputs."""
    q, k, rows, cols = _realistic(S, D, Hq, Hkv)
    auto = attention_stats(q, k, D**-0.5, rows=rows, cols=cols)
    tri = attention_stats(q, k, D**-0.5, rows=rows, cols=cols, backend="triton")
    for a, b in zip(auto, tri):
        assert torch.equal(a, b)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("S, D, Hq, Hkv", REALISTIC, ids=REALISTIC_IDS)
def test_gpu_realistic_shapes_bf16_match_reference(S, D, Hq, Hkv):
    """Chosen rows and columns at realistic shapes within the named tolerances of the float64 reference."""
    q, k, rows, cols = _realistic(S, D, Hq, Hkv)
    tri = attention_stats(q, k, D**-0.5, rows=rows, cols=cols, backend="triton")
    ref = attention_stats(q.cpu(), k.cpu(), D**-0.5, rows=rows.cpu(), cols=cols.cpu(), backend="reference")
    assert_close_to_reference(tri, ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("S, D, Hq, Hkv", REALISTIC, ids=REALISTIC_IDS)
def test_gpu_realistic_shapes_bf16_match_torch(S, D, Hq, Hkv):
    """Every row at realistic shapes: the kernel and the PyTorch path agree."""
    q, k, _, _ = _realistic(S, D, Hq, Hkv)
    full = attention_stats(q, k, D**-0.5, backend="triton")
    tor = attention_stats(q, k, D**-0.5, backend="torch")
    for a, b in zip(full, tor):
        torch.testing.assert_close(a, b, atol=TRITON_VS_TORCH_ATOL_LONG, rtol=TRITON_VS_TORCH_RTOL)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("S, D, Hq, Hkv", REALISTIC[:2], ids=REALISTIC_IDS[:2])
def test_gpu_realistic_shapes_with_sinks_match_reference(S, D, Hq, Hkv):
    """Learned sink logits at realistic bf16 shapes: the kernel plus the lse fold equal the reference's sink column."""
    q, k, rows, cols = _realistic(S, D, Hq, Hkv)
    sinks = sink_logits(Hq, S, seed=S).float().cuda()
    tri = attention_stats(q, k, D**-0.5, rows=rows, cols=cols, sinks=sinks, backend="triton")
    ref = attention_stats(q.cpu(), k.cpu(), D**-0.5, rows=rows.cpu(), cols=cols.cpu(), sinks=sinks.cpu(), backend="reference")
    assert_close_to_reference(tri, ref)


@gpu
@pytest.mark.gpu
def test_gpu_no_allocation_grows_with_s_squared():
    """Peak GPU memory grows with S, not S squared."""
    torch.cuda.synchronize()
    peaks = []
    for S in (2048, 8192):
        q, k = make_inputs(1, 16, 16, S, 128, dtype=torch.bfloat16, seed=0, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        attention_stats(q, k, 128**-0.5, backend="triton")
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[1] < 8 * peaks[0]  # 4x longer: outputs grow 4x; S^2 would be 16x


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("D", (64, 256))
def test_gpu_float32_inputs_use_the_exact_product(D):
    # float32 takes the chunked FMA product (no TF32): parity with float64 at the CPU tolerances
    """float32 inputs on GPU match the float64 reference at the CPU tolerances (no TF32)."""
    q, k = make_inputs(2, 8, 4, 1500, D, dtype=torch.float32, layout="bshd", seed=D, device="cuda")
    rows = torch.stack([torch.arange(1490, 1500), torch.arange(0, 10)]).cuda()
    cols = torch.randint(-1, 1500, (2, 10, 7), device="cuda")
    tri = attention_stats(q, k, D**-0.5, rows=rows, cols=cols, backend="triton")
    ref = attention_stats(q.cpu(), k.cpu(), D**-0.5, rows=rows.cpu(), cols=cols.cpu(), backend="reference")
    assert_close_to_reference(tri, ref)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_launch_follows_the_tensors_device_not_the_current_one():
    """Tensors on cuda:1 while cuda:0 is current: the launch follows the tensors (torch.cuda.device guard)."""
    # Triton launches on the current device; tensors on cuda:1 while cuda:0 is current would be read
    # through the wrong context without the kernel's torch.cuda.device guard
    torch.cuda.set_device(0)
    q, k = make_inputs(1, 8, 4, 512, 64, dtype=torch.bfloat16, seed=5, device="cuda:1")
    tri = attention_stats(q, k, 64**-0.5, backend="triton")
    assert all(t.device == torch.device("cuda:1") for t in tri)
    ref = attention_stats(q.cpu(), k.cpu(), 64**-0.5, backend="reference")
    assert_close_to_reference(tri, ref)


# ---- the fused-output kernel (triton_fused.py): output and lse against the float64 reference ---------
FUSED_CASES = [  # (S, D, Dv, groups, variant, dtype)
    (1, 64, 64, 1, "plain", torch.float32),
    (64, 64, 64, 2, "plain", torch.bfloat16),
    (129, 128, 128, 4, "window_softcap", torch.float32),
    (70, 40, 40, 2, "sinks", torch.float16),
    (100, 64, 32, 1, "plain", torch.float32),
]
FUSED_IDS = [case_id(2, S, g, D, f"Dv{Dv}", variant, dtype) for S, D, Dv, g, variant, dtype in FUSED_CASES]


@pytest.mark.parametrize("S, D, Dv, groups, variant, dtype", FUSED_CASES, ids=FUSED_IDS)
def test_fused_kernel_matches_reference_and_torch(S, D, Dv, groups, variant, dtype):
    """The fused kernel's output and lse equal the float64 reference (tests/test_kernels_fused.py's
    tolerances) and the PyTorch path's fused pass; statistics read off its lse equal the reference."""
    q, k = make_inputs(2, 2 * groups, 2, S, D, dtype=dtype, layout="bshd", seed=S + D, device=DEVICE)
    v = values(k.cpu(), Dv, S).to(DEVICE)
    kw = dict(window=max(1, S // 3), softcap=5.0) if variant == "window_softcap" else {}
    if variant == "sinks":
        kw["sinks"] = sink_logits(2 * groups, S, seed=S).float().to(DEVICE)
    tri = attention_output(q, k, v, D**-0.5, backend="triton", **kw)
    assert tri.backend == "triton"
    ref = attention_output(q.cpu(), k.cpu(), v.cpu(), D**-0.5, backend="reference", **_on_cpu(kw))
    assert_output_close(tri._replace(output=tri.output.cpu(), lse=tri.lse.cpu()), ref, v.cpu())
    tor = attention_output(q, k, v, D**-0.5, backend="torch", **kw)
    torch.testing.assert_close(tri.lse, tor.lse, atol=TRITON_VS_TORCH_ATOL, rtol=TRITON_VS_TORCH_RTOL)
    rows = torch.tensor([[S - 1, 0], [S // 2, S - 1]], device=DEVICE)
    cols = torch.tensor([[[0, S - 1]], [[S // 3, -1]]], device=DEVICE).expand(2, 2, 2).contiguous()
    got = attention_stats(q, k, D**-0.5, rows=rows, cols=cols, n_first=3, fused=tri, backend="triton", **kw)
    want = attention_stats(q.cpu(), k.cpu(), D**-0.5, rows=rows.cpu(), cols=cols.cpu(), n_first=3, backend="reference", **_on_cpu(kw))
    assert_close_to_reference(got, want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("S, D, Hq, Hkv", REALISTIC[1:4], ids=REALISTIC_IDS[1:4])
def test_gpu_fused_kernel_at_realistic_shapes(S, D, Hq, Hkv):
    """The fused kernel compiled, bf16, realistic shapes: its output within the bf16 tolerance of
    flash attention's (what the model's own attention gives), every row's lse within the PyTorch
    path's, and statistics read off that lse within the float64 reference's on chosen rows."""
    import torch.nn.functional as F

    q, k, rows, cols = _realistic(S, D, Hq, Hkv)
    v = make_inputs(2, Hkv, Hkv, S, D, dtype=torch.bfloat16, layout="bshd", seed=2, device="cuda")[0]
    tri = attention_output(q, k, v, D**-0.5, backend="triton")
    assert tri.backend == "triton"
    kr, vr = (x.repeat_interleave(Hq // Hkv, dim=1) for x in (k, v))
    own = F.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=D**-0.5)  # (B, Hq, S, D)
    err = float((tri.output.double() - own.double()).abs().max())
    # the tolerance a probe holds sinkwatch's output to against the model's own on its first call
    assert err <= output_tolerance(torch.bfloat16) * float(v.abs().max()), f"fused output off flash attention's by {err:.3g}"
    tor = attention_stats(q, k, D**-0.5, backend="torch")
    torch.testing.assert_close(tri.lse, tor.lse, atol=TRITON_VS_TORCH_ATOL_LONG, rtol=TRITON_VS_TORCH_RTOL)
    got = attention_stats(q, k, D**-0.5, rows=rows, cols=cols, fused=tri, backend="triton")
    ref = attention_stats(q.cpu(), k.cpu(), D**-0.5, rows=rows.cpu(), cols=cols.cpu(), backend="reference")
    assert_close_to_reference(got, ref)
