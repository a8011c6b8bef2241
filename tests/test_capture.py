"""Capture through AttentionInterface: outputs unchanged, the model left exactly as found, clear errors."""


import pytest
import torch
from tiny_models import FAMILIES, VOCAB, build

from sinkwatch import InductionProbe, Monitor, MonitorConfig, RepeatedRandomProbe, UnsupportedModelError, find_transformers_model
from sinkwatch.capture import HFTarget
from sinkwatch.collectors import HeadOutputPart, P0Part, ProbeCollector, SinkPart
from sinkwatch.kernels.api import OUTPUT_ENV
from sinkwatch.probes import ProbeSet


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("previous", ["sdpa", "eager"])
def test_outputs_unchanged_under_capture(family, previous, monkeypatch):
    """With the model's own attention computing the output, logits under capture equal the plain
    forward's bit for bit, and the attention implementation is restored. (sinkwatch's fused output,
    the CPU default, is compared with the model's own in tests/test_fused_capture.py.)"""
    monkeypatch.setenv(OUTPUT_ENV, "model")
    model = build(family, seed=2)
    model.set_attn_implementation(previous)
    ids = torch.randint(0, VOCAB, (3, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        L = model.config.num_hidden_layers
        collector = ProbeCollector([SinkPart(L), P0Part(L), HeadOutputPart(L, row=torch.full((3,), 49).numpy())])
        collector.batch = slice(0, 3)
        with HFTarget(model).capture(collector) as forward:
            probed = forward(ids, all_logits=True).logits
    assert torch.equal(plain, probed)
    assert model.config._attn_implementation == previous
    assert len(collector.parts[0].chunks[L - 1]) == 1  # every layer was seen


def test_p0_part_keeps_a_copy_of_the_first_rows_only():
    """What P0Part keeps of a block's output is its own copy of h[:, 0]: a view would keep the whole
    (B, S, d) hidden state of every layer alive until the probe ends (a CPU probe's memory then grew
    by one hidden state per layer)."""
    part = P0Part(1)
    hidden = torch.randn(2, 64, 16)
    first = hidden[:, 0].clone()
    part.on_block_output(slice(0, 2), 0, hidden)
    kept = part.vectors[0][0]
    assert kept.nbytes == first.numel() * 4
    hidden.zero_()  # a view would change with it
    assert torch.equal(torch.from_numpy(kept), first)


def test_probe_leaves_the_model_as_found():
    """Parameters, gradients, train/eval modes, requires_grad, attention implementation and RNG are as before the probe."""
    model = build("llama", seed=3)
    model.train()
    model.model.layers[0].eval()  # mixed modes must be restored per module
    model.model.embed_tokens.weight.requires_grad_(False)
    loss = model(input_ids=torch.randint(0, VOCAB, (2, 20)), labels=torch.randint(0, VOCAB, (2, 20))).loss
    loss.backward()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    req = {n: p.requires_grad for n, p in model.named_parameters()}
    impl = model.config._attn_implementation
    torch.manual_seed(1234)
    rng = torch.get_rng_state()

    Monitor([InductionProbe(n=8, seq_len=64), RepeatedRandomProbe(n=4, seq_len=16)]).probe(model)

    assert torch.equal(torch.get_rng_state(), rng)
    assert model.config._attn_implementation == impl
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert {n: p.requires_grad for n, p in model.named_parameters()} == req
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
        assert (p.grad is None and grads[n] is None) or torch.equal(p.grad, grads[n]), n


def test_attention_implementation_restored_when_the_probe_fails():
    """A probe that raises still restores the model's attention implementation."""
    model = build("gpt2")
    bad = ProbeSet("natural", torch.full((2, 20), VOCAB + 5), {}, {})
    with pytest.raises(ValueError, match="vocabulary"):
        Monitor([bad]).probe(model)
    assert model.config._attn_implementation == "sdpa"


def test_model_without_attention_interface_is_named():
    """A model that bypasses AttentionInterface is refused with its class named."""
    from toy_unsupported import ToyConfig, ToyLM

    model = ToyLM(ToyConfig())
    with pytest.raises(UnsupportedModelError, match="ToyLM does not route attention through transformers' AttentionInterface"):
        Monitor([InductionProbe(n=2, seq_len=64, vocab_range=(0, 64))]).probe(model)


def test_probe_longer_than_context():
    """A probe longer than the model's context is a ValueError that suggests --seq-len."""
    model = build("gpt_neox", max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"context of 64.*--seq-len <= 64"):
        Monitor([InductionProbe(n=2, seq_len=128)]).probe(model)


def test_token_ids_outside_vocabulary():
    """Probe tokens beyond the vocabulary are a ValueError that suggests --vocab-range."""
    model = build("qwen3")
    with pytest.raises(ValueError, match="--vocab-range"):
        Monitor([InductionProbe(n=2, seq_len=64, vocab_range=(100, 1000))]).probe(model)


def test_vocabulary_too_small_for_the_induction_probe():
    """A two-token vocabulary cannot hold the induction probe: a clear ValueError."""
    model = build("llama", vocab_size=2)
    with pytest.raises(ValueError, match="too small"):
        Monitor([InductionProbe(n=2, seq_len=64)]).probe(model)


def test_find_transformers_model_unwraps_wrappers():
    """The transformers model is found inside holders and torch.compile; a plain module is refused."""
    model = build("llama")

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

    assert find_transformers_model(Holder()) is model
    compiled = torch.compile(model)  # wrapping only: nothing runs, nothing compiles
    assert find_transformers_model(compiled) is model
    with pytest.raises(UnsupportedModelError, match="no transformers PreTrainedModel"):
        find_transformers_model(torch.nn.Linear(2, 2))


def test_probe_is_deterministic_and_batch_size_invariant():
    """Records agree whatever the probe micro-batch size."""
    model = build("olmo", seed=5)
    a = Monitor([InductionProbe(n=12, seq_len=64)], config=MonitorConfig(batch_tokens=64)).probe(model).to_record()
    b = Monitor([InductionProbe(n=12, seq_len=64)], config=MonitorConfig(batch_tokens=100000)).probe(model).to_record()
    for key in ("sink_alpha", "pr", "p0_norm_ratio"):
        torch.testing.assert_close(torch.tensor(a[key]), torch.tensor(b[key]), rtol=1e-5, atol=1e-6)
    assert a["probe_hash"] == b["probe_hash"]


def test_group_ablation_reports_baseline_ablated_and_control(trained_models):
    """Ablation reports baseline, ablated and a disjoint matched control; unknown heads are refused."""
    model = trained_models.get("gpt2")
    res = Monitor([InductionProbe(n=16, seq_len=64)]).ablate(model, ["L0H1", (1, 2)])
    assert res["heads"] == ["L0H1", "L1H2"]
    assert len(res["control_heads"]) == 2 and not set(res["control_heads"]) & set(res["heads"])
    assert {l[:2] for l in res["control_heads"]} == {"L0", "L1"}
    for k in ("baseline", "ablated", "control"):
        assert set(res[k]) == {"loss", "top1", "top5"}
    assert res["ablated"]["loss"] != res["baseline"]["loss"]
    with pytest.raises(ValueError, match="L9H0 does not exist"):
        Monitor([InductionProbe(n=4, seq_len=64)]).ablate(model, ["L9H0"])
