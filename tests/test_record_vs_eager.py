"""Every metric in the record equals an independent computation from eager attention (docs/design.md §5, §10).

For each supported family, on a tiny random model and on one trained a few hundred steps on a
copy task, sinkwatch's record is compared with tests/independent.py, which materialises
attention with output_attentions=True and re-derives each definition with plain numpy.
"""

import copy

import independent as ind
import pytest
import torch
from tiny_models import FAMILIES, VOCAB, build

from sinkwatch import InductionProbe, Monitor, MonitorConfig, NaturalProbe, RepeatedRandomProbe


def natural_stream(seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (4000,), generator=g)


def probes():
    return [
        InductionProbe(n=24, seq_len=64),
        RepeatedRandomProbe(n=6, seq_len=32),
        NaturalProbe(tokens=natural_stream(), n=8, seq_len=40),
    ]


def check_record(model, family, record, monitor):
    assert (record["n_layers"], record["n_heads"]) == (model.config.num_hidden_layers, model.config.num_attention_heads)
    ind.check_record(record, monitor, VOCAB, lambda tokens: ind.eager_run(model, family, tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_random_model_record_matches_eager(family):
    """On a random model every record key equals the eager-attention recomputation."""
    model = build(family, seed=1)
    monitor = Monitor(probes(), config=MonitorConfig(batch_tokens=200))  # several micro-batches per probe
    record = monitor.probe(model).to_record()
    assert record["stats_backend"] == "torch"  # "auto" on CPU tensors
    check_record(model, family, record, monitor)


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_model_record_matches_eager(family, trained_models):
    """On a trained model every record key equals the eager-attention recomputation."""
    model = trained_models.get(family)
    monitor = Monitor(probes(), config=MonitorConfig(batch_tokens=300))
    record = monitor.probe(model).to_record()
    check_record(model, family, record, monitor)


def test_sink_keys_come_from_the_induction_probe_without_a_natural_probe(trained_models):
    """Without a natural probe the sink keys come from the induction probe; absent keys stay absent."""
    model = trained_models.get("llama")
    monitor = Monitor([InductionProbe(n=16, seq_len=64)])
    record = monitor.probe(model).to_record()
    probe = monitor.probe_sets(VOCAB)[0]
    run = ind.eager_run(model, "llama", probe.tokens)
    ind.close(record["sink_alpha"], ind.sink_metrics(run["attn"])["sink_alpha"], atol=ind.PROB_ATOL)
    ind.close(record["p0_norm_ratio"], ind.p0_metrics(run["resid"], probe.tokens.numpy())["p0_norm_ratio"], rtol=ind.RATIO_RTOL)
    assert "induction_score" not in record and "icl_score" not in record  # absent, not zero
    assert record["probe"] == "induction"


def test_trained_models_are_not_trivial(trained_models):
    """The trained fixtures must exercise the metrics: attention far from uniform somewhere."""
    model = trained_models.get("llama")
    record = Monitor([RepeatedRandomProbe(n=8, seq_len=64)]).probe(model).to_record()
    assert max(max(r) for r in record["induction_score"]) > 0.3
    assert record["icl_score"] < -0.5


def test_the_triton_kernel_inside_a_real_probe_matches_eager():
    """The whole probe through the Triton kernel (the GPU default; the interpreter here, so small
    probes): a Qwen2 model's own q/k layouts, GQA and a sliding-window layer, against the same
    independent eager computation as every other record."""
    pytest.importorskip("triton")
    import sinkwatch.kernels.triton_stats as ts

    cuda = torch.cuda.is_available()
    if not (cuda or ts._INTERPRET):
        pytest.skip("the Triton kernel module was imported without TRITON_INTERPRET=1 on a machine without CUDA")
    model = build("qwen2", seed=1)
    small = [InductionProbe(n=4, seq_len=64), RepeatedRandomProbe(n=2, seq_len=32), NaturalProbe(tokens=natural_stream(), n=2, seq_len=40)]
    monitor = Monitor(small, config=MonitorConfig(backend="triton"))
    probed = copy.deepcopy(model).cuda() if cuda else model  # compiled kernel on a GPU; eager stays on the CPU
    record = monitor.probe(probed).to_record()
    assert record["stats_backend"] == "triton"
    check_record(model, "qwen2", record, monitor)
