"""The chunked PyTorch backend of attention_stats against the float64 materialising reference."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import assert_close_to_reference, make_inputs, sink_logits

from sinkwatch import attention_stats
from sinkwatch.kernels.contract import validate
from sinkwatch.kernels.reference import attention_stats_reference
from sinkwatch.kernels.torch_chunked import attention_stats_torch


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 2, 4]))
    S = draw(st.one_of(st.just(1), st.integers(2, 70)))
    D = draw(st.sampled_from([4, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    layout = draw(st.sampled_from(["contiguous", "bshd", "sliced"]))
    q, k = make_inputs(
        B,
        Hkv * groups,
        Hkv,
        S,
        D,
        dtype=dtype,
        layout=layout,
        seed=draw(st.integers(0, 2**16)),
        scale=draw(st.sampled_from([0.5, 1.0, 3.0])),
    )
    rows = None
    if draw(st.booleans()):
        Q = draw(st.integers(1, 6))
        rows = torch.tensor(draw(st.lists(st.lists(st.integers(0, S - 1), min_size=Q, max_size=Q), min_size=B, max_size=B)))
    Q = S if rows is None else rows.shape[1]
    cols = None
    if draw(st.booleans()):
        G = draw(st.integers(1, 5))
        # -1 (none), any key position (including ones after the query)
        cols = torch.tensor(
            draw(
                st.lists(st.lists(st.lists(st.integers(-1, S - 1), min_size=G, max_size=G), min_size=Q, max_size=Q), min_size=B, max_size=B)
            )
        )
    n_first = draw(st.integers(0, S + 3))  # n_first > S included
    window = draw(st.one_of(st.none(), st.integers(1, S + 2)))
    softcap = draw(st.one_of(st.none(), st.sampled_from([2.0, 30.0])))
    block = draw(st.sampled_from([1, 7, 64, 1000, 1 << 21]))  # forces S not a multiple of the block
    scaling = 1.0 / math.sqrt(D)
    sinks = None  # learned sink logits: none, real-sized ones, or extremes (-inf takes nothing, 60 takes nearly all)
    kind = draw(st.sampled_from(["none", "none", "real", "extreme"]))
    if kind == "real":
        sinks = sink_logits(Hkv * groups, S, draw(st.integers(0, 2**16))).float()
    elif kind == "extreme":
        sinks = torch.tensor(draw(st.lists(st.sampled_from([-math.inf, -60.0, 0.0, 60.0]), min_size=Hkv * groups, max_size=Hkv * groups)))
    kw = dict(q=q, k=k, scaling=scaling, rows=rows, cols=cols, n_first=n_first, window=window, softcap=softcap, sinks=sinks)
    return kw, block


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problems())
def test_torch_path_matches_float64_reference(case):
    """Generated problems: the chunked PyTorch path equals the float64 reference within the named tolerances."""
    kw, block = case
    problem = validate(**kw)
    got = attention_stats_torch(problem, block_elements=block)
    ref = attention_stats_reference(problem)
    assert_close_to_reference(got, ref)


def test_a_learned_sink_joins_every_row():
    """With sink logits the keys' probabilities plus the sink's, exp(s - lse), sum to 1 in every row,
    the entropy is that of the widened row, and a sink of -inf changes nothing."""
    q, k = make_inputs(2, 4, 2, 9, 8, seed=3)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 6.0])
    out = attention_stats(q, k, 0.3, n_first=12, sinks=sinks, backend="torch")
    sink_p = torch.exp(sinks[None, :, None] - out.lse)  # (B, Hq, Q)
    assert torch.allclose(out.first.sum(-1) + sink_p, torch.ones(2, 4, 9), atol=1e-6)
    assert (sink_p[:, 3] > 0.5).all()  # a sink far above the keys takes most of every row
    p = torch.cat([out.first[..., :9], sink_p[..., None]], dim=-1)
    widened = -(torch.special.xlogy(p, p)).sum(-1)  # masked future keys: 0 log 0 = 0
    assert torch.allclose(out.entropy, widened, atol=1e-5)
    plain = attention_stats(q, k, 0.3, n_first=12, backend="torch")
    none = attention_stats(q, k, 0.3, n_first=12, sinks=torch.full((4,), -math.inf), backend="torch")
    for a, b in zip(plain, none):
        assert torch.equal(a, b)


def test_probabilities_are_consistent_with_lse():
    """first/gathered equal exp(s - lse) and a full row of first sums to 1 when n_first >= S."""
    q, k = make_inputs(2, 4, 2, 9, 8, seed=3)
    out = attention_stats(q, k, 0.3, n_first=12, backend="torch")
    assert torch.allclose(out.first.sum(-1), torch.ones(2, 4, 9), atol=1e-6)
    assert (out.first[..., 9:] == 0).all()
    # probability on future keys is exactly zero
    future = torch.triu(torch.ones(9, 12, dtype=torch.bool), diagonal=1)
    assert (out.first[..., future] == 0).all()


def test_auto_backend_on_cpu_is_the_torch_path():
    """backend='auto' on CPU tensors gives the torch path's outputs exactly."""
    q, k = make_inputs(1, 2, 1, 33, 8, seed=1)
    a = attention_stats(q, k, 0.25)
    b = attention_stats(q, k, 0.25, backend="torch")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_resolve_backend_names_what_auto_runs():
    """resolve_backend names the backend auto runs per device type; unknown names are refused."""
    from sinkwatch.kernels import resolve_backend

    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "triton"  # by device type; no GPU needed
    assert resolve_backend("reference", "cuda") == "reference"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("flash", "cpu")


