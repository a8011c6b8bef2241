"""LitGPT capture: every record key of a tiny LitGPT ``GPT`` equals an independent float64
computation from explicit attention weights (tests/litgpt_helpers.eager_run + tests/independent.py),
with GQA, MQA, soft-capping, a sliding-window layer and a scores scalar; the model is left as found."""

import independent as ind
import pytest
import torch

pytest.importorskip("litgpt")

import litgpt_helpers as lh  # noqa: E402

from sinkwatch import InductionProbe, Monitor, MonitorConfig, NaturalProbe, RepeatedRandomProbe  # noqa: E402
from sinkwatch.capture import LitGPTTarget, UnsupportedModelError, resolve_target  # noqa: E402
from sinkwatch.capture.litgpt import window_of  # noqa: E402


def probes():
    g = torch.Generator().manual_seed(7)
    return [
        InductionProbe(n=24, seq_len=64),
        RepeatedRandomProbe(n=6, seq_len=32),
        NaturalProbe(tokens=torch.randint(2, lh.VOCAB, (4000,), generator=g), n=8, seq_len=40),
    ]


def check_record(model, record, monitor):
    assert (record["n_layers"], record["n_heads"]) == (model.config.n_layer, model.config.n_head)
    ind.check_record(record, monitor, lh.VOCAB, lambda tokens: lh.eager_run(model, tokens))


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_litgpt_record_matches_float64_eager(kind):
    """GQA (llama) and MQA + soft-capping + a sliding-window layer + attention_scores_scalar (gemma)."""
    model = lh.build(kind, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monitor = Monitor(probes(), config=MonitorConfig(batch_tokens=300))
    record = monitor.probe(model).to_record()
    check_record(model, record, monitor)
    assert record["model"].startswith("litgpt.")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any("scaled_dot_product_attention" in b.attn.__dict__ for b in model.transformer.h)  # the wrapper is gone


def test_the_checks_bite():
    """The float64 check fails when the capture's scale is wrong (it can fail)."""
    model = lh.build("gemma", seed=1)
    model.config.attention_scores_scalar = 64  # the model keeps computing with it; the eager copy below does not
    monitor = Monitor(probes(), config=MonitorConfig(batch_tokens=300))
    record = monitor.probe(model).to_record()
    model.config.attention_scores_scalar = 24
    with pytest.raises(AssertionError):
        check_record(model, record, monitor)


def test_resolve_and_refusals():
    model = lh.build("llama")
    target = resolve_target(model)
    assert isinstance(target, LitGPTTarget) and target.vocab_size == lh.VOCAB and target.context == 128
    model.max_seq_length = 48
    assert resolve_target(model).context == 48
    assert window_of(None, 8) is None
    T = 8
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    band = torch.where((j <= i) & (i - j < 3), 0.0, float("-inf")).view(1, 1, T, T)
    assert window_of(band, T) == 3
    with pytest.raises(UnsupportedModelError):
        window_of(torch.zeros(1, 1, T, T), T)  # bidirectional
    latent = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
    mla = lh.build("llama", latent_attention=latent, n_query_groups=4)
    with pytest.raises(UnsupportedModelError, match="MultiheadLatentAttention"):
        resolve_target(mla)
