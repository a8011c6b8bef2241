"""OLMo-core attention sinks and gated attention, probed at the attention backend (docs/design.md §2).

OLMo-core's torch backend gets the learnable sink logits as ``sinks=`` (one more softmax column), and
its gated attention multiplies the backend's output by ``sigmoid(w_g(x))`` *after* the backend that
sinkwatch hooks, before ``w_out``. OLMo-core's HF export carries neither, so the cross-framework test
cannot cover them: here every statistic is compared with a float64 computation from the model's own
q, k (as the backend received them), sink logits, gates and ``w_out`` inputs, read by this test's
own hooks during a plain forward.
"""

from __future__ import annotations

import independent as ind
import numpy as np
import pytest
import torch

pytest.importorskip("olmo_core")

from sinkwatch import InductionProbe, Monitor, NaturalProbe, RepeatedRandomProbe  # noqa: E402
from sinkwatch.capture import OLMoCoreTarget  # noqa: E402

VOCAB, H, HKV, D_MODEL = 64, 4, 2, 32
PROB_ATOL = 2e-5  # float32 statistics vs the float64 recomputation from the same q, k
RATIO_RTOL, RATIO_ATOL = 1e-4, 1e-6
GATE_ATOL = 1e-6
LOSS_ATOL = 1e-4


def olmo_model(*, sinks: bool, gate: str | None, seed: int = 0):
    """A 2-block OLMo-core Transformer (GQA) with learnable sinks of real size (-1 .. 4 across heads)
    and/or a gate whose projection is scaled up, so gates spread over (0, 1) token by token."""
    from olmo_core.nn.attention import GateConfig
    from olmo_core.nn.transformer import TransformerConfig

    cfg = TransformerConfig.llama_like(d_model=D_MODEL, vocab_size=VOCAB, n_layers=2, n_heads=H, n_kv_heads=HKV, hidden_size_multiple_of=16)
    cfg.block.sequence_mixer.attention_sinks = sinks
    if gate is not None:
        cfg.block.sequence_mixer.gate = GateConfig(granularity=gate)
    torch.manual_seed(seed)
    model = cfg.build(init_device="cpu")
    with torch.no_grad():
        for block in model.blocks.values():
            if sinks:
                block.attention.sinks.copy_(torch.linspace(-1.0, 4.0, H))
            if gate is not None:
                block.attention.w_g.weight.mul_(20.0)
    return model.eval()


def own_forward(model, tokens: torch.Tensor) -> dict:
    """A plain forward with this test's hooks: q, k as the backend got them, sink logits, gates,
    w_out inputs (after the gate) and backend outputs (before it), block outputs, logits."""
    got: dict = {"q": {}, "k": {}, "sinks": {}, "gate": {}, "written": {}, "attended": {}, "resid": {}}
    handles = []
    for i, key in enumerate(sorted(model.blocks.keys(), key=int)):
        block = model.blocks[key]
        att = block.attention

        def backend_in(mod, args, kwargs, i=i):
            q, k, _ = args[0]
            got["q"][i], got["k"][i] = q.double(), k.double()
            got["sinks"][i] = None if kwargs.get("sinks") is None else kwargs["sinks"].double()

        handles.append(att.backend.register_forward_pre_hook(backend_in, with_kwargs=True))
        handles.append(att.backend.register_forward_hook(lambda m, a, o, i=i: got["attended"].__setitem__(i, o.double())))
        if att.w_g is not None:
            handles.append(att.w_g.register_forward_hook(lambda m, a, o, i=i: got["gate"].__setitem__(i, torch.sigmoid(o.double()))))
        handles.append(att.w_out.register_forward_pre_hook(lambda m, a, i=i: got["written"].__setitem__(i, a[0].double())))
        handles.append(block.register_forward_hook(lambda m, a, o, i=i: got["resid"].__setitem__(i, o.double())))
    try:
        with torch.no_grad():
            got["logits"] = model(tokens).double()
    finally:
        for h in handles:
            h.remove()
    return got


def probabilities(q: torch.Tensor, k: torch.Tensor, sinks: torch.Tensor | None) -> np.ndarray:
    """(B, H, S, S) float64 causal attention of (B, S, H, D) q and (B, S, Hkv, D) k, with the sink
    column materialised and dropped after the softmax (as OLMo-core's torch backend does)."""
    q, k = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(H // HKV, dim=1)
    S = q.shape[2]
    logits = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :S].numpy()


