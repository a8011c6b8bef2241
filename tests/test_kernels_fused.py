"""The fused pass (``attention_output``) and the statistics read off its lse, against the float64 reference.

The probe's PyTorch path computes the attention output and every row's lse in one pass over the keys
(``kernels/fused_torch.py``); ``attention_stats(..., fused=...)`` then reads ``first``/``gathered``
off that lse. Both are checked here against the materialising float64 reference at the kernel
tests' tolerances (tests/kernel_cases.py), on generated problems with windows, soft-caps, learned
sinks, GQA, 16-bit inputs and strided layouts.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import LSE_ATOL, OUTPUT_RTOL, assert_close_to_reference, assert_output_close, make_inputs, sink_logits, values

from sinkwatch.kernels import attention_output, attention_stats
from sinkwatch.kernels.contract import validate
from sinkwatch.kernels.fused_torch import _chunked, attention_output_torch, flash_applies
from sinkwatch.kernels.torch_chunked import MAX_BLOCK_ELEMENTS, MIN_BLOCK_ELEMENTS, block_budget


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 2, 4]))
    S = draw(st.one_of(st.just(1), st.integers(2, 70)))
    D = draw(st.sampled_from([4, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    layout = draw(st.sampled_from(["contiguous", "bshd", "sliced"]))
    seed = draw(st.integers(0, 2**16))
    q, k = make_inputs(B, Hkv * groups, Hkv, S, D, dtype=dtype, layout=layout, seed=seed, scale=draw(st.sampled_from([0.5, 1.0, 3.0])))
    v = values(k, draw(st.sampled_from([D, 2 * D])), seed + 1)
    window = draw(st.one_of(st.none(), st.integers(1, S + 2)))
    softcap = draw(st.one_of(st.none(), st.sampled_from([2.0, 30.0])))
    kind = draw(st.sampled_from(["none", "none", "real", "extreme"]))
    sinks = None
    if kind == "real":
        sinks = sink_logits(Hkv * groups, S, seed).float()
    elif kind == "extreme":
        sinks = torch.tensor(draw(st.lists(st.sampled_from([-math.inf, -60.0, 0.0, 60.0]), min_size=Hkv * groups, max_size=Hkv * groups)))
    Q = draw(st.integers(1, 6))
    rows = torch.randint(0, S, (B, Q), generator=torch.Generator().manual_seed(seed))
    cols = torch.randint(-1, S, (B, Q, draw(st.integers(1, 5))), generator=torch.Generator().manual_seed(seed + 2))
    block = draw(st.sampled_from([None, 1, 7, 64, 1000]))  # None: the budget; small ones force S across blocks
    kw = dict(scaling=1.0 / math.sqrt(D), window=window, softcap=softcap, sinks=sinks)
    return q, k, v, kw, rows, cols, block


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problems())
def test_fused_pass_and_its_statistics_match_float64_reference(case):
    """Output and lse of the fused pass, and every statistic read off its lse (all rows with the first
    keys; chosen rows with gathered columns), equal the float64 reference at the kernel tolerances."""
    q, k, v, kw, rows, cols, block = case
    problem = validate(q, k, kw["scaling"], None, None, 0, kw["window"], kw["softcap"], kw["sinks"])
    fused = attention_output_torch(problem, v, block)
    assert fused.backend == "torch"
    assert_output_close(fused, attention_output(q, k, v, backend="reference", **kw), v)
    S = q.shape[2]
    for extra in (dict(n_first=S + 3), dict(rows=rows, cols=cols, n_first=4)):
        got = attention_stats(q, k, fused=fused, backend="torch", **kw, **extra)
        assert_close_to_reference(got, attention_stats(q, k, backend="reference", **kw, **extra))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_both_routes_agree(dtype):
    """The flash route (PyTorch's fused CPU kernel) and the chunked route give the same output and lse."""
    q, k = make_inputs(2, 6, 2, 90, 16, dtype=dtype, layout="bshd", seed=4)
    v = values(k, 16, 5)
    problem = validate(q, k, 0.25, None, None, 0, None, None, None)
    assert flash_applies(problem, v)
    flash = attention_output_torch(problem, v)
    out, lse = _chunked(problem, v, 300)
    tol = OUTPUT_RTOL.get(dtype, 1e-12) * float(v.abs().max())
    assert float((flash.output.double() - out.double()).abs().max()) <= tol
    assert torch.allclose(flash.lse, lse, atol=LSE_ATOL)


def test_routes_by_feature():
    """Soft-caps, real windows and a v head dim unlike q's take the chunked route; a window wider than
    the sequence masks nothing and stays on the flash route."""
    q, k = make_inputs(1, 2, 1, 20, 8)
    v = values(k, 8, 0)

    def applies(v=v, **kw):
        return flash_applies(validate(q, k, 0.3, None, None, 0, kw.get("window"), kw.get("softcap"), None), v)

    assert applies() and applies(window=20) and applies(window=500)
    assert not applies(window=19) and not applies(softcap=5.0) and not applies(v=values(k, 16, 0))


def test_statistics_read_off_the_lse_skip_the_entropy_when_not_asked():
    """entropy=False: NaN, on every path; with a fused pass the other outputs are unchanged."""
    q, k = make_inputs(2, 4, 2, 33, 8, seed=2)
    fused = attention_output(q, k, values(k, 8, 3), 0.3)
    full = attention_stats(q, k, 0.3, fused=fused)
    for kw in (dict(fused=fused), {}, dict(backend="reference")):
        got = attention_stats(q, k, 0.3, entropy=False, **kw)
        assert torch.isnan(got.entropy).all()
        assert torch.allclose(got.first.float(), full.first, atol=2e-6)


def test_a_fused_pass_of_another_backend_is_not_read():
    """Statistics read an lse only from the backend they resolve to, so a record's stats_backend names
    what computed them; the reference never reads one."""
    q, k = make_inputs(1, 2, 1, 17, 8, seed=6)
    fused = attention_output(q, k, values(k, 8, 1), 0.3)
    wrong = fused._replace(lse=fused.lse + 1.0)  # statistics read off it would be off by a factor e
    plain = attention_stats(q, k, 0.3)
    as_triton = attention_stats(q, k, 0.3, fused=wrong._replace(backend="triton"), backend="torch")
    for a, b in zip(plain, as_triton):
        assert torch.equal(a, b)
    assert not torch.allclose(attention_stats(q, k, 0.3, fused=wrong).first, plain.first)  # read when it is the torch path's
    ref = attention_stats(q, k, 0.3, backend="reference")
    assert torch.equal(attention_stats(q, k, 0.3, fused=wrong._replace(backend="reference"), backend="reference").first, ref.first)


def test_bad_fused_arguments_get_clear_errors():
    q, k = make_inputs(1, 2, 1, 9, 8)
    v = values(k, 8, 0)
    with pytest.raises(ValueError, match="v must be"):
        attention_output(q, k, v[:, :, :5], 0.3)
    with pytest.raises(TypeError, match="AttentionOutput"):
        attention_stats(q, k, 0.3, fused=(v, v))
    other = attention_output(q[:, :, :5], k[:, :, :5], v[:, :, :5], 0.3)
    with pytest.raises(ValueError, match="not every row"):
        attention_stats(q, k, 0.3, fused=other)


def test_the_block_budget_follows_q():
    """Blocks hold as many logits as q has elements, within the bounds; a sliding window keeps a long
    sequence's pass to O(S x window) keys (S^2 logits here would be 4 GiB)."""
    assert block_budget(torch.empty(1, 1, 1, 8)) == MIN_BLOCK_ELEMENTS
    assert block_budget(torch.empty(1, 9, 2048, 64)) == 9 * 2048 * 64
    assert block_budget(torch.empty(8, 32, 4096, 128)) == MAX_BLOCK_ELEMENTS
    q, k = make_inputs(1, 4, 4, 16384, 16, seed=0)
    v = values(k, 16, 0)
    out = attention_output(q, k, v, 0.25, window=32, softcap=30.0)
    assert torch.isfinite(out.output).all() and torch.isfinite(out.lse).all()
    tail = [x[:, :, -40:].contiguous() for x in (q, k, v)]
    ref = attention_output(*tail, 0.25, window=32, softcap=30.0)
    assert torch.allclose(out.output[:, :, -1], ref.output[:, :, -1], atol=1e-5)  # the last row sees its window only
