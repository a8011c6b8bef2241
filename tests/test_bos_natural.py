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
    plain = Monitor([_natural(False), InductionProbe(n=8, seq_len=64)]).probe(model, track=False).to_record()
    bos = Monitor([_natural(True), InductionProbe(n=8, seq_len=64)]).probe(model, track=False).to_record()
    assert plain["circuit_layer"] == 0 and plain["p0_stage_now"] == "final" and "circuit_source" not in plain
    assert bos["circuit_layer"] == 0  # without the twin: None (no pair of different first tokens)
    assert bos["p0_stage_now"] == "final"
    assert bos["circuit_source"] == "natural_bos_free_twin"
    assert bos["sink_rate"] > 0  # sink keys are those of the windows as fed, BOS included


def test_undecidable_p0_stage_is_warned():
    tokens = torch.randint(2, 60, (24, 31), generator=torch.Generator().manual_seed(4))
    tokens[:, 0] = 7  # BOS, then the same second token everywhere: no pair to compare, twin or not
    probe = make_natural_probe(tokens, n=24, seq_len=31, bos_token_id=BOS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = Monitor([probe]).probe(planted.p0_final(), track=False).to_record()
    assert record["circuit_layer"] is None
    assert any("undecidable" in str(w.message) for w in caught)


@pytest.mark.parametrize("bos", [False, True])
def test_probe_hash_does_not_include_the_twin(bos):
    m = Monitor([_natural(bos)])
    assert set(m.probe_hashes(64)) == {"natural"}
