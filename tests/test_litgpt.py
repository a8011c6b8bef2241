"""LitGPT capture (issue 27): every record key of a tiny LitGPT ``GPT`` equals an independent float64
computation from explicit attention weights (tests/litgpt_helpers.eager_run + tests/independent.py),
with GQA, MQA, soft-capping, a sliding-window layer and a scores scalar; the model is left as found."""

import independent as ind
import numpy as np
import pytest
import torch

pytest.importorskip("litgpt")

import litgpt_helpers as lh  # noqa: E402

from sinkwatch import InductionProbe, Monitor, MonitorConfig, NaturalProbe, RepeatedRandomProbe  # noqa: E402
from sinkwatch.capture import LitGPTTarget, UnsupportedModelError, resolve_target  # noqa: E402
from sinkwatch.capture.litgpt import window_of  # noqa: E402

PROB_ATOL = 2e-5
RATIO_RTOL = 1e-4
RATIO_ATOL = 1e-6
LOSS_ATOL = 1e-4


def probes():
    g = torch.Generator().manual_seed(7)
    return [
        InductionProbe(n=24, seq_len=64),
        RepeatedRandomProbe(n=6, seq_len=32),
        NaturalProbe(tokens=torch.randint(2, lh.VOCAB, (4000,), generator=g), n=8, seq_len=40),
    ]


def close(a, b, *, atol=0.0, rtol=0.0):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


def check_record(model, record, monitor):
    sets = {s.kind: s for s in monitor.probe_sets(lh.VOCAB)}
    assert (record["n_layers"], record["n_heads"]) == (model.config.n_layer, model.config.n_head)
    nat = sets["natural"]
    run = lh.eager_run(model, nat.tokens)
    sinks = ind.sink_metrics(run["attn"])
    close(record["sink_alpha"], sinks["sink_alpha"], atol=PROB_ATOL)
    assert record["sink_rate"] == pytest.approx(sinks["sink_rate"])
    close(record["sink_profile"], sinks["sink_profile"])
    p0 = ind.p0_metrics(run["resid"], nat.tokens.numpy())
    close(record["p0_norm_ratio"], p0["p0_norm_ratio"], rtol=RATIO_RTOL)
    close(record["p0_direction_consistency"], p0["p0_direction_consistency"], atol=1e-5)

    probe = sets["induction"]
    run = lh.eager_run(model, probe.tokens)
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
    assert np.array_equal(np.array(record["best_class"], dtype=object), sel["best_class"])
    for key in ("sink_heads_per_layer", "induction_heads", "n_induction_ge30", "n_induction_ge50"):
        assert record[key] == sel[key], key
    close(record["pr"], ind.participation_ratio(run["oproj"], model.config.n_head), rtol=RATIO_RTOL)
    valid = sel["valid"]
    target = ind.target_metrics(run["logits"][valid, -1], probe.fields["token_b"][valid])
    assert record["induction_target"]["loss"] == pytest.approx(target["loss"], abs=LOSS_ATOL)
    assert record["induction_target"]["top1"] == pytest.approx(target["top1"])

    rep = sets["repeated"]
    run = lh.eager_run(model, rep.tokens)
    pm = ind.prefix_metrics(run["attn"], run["logits"], rep.tokens.numpy(), rep.params["half_len"])
    close(record["induction_score"], pm["induction_score"], atol=PROB_ATOL)
    assert record["icl_score"] == pytest.approx(pm["icl_score"], abs=LOSS_ATOL)


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
