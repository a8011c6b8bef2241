"""A natural probe whose windows all start with BOS (issue 11, item 9): the BOS-free twin decides
the circuit layer, the record says so, and the P0 stage can reach ``final``."""

import warnings

import planted
import pytest
import torch

from sinkwatch import InductionProbe, Monitor, make_natural_probe

BOS = 1


def _natural(bos: bool):
    stream = torch.randint(2, 60, (4000,), generator=torch.Generator().manual_seed(3))
    return make_natural_probe(stream, n=24, seq_len=32, bos_token_id=BOS if bos else None, source="test")


def test_bos_windows_take_the_circuit_layer_from_the_bos_free_twin():
    model = planted.p0_final()  # block 0 amplifies position 0 along a fixed direction; later heads sink onto it
    plain = Monitor([_natural(False), InductionProbe(n=8, seq_len=64)]).probe(model).to_record()
    bos = Monitor([_natural(True), InductionProbe(n=8, seq_len=64)]).probe(model).to_record()
    assert plain["circuit_layer"] == 0 and plain["p0_stage_now"] == "final" and "circuit_source" not in plain
    assert bos["circuit_layer"] == 0  # without the twin: None (no pair of different first tokens)
    assert bos["p0_stage_now"] == "final"
    assert bos["circuit_source"] == "natural_bos_free_twin"
    assert bos["sink_rate"] > 0  # sink keys are those of the windows as fed, BOS included


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
    """Issue 24's BOS-trained 270M profile, planted: sink rate ~0.77 (block 0 ~0.6), the BOS's norm
    ~24-29x after block 0, the BOS-free twin ~1x and sink-free. The stage is final, the anchor the BOS."""
    bos, plain = _planted_bos_records()
    assert bos["sink_rate"] == pytest.approx(0.8) and bos["sink_rate_per_layer"][0] == pytest.approx(2 / 3)
    assert bos["sink_center"] == 0 and bos["sink_positions"] == 1
    assert all(20 < r < 30 for r in bos["p0_norm_ratio_bos"])  # amplified from block 0 on
    assert bos["circuit_layer_bos"] == 0 and bos["circuit_layer_twin"] is None  # no positional circuit
    assert (bos["p0_anchor"], bos["circuit_layer"], bos["circuit_source"]) == ("bos", 0, "natural")
    assert bos["p0_stage_now"] == "final"
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
