"""The repeated probe's per-token losses come from the final hidden states through the model's own
output head, in row chunks, outside the all-position logits (docs/design.md §9; capture/head.py): equal to the
losses of ``model(...).logits`` for every family, with what each family does after its head."""

import warnings

import families
import pytest
import tiny_models
import torch
import torch.nn.functional as F
import transformers as T

from sinkwatch import Monitor, RepeatedRandomProbe
from sinkwatch.capture import HFTarget
from sinkwatch.capture.head import loss_chunk_rows
from sinkwatch.collectors import P0Part, ProbeCollector

LOSS_ATOL = 1e-5  # float32: chunked GEMMs vs one GEMM differ in accumulation order only


def _model(name: str) -> torch.nn.Module:
    if name in tiny_models.FAMILIES:
        return tiny_models.build(name, seed=1)
    return families.build(name, seed=1)


def _post_models():
    """Families whose head output is changed before it is returned, each made to matter."""
    common = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    yield "gemma2-softcap-0.5", families.build("gemma2", seed=1, final_logit_softcapping=0.5)
    yield "cohere-logit_scale", T.AutoModelForCausalLM.from_config(T.CohereConfig(**common, logit_scale=0.0625)).eval()
    yield "granite-logits_scaling", T.AutoModelForCausalLM.from_config(T.GraniteConfig(**common, logits_scaling=8.0)).eval()
    falcon = families.build("falcon_h1", seed=1)
    falcon.model.lm_head_multiplier = 0.7
    yield "falcon_h1-lm_head_multiplier", falcon


def _reference_losses(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.double()  # (B, S, V)
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").float()


def _probe_losses(model, ids):
    L = len(HFTarget(model).blocks())
    collector = ProbeCollector([P0Part(L)])
    collector.batch = slice(0, ids.shape[0])
    with torch.no_grad(), HFTarget(model).capture(collector) as forward:
        out = forward(ids, token_losses=True)
    return out, collector


CASES = [(n, None) for n in list(tiny_models.FAMILIES) + [f for f in families.BUILT_HERE]] + [(n, m) for n, m in _post_models()]


@pytest.mark.parametrize("name,model", CASES, ids=[c[0] for c in CASES])
def test_chunked_losses_equal_the_models_own_logits(name, model):
    model = model if model is not None else _model(name)
    ids = torch.randint(2, 256, (3, 40), generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the head must be reproduced: no fallback warning
        out, _ = _probe_losses(model, ids)
    assert out.logits.shape == (3, 1, 256)  # the forward itself kept the last position only
    torch.testing.assert_close(out.token_losses, _reference_losses(model, ids), atol=LOSS_ATOL, rtol=0)


class _HalvedLlama(T.LlamaForCausalLM):
    """A Llama whose logits are halved after the head: a post-processing sinkwatch does not know."""

    def forward(self, input_ids=None, logits_to_keep=0, **kwargs):  # logits_to_keep kept: the head tap is tried first
        out = super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
        out.logits = out.logits * 0.5
        return out


def test_an_unknown_post_processing_falls_back_to_extra_forwards_with_the_same_numbers():
    config = tiny_models.config_for("llama")
    torch.manual_seed(3)
    halved = _HalvedLlama(config).eval()
    plain = T.LlamaForCausalLM(config).eval()
    plain.load_state_dict(halved.state_dict())
    ids = torch.randint(2, 256, (5, 32), generator=torch.Generator().manual_seed(6))
    with pytest.warns(RuntimeWarning, match="could not be reproduced"):
        out, collector = _probe_losses(halved, ids)
    torch.testing.assert_close(out.token_losses, _reference_losses(halved, ids), atol=LOSS_ATOL, rtol=0)
    # the extra forwards were muted: the collector saw the one measured forward, not five more
    assert all(len(per_layer) == 1 for per_layer in collector.parts[0].ratio)
    probe = RepeatedRandomProbe(n=6, seq_len=32)
    a = Monitor([probe]).probe(halved).to_record()
    b = Monitor([probe]).probe(plain).to_record()
    assert a["induction_score"] == b["induction_score"]  # attention statistics untouched by the fallback
    assert a["icl_score"] != b["icl_score"]  # the halved logits' own losses, not the plain model's


def test_nan_logits_are_named_as_such_not_as_a_head_that_could_not_be_reproduced(monkeypatch):
    """A model whose logits hold NaN (one NaN row of its head, as in a diverged run): NaN == NaN is false, so the
    head tap's self-check used to fail, warn that the head "could not be reproduced" and redo the losses from extra
    forwards. The check is NaN-aware: the tap serves the losses, and one warning says the logits are not finite."""
    import sinkwatch.capture.head as head

    monkeypatch.setattr(head, "_WARNED", set())  # each warning once per model: none given by an earlier test
    monkeypatch.setattr(head, "_WARNED_NONFINITE", set(), raising=False)
    model = tiny_models.build("llama", seed=1)
    with torch.no_grad():
        model.lm_head.weight[7] = float("nan")
    ids = torch.randint(2, 256, (3, 40), generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = _probe_losses(model, ids)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not [m for m in messages if "could not be reproduced" in m], messages
    assert [m for m in messages if "logits are not finite" in m], messages
    assert out.logits.shape == (3, 1, 256)  # the tap served them: no all-position forward
    assert torch.isnan(out.token_losses).all()  # every position's softmax sees the NaN logit
    torch.testing.assert_close(out.token_losses, _reference_losses(model, ids), equal_nan=True)


def test_loss_chunks_are_bounded_whatever_the_vocabulary():
    for V in (256, 32_000, 262_144, 1_000_000):
        assert loss_chunk_rows(V) * V * 4 <= 32 * 2**20 or loss_chunk_rows(V) == 1
