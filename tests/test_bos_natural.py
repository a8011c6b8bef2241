"""A natural probe whose windows all start with a BOS: both anchors are measured (the BOS on the
windows as fed, position 0 on their BOS-free twin), the shallower circuit decides (the BOS on a tie),
the record keeps both, and the P0 stage can reach ``final`` (docs/stages.md, "Two anchors")."""

import warnings

import planted
import pytest
import torch

from sinkwatch import InductionProbe, Monitor, StageConfig, make_natural_probe, stages

BOS = 1


def _natural(bos: bool):
    stream = torch.randint(2, 60, (4000,), generator=torch.Generator().manual_seed(3))
    return make_natural_probe(stream, n=24, seq_len=32, bos_token_id=BOS if bos else None, source="test")


def test_bos_windows_judge_both_anchors():
    model = planted.p0_final()  # block 0 amplifies position 0 along a fixed direction; later heads sink onto it
    plain = Monitor([_natural(False), InductionProbe(n=8, seq_len=64)]).probe(model).to_record()
    bos = Monitor([_natural(True), InductionProbe(n=8, seq_len=64)]).probe(model).to_record()
    assert plain["circuit_layer"] == 0 and plain["p0_stage_now"] == "final" and "p0_anchor_views" not in plain
    # the positional circuit amplifies whatever sits at position 0, the BOS too: a tie, so the BOS decides
    views = bos["p0_anchor_views"]
    assert views["bos"]["circuit_layer"] == views["position"]["circuit_layer"] == 0
    assert bos["p0_anchor"] == "bos" and bos["circuit_layer"] == 0 and bos["p0_stage_now"] == "final"
    assert bos["p0_stage_by_anchor"] == {"bos": "final", "position": "final"}
    assert bos["sink_rate"] > 0  # sink keys are those of the windows as fed, BOS included
    assert views["position"]["sink_rate"] > 0 and views["position"]["sink_alpha"] != views["bos"]["sink_alpha"]  # the twin's own


def test_the_shallower_anchor_decides():
    """The BOS's circuit decides unless the twin's positional one is shallower."""
    natural = _natural(True)
    monitor = Monitor([natural])
    deep = [1.0, 1.0, 1.0, 30.0, 30.0, 30.0]  # amplified at block 3
    shallow = [30.0] * 6  # at block 0

    def values(rho, consistency):
        return {"p0_norm_ratio": rho, "p0_norm_ratio_embeddings": 1.0, "p0_direction_consistency": [consistency] * 6,
                "p0_direction_consistency_centered": [consistency] * 6, "p0_attn_norm_ratio": None, "p0_mlp_norm_ratio": None,
                "sink_rate": 0.5, "sink_profile": [0.5] + [0.0] * 7, "sink_center": 0, "sink_positions": 1,
                "sink_alpha": [[0.5]]}  # fmt: skip
    for bos_rho, twin_rho, anchor, layer in ((shallow, deep, "bos", 0), (deep, shallow, "position", 0), (deep, deep, "bos", 3)):
        fed, twin = values(bos_rho, float("nan")), values(twin_rho, 1.0)
        twin.update(stages.circuit(twin, StageConfig(), bos=False))
        got = monitor._p0_anchor(natural, fed, twin)
        assert (got["p0_anchor"], got["circuit_layer"]) == (anchor, layer), (bos_rho, twin_rho)


