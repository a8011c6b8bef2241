"""torchtitan 0.3.0 capture (issue 27): on torchtitan's own debug models (llama3: MHA, the scale the layer
leaves to FlexAttention; qwen3: GQA, QK-norm, an explicit head_dim scale), built by its model registry,
every record key equals an independent float64 computation from explicit attention weights.

FlexAttention runs eagerly here (``flex_attention`` uncompiled, in both runs): its ``torch.compile``d
kernel takes ~45 s per shape to build on this CPU, and has no backward on CPU at all."""

import math

import independent as ind
import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan")

from sinkwatch import InductionProbe, Monitor, MonitorConfig, NaturalProbe, RepeatedRandomProbe  # noqa: E402
from sinkwatch.capture import TorchtitanTarget, UnsupportedModelError, resolve_target  # noqa: E402

PROB_ATOL, RATIO_RTOL, RATIO_ATOL, LOSS_ATOL = 2e-5, 1e-4, 1e-6, 1e-4


@pytest.fixture(autouse=True)
def eager_flex(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", staticmethod(flex_attention))


def debug_model(family: str, seed: int = 0, **shrink):
    if family == "llama3":
        from torchtitan.models.llama3 import model_registry
    else:
        from torchtitan.models.qwen3 import model_registry
    config = model_registry("debugmodel", attn_backend="flex").model
    config.layers = config.layers[:2]  # two of its layers: the same blocks, a shorter test
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    with torch.no_grad():  # sharper queries than the init: attention far from uniform, so the checks bite
        for layer in model.layers.values():
            for p in layer.attention.qkv_linear.parameters():
                p.mul_(4.0)
    return model.eval()


def eager_run(model, tokens: torch.Tensor) -> dict:
    """Attention (N, L, H, S, S) float64, block outputs, wo inputs, logits: an explicit causal softmax."""
    from torchtitan.models.common.attention import FlexAttention

    layers = [model.layers[k] for k in sorted(model.layers.keys(), key=int)]
    attn, resid, oproj = {}, {}, {}
    current = {}

    def explicit(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kw):
        q, k, v = q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double()  # (B, N, L, H)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        S = s.shape[-1]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.softmax(s, dim=-1)
        attn[current["layer"]] = p
        return (p @ v).float().transpose(1, 2)

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__("layer", i)))
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: resid.__setitem__(i, o.double())))
        handles.append(layer.attention.wo.register_forward_pre_hook(lambda m, a, i=i: oproj.__setitem__(i, a[0].double())))
    original = FlexAttention.forward
    FlexAttention.forward = explicit
    try:
        with torch.no_grad():
            B, S = tokens.shape
            logits = model(tokens, attention_masks=model.get_attention_masks(torch.arange(S).expand(B, S)))
    finally:
        FlexAttention.forward = original
        for h in handles:
            h.remove()
    L = len(layers)
    return {
        "attn": torch.stack([attn[i] for i in range(L)], dim=1).numpy(),
        "resid": torch.stack([resid[i] for i in range(L)], dim=1).numpy(),
        "oproj": torch.stack([oproj[i] for i in range(L)], dim=1).numpy(),
        "logits": logits.double().numpy(),
    }


def close(a, b, *, atol=0.0, rtol=0.0):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_torchtitan_debug_model_record_matches_float64(family):
    model = debug_model(family)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    probes = [
        InductionProbe(n=6, seq_len=64, vocab_range=(2, V)),
        RepeatedRandomProbe(n=4, seq_len=24, vocab_range=(2, V)),
        NaturalProbe(tokens=torch.randint(2, V, (2000,), generator=g), n=4, seq_len=32),
    ]
    monitor = Monitor(probes, config=MonitorConfig(batch_tokens=600))
    record = monitor.probe(model).to_record()
    assert record["model"] == f"torchtitan.{type(model).__name__}" and record["n_layers"] == 2
    sets = {s.kind: s for s in monitor.probe_sets(V)}

    nat = sets["natural"]
    run = eager_run(model, nat.tokens)
    close(record["sink_alpha"], ind.sink_metrics(run["attn"])["sink_alpha"], atol=PROB_ATOL)
    p0 = ind.p0_metrics(run["resid"], nat.tokens.numpy())
    close(record["p0_norm_ratio"], p0["p0_norm_ratio"], rtol=RATIO_RTOL)

    probe = sets["induction"]
    run = eager_run(model, probe.tokens)
    toks = probe.tokens.numpy()
    ab = np.array(
        [
            int(np.flatnonzero(toks[n, :-1] == probe.fields["token_b"][n])[0]) - 1
            if (toks[n, :-1] == probe.fields["token_b"][n]).sum() == 1
            else probe.fields["ab"][n]
            for n in range(len(toks))
        ]
    )
    sel = ind.selectivity_metrics(run["attn"], toks, ab, probe.fields["token_b"])
    for cls, expected in sel["selectivity"].items():
        close(record["selectivity"][cls], expected, rtol=RATIO_RTOL, atol=RATIO_ATOL)
    close(record["pr"], ind.participation_ratio(run["oproj"], record["n_heads"]), rtol=RATIO_RTOL)
    valid = sel["valid"]
    target = ind.target_metrics(run["logits"][valid, -1], probe.fields["token_b"][valid])
    assert record["induction_target"]["loss"] == pytest.approx(target["loss"], abs=LOSS_ATOL)

    rep = sets["repeated"]
    run = eager_run(model, rep.tokens)
    pm = ind.prefix_metrics(run["attn"], run["logits"], rep.tokens.numpy(), rep.params["half_len"])
    close(record["induction_score"], pm["induction_score"], atol=PROB_ATOL)
    assert record["icl_score"] == pytest.approx(pm["icl_score"], abs=LOSS_ATOL)


def test_other_torchtitan_models_are_refused_by_name():
    model = debug_model("llama3")
    assert isinstance(resolve_target(model), TorchtitanTarget)
    model.lm_head = None  # a pipeline stage without the output layer
    with pytest.raises(UnsupportedModelError, match="pipeline stage"):
        resolve_target(model)
    from torchtitan.models.common.decoder import Decoder

    other = type("DeepSeekV3Model", (Decoder,), {})  # the name is what is checked
    model.__class__ = other
    with pytest.raises(UnsupportedModelError, match="DeepSeekV3Model is not supported"):
        resolve_target(model)