def independent(model, tokens) -> dict:
    run = own_forward(model, tokens)
    L = len(run["q"])
    B, S = tokens.shape
    out = {
        "attn": np.stack([probabilities(run["q"][l], run["k"][l], run["sinks"][l]) for l in range(L)], axis=1),  # (N, L, H, S, S)
        "oproj": np.stack([run["written"][l].numpy() for l in range(L)], axis=1),  # (N, L, S, H*D)
        "attended": np.stack([run["attended"][l].reshape(B, S, -1).numpy() for l in range(L)], axis=1),
        "resid": np.stack([run["resid"][l].numpy() for l in range(L)], axis=1),
        "logits": run["logits"].numpy(),
        "gate": None,
    }
    if run["gate"]:
        # headwise (B, S, H): one gate per head; elementwise (B, S, H*D): the mean over the head's dims
        out["gate"] = np.stack([run["gate"][l].reshape(B, S, H, -1).mean(axis=(1, 3)).numpy() for l in range(L)], axis=1)  # (N, L, H)
    return out


def close(a, b, *, atol=0.0, rtol=0.0):
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), atol=atol, rtol=rtol)


PROBES = [
    InductionProbe(n=8, seq_len=64),
    RepeatedRandomProbe(n=4, seq_len=32),
    NaturalProbe(tokens=torch.randint(1, VOCAB, (2000,), generator=torch.Generator().manual_seed(3)), n=6, seq_len=40),
]


VARIANTS = {"sinks+headwise": (True, "headwise"), "elementwise": (False, "elementwise")}


@pytest.mark.parametrize("sinks, gate", list(VARIANTS.values()), ids=list(VARIANTS))
def test_statistics_equal_a_float64_computation_from_the_models_own_q_k_sinks_and_gates(sinks, gate):
    """Sinks join every softmax; PR is taken after the gate (it differs from the pre-gate PR); the
    mean gate per head and the learned sinks' mass are recorded; everything else as for any model."""
    model = olmo_model(sinks=sinks, gate=gate)
    monitor = Monitor(PROBES)
    record = monitor.probe(OLMoCoreTarget(model)).to_record()
    sets = {s.kind: s for s in monitor.probe_sets(VOCAB)}

    probe = sets["induction"]
    run = independent(model, probe.tokens)
    after = ind.participation_ratio(run["oproj"], H)  # what the heads write: w_out's input
    close(record["pr"], after, rtol=RATIO_RTOL)
    if gate:  # the gate matters: PR before it (the backend's output) is another number
        before = ind.participation_ratio(run["attended"], H)
        assert np.abs(before - after).max() > 0.05
    toks, token_b = probe.tokens.numpy(), probe.fields["token_b"]
    once = [(toks[n, :-1] == token_b[n]).sum() == 1 for n in range(len(toks))]
    ab = np.array([int(np.flatnonzero(toks[n, :-1] == token_b[n])[0]) - 1 if once[n] else probe.fields["ab"][n] for n in range(len(toks))])
    sel = ind.selectivity_metrics(run["attn"], toks, ab, token_b)
    for cls, expected in sel["selectivity"].items():
        close(record["selectivity"][cls], expected, rtol=RATIO_RTOL, atol=RATIO_ATOL)
    assert np.array_equal(np.array(record["best_class"], dtype=object), sel["best_class"])
    assert record["sink_heads_per_layer"] == sel["sink_heads_per_layer"]
    assert record["induction_heads"] == sel["induction_heads"]
    assert record["softmax_layers"] == [0, 1]

    nat = sets["natural"]
    run = independent(model, nat.tokens)
    sm = ind.sink_metrics(run["attn"])
    close(record["sink_alpha"], sm["sink_alpha"], atol=PROB_ATOL)
    assert record["sink_rate"] == pytest.approx(sm["sink_rate"])
    close(record["sink_profile"], sm["sink_profile"])
    assert record["sink_center"] == sm["sink_center"]
    if sinks:
        share = 1.0 - run["attn"].sum(-1)  # (N, L, H, S): the learned sink's share of every row
        close(record["sink_learned_alpha"], share.mean(-1).mean(0), atol=PROB_ATOL)
        assert max(max(r) for r in record["sink_learned_alpha"]) > 0.3  # a sink of real size
    else:
        assert "sink_learned_alpha" not in record
    if gate:
        close(record["attn_gate_mean"], run["gate"].mean(0), atol=GATE_ATOL)
    else:
        assert "attn_gate_mean" not in record
    p0 = ind.p0_metrics(run["resid"], nat.tokens.numpy())
    close(record["p0_norm_ratio"], p0["p0_norm_ratio"], rtol=RATIO_RTOL)

    rep = sets["repeated"]
    run = independent(model, rep.tokens)
    pm = ind.prefix_metrics(run["attn"], run["logits"], rep.tokens.numpy(), rep.params["half_len"])
    close(record["induction_score"], pm["induction_score"], atol=PROB_ATOL)
    assert record["icl_score"] == pytest.approx(pm["icl_score"], abs=LOSS_ATOL)