def test_memory_is_bounded_by_the_block_not_s_squared():
    """A long sequence runs with a block budget far below B*H*S*S (would be 4 GiB here)."""
    q, k = make_inputs(1, 4, 4, 16384, 16, seed=0)
    out = attention_stats(q, k, 0.25, rows=torch.tensor([[16383, 5]]), cols=torch.tensor([[[0, 1], [0, 6]]]), backend="torch")
    assert out.gathered[0, :, 1, 1].eq(0).all()  # key 6 is after query 5
    assert torch.isfinite(out.lse).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(q=torch.zeros(2, 4, 8), k=torch.zeros(2, 4, 8)), "4-D"),
        (dict(q=torch.zeros(1, 3, 8, 4), k=torch.zeros(1, 2, 8, 4)), "multiple"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 7, 4)), "repeat_kv"),
        (dict(q=torch.zeros(1, 2, 8, 4, dtype=torch.int32), k=torch.zeros(1, 2, 8, 4)), "float32"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 8, 4), rows=torch.tensor([[8]])), "rows"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 8, 4), rows=torch.tensor([[1.0]])), "integer"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 8, 4), cols=torch.zeros(1, 8, 2, dtype=torch.long) - 2), "-1"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 8, 4), cols=torch.zeros(1, 3, 2, dtype=torch.long)), "(B, Q, G)"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 8, 4), window=0), "window"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 8, 4), n_first=-1), "n_first"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 8, 4), softcap=-1.0), "softcap"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 8, 4), backend="cuda"), "backend"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 8, 4), sinks=torch.zeros(3)), "one logit per query head"),
        (dict(q=torch.zeros(1, 2, 8, 4), k=torch.zeros(1, 2, 8, 4), sinks=[0.0, 1.0]), "sinks must be a float"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, message):
    """Each malformed argument gets a ValueError or TypeError that names it."""
    kwargs = {"scaling": 0.5, **kwargs}
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        attention_stats(**kwargs)


def test_a_non_tensor_q_is_a_type_error():
    """Arguments are validated before the backend is chosen: a list q is a TypeError, not an AttributeError."""
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        attention_stats([[0.0]], torch.zeros(1, 2, 8, 4), 0.5)


def test_the_dtype_message_names_every_accepted_dtype():
    """float64 is accepted, and the message for a rejected dtype says so."""
    q, k = make_inputs(1, 2, 2, 8, 4, dtype=torch.float64)
    assert torch.isfinite(attention_stats(q, k, 0.5).lse).all()
    with pytest.raises(TypeError, match="float32/float16/bfloat16/float64"):
        attention_stats(q.to(torch.int32), k, 0.5)