def test_undecidable_positional_circuit_is_warned():
    tokens = torch.randint(2, 60, (24, 31), generator=torch.Generator().manual_seed(4))
    tokens[:, 0] = 7  # BOS, then the same second token everywhere: no pair to compare, twin or not
    probe = make_natural_probe(tokens, n=24, seq_len=31, bos_token_id=BOS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = Monitor([probe]).probe(planted.p0_final()).to_record()
    assert record["circuit_layer_twin"] is None  # no positional verdict ...
    assert record["p0_anchor"] == "bos" and record["circuit_layer"] == 0  # ... but the BOS is amplified, so it anchors
    assert any("undecidable" in str(w.message) for w in caught)


def _planted_bos_records():
    model = planted.p0_final_bos()
    stream = torch.randint(2, planted.VOCAB, (4000,), generator=torch.Generator().manual_seed(3))
    with_bos = make_natural_probe(stream, n=24, seq_len=32, bos_token_id=planted.BOS, source="test")
    without = make_natural_probe(stream, n=24, seq_len=32, source="test")
    return (Monitor([p]).probe(model).to_record() for p in (with_bos, without))


def test_the_bos_anchor_reads_final_on_a_planted_bos_trained_profile():
    """A BOS-trained 270M model's profile (Gemma 3 270M), planted: sink rate ~0.77 (block 0 ~0.6), the BOS's norm
    ~24-29x after block 0, the BOS-free twin ~1x and sink-free. The stage is final, the anchor the BOS."""
    bos, plain = _planted_bos_records()
    assert bos["sink_rate"] == pytest.approx(0.8) and bos["sink_rate_per_layer"][0] == pytest.approx(2 / 3)
    assert bos["sink_center"] == 0 and bos["sink_positions"] == 1
    assert all(20 < r < 30 for r in bos["p0_norm_ratio_bos"])  # amplified from block 0 on
    assert bos["circuit_layer_bos"] == 0 and bos["circuit_layer_twin"] is None  # no positional circuit
    assert (bos["p0_anchor"], bos["circuit_layer"]) == ("bos", 0)
    assert bos["p0_stage_now"] == "final" and bos["p0_stage_by_anchor"] == {"bos": "final", "position": "none"}
    twin = bos["p0_anchor_views"]["position"]  # the twin's own sinks are kept: without the BOS nothing sinks
    assert twin["sink_rate"] == 0.0 and twin["sink_profile"] == [0.0] * 8
    assert bos["bos_token_id"] == planted.BOS
    # the twin by hand (windows without the BOS): nothing amplified, nothing sinks
    assert plain["sink_rate"] == 0.0 and max(plain["p0_norm_ratio"]) < 1.2
    assert plain["p0_anchor"] is None and plain["circuit_layer"] is None and plain["p0_stage_now"] == "none"


def _bos_tokenizer(char_tokenizer):
    """The byte tokenizer with a BOS (byte 0, never in text) put first, the way Gemma's tokenizer does."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    inner = char_tokenizer.backend_tokenizer
    zero = char_tokenizer.convert_ids_to_tokens(0)
    inner.post_processor = processors.TemplateProcessing(single=f"{zero} $A", special_tokens=[(zero, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token=zero)


def test_natural_windows_follow_the_tokenizers_bos_convention(char_tokenizer, tmp_path):
    from sinkwatch import NaturalProbe

    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    bos_tok = _bos_tokenizer(char_tokenizer)
    assert bos_tok("a")["input_ids"] == [0, 97]
    auto = NaturalProbe(text_file=str(text), tokenizer=bos_tok, n=8, seq_len=16).build(256)
    assert (auto.tokens[:, 0] == 0).all() and auto.params["bos_token_id"] == 0
    assert (auto.tokens[:, 1:] != 0).all()  # the text itself, 15 tokens a window
    off = NaturalProbe(text_file=str(text), tokenizer=bos_tok, n=8, seq_len=16, bos=False).build(256)
    assert off.params["bos_token_id"] is None and (off.tokens != 0).all()
    plain = NaturalProbe(text_file=str(text), tokenizer=char_tokenizer, n=8, seq_len=16).build(256)
    assert plain.params["bos_token_id"] is None
    with pytest.raises(ValueError, match="has no BOS token"):
        NaturalProbe(text_file=str(text), tokenizer=char_tokenizer, n=8, seq_len=16, bos=True).build(256)
    forced = NaturalProbe(tokens=torch.arange(5, 200), n=4, seq_len=8, bos=True, bos_token_id=3).build(256)
    assert (forced.tokens[:, 0] == 3).all()


def test_cli_probe_bos_follows_the_tokenizer_and_can_be_overridden(char_tokenizer, tmp_path):
    import json

    from tiny_models import build

    from sinkwatch.cli import main

    folder = tmp_path / "model"
    build("llama", seed=1).save_pretrained(folder)
    _bos_tokenizer(char_tokenizer).save_pretrained(folder)
    text = tmp_path / "t.txt"
    text.write_text("import os\nprint(os.getcwd())\n" * 200)
    seen = {}
    for flag in ([], ["--no-bos"], ["--bos"]):
        out = tmp_path / f"r{len(flag)}{''.join(flag)}.json"
        assert main(["probe", str(folder), "--probe", "natural", "--n", "8", "--seq-len", "24", "--text", str(text), "--out", str(out),
                     *flag]) == 0  # fmt: skip
        seen[tuple(flag)] = json.loads(out.read_text())
    assert seen[()]["bos_token_id"] == 0 and seen[("--bos",)]["bos_token_id"] == 0
    assert seen[("--no-bos",)]["bos_token_id"] is None
    assert seen[()]["probe_hash"] != seen[("--no-bos",)]["probe_hash"]  # a BOS-tokenizer model's probe changed (docs/replay.md)


def test_replay_options_carry_bos():
    from sinkwatch.replay.protocol import probes_with_options
    from sinkwatch.replay.recipes import Recipe

    recipe = Recipe(model="m", probes={"natural": {"text_file": "x.txt"}})
    (natural,) = probes_with_options(recipe, ["natural"], bos=False)
    assert natural.bos is False
    (natural,) = probes_with_options(recipe, ["natural"])
    assert natural.bos is None  # the tokenizer's convention


@pytest.mark.parametrize("bos", [False, True])
def test_probe_hash_does_not_include_the_twin(bos):
    m = Monitor([_natural(bos)])
    assert set(m.probe_hashes(64)) == {"natural"}
