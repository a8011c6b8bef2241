"""Probe sets (docs/design.md §3): the paper's induction batch reproduced exactly, hashing, storage."""

import numpy as np
import pytest
import torch

from sinkwatch import (
    InductionProbe,
    NaturalProbe,
    ProbeSet,
    RepeatedRandomProbe,
    make_induction_probe,
    make_natural_probe,
    make_repeated_random_probe,
)
from sinkwatch.probes import baseline_positions, read_text_tokens, resolve_vocab_range


def spec_induction_batch(n, T, lo, hi, seed=42):
    """docs/design.md §3, transcribed independently: returns tokens and ab."""
    rng = np.random.RandomState(seed)
    toks, abs_ = [], []
    for _ in range(n):
        seq = rng.randint(lo, hi, size=T)
        A, B = rng.choice(np.arange(lo, hi), size=2, replace=False)
        ab = rng.randint(20, T // 2)
        seq[ab] = A
        seq[ab + 1] = B
        for i in range(T):
            if seq[i] == A and i != ab:
                seq[i] = rng.randint(lo, hi)
        for i in range(T):
            if seq[i] == B and i != ab + 1:
                seq[i] = rng.randint(lo, hi)
        seq[T - 1] = A
        toks.append(seq.copy())
        abs_.append(ab)
    return np.array(toks), np.array(abs_)


def test_paper_induction_probe_follows_the_protocol():
    """The induction probe reproduces the paper's generation protocol token for token."""
    probe = make_induction_probe(2000, 256)
    tokens, ab = spec_induction_batch(2000, 256, 100, 10000)
    assert np.array_equal(probe.tokens.numpy(), tokens)
    assert np.array_equal(probe.fields["ab"], ab)
    assert probe.tokens.min() >= 100 and probe.tokens.max() < 10000
    assert ((20 <= ab) & (ab < 128)).all()
    A, B = probe.fields["token_a"], probe.fields["token_b"]
    rows = np.arange(2000)
    assert (probe.tokens.numpy()[rows, ab] == A).all() and (probe.tokens.numpy()[rows, ab + 1] == B).all()
    assert (probe.tokens.numpy()[:, 255] == A).all()
    assert (probe.fields["query_row"] == 255).all()
    # validity: B exactly once in tokens[:-1]
    valid = [np.count_nonzero(probe.tokens.numpy()[s, :-1] == B[s]) == 1 for s in range(2000)]
    assert np.array_equal(probe.fields["valid"].astype(bool), valid)


def test_first_500_of_2000_are_the_500_sequence_probe():
    """The first 500 sequences of the 2000-sequence probe are the 500-sequence probe."""
    big, small = make_induction_probe(2000, 256), make_induction_probe(500, 256)
    assert torch.equal(big.tokens[:500], small.tokens)
    assert big.subset(500).hash == small.hash


def test_paper_probe_hash_is_stable_across_versions():
    # Pinned: replay stores and resumed runs compare this hash; changing the generator must be deliberate.
    """The paper probe's hash is the published constant."""
    assert make_induction_probe(500, 256).hash == PAPER_500_HASH


PAPER_500_HASH = "67f606a0dff8504c"


def test_baseline_positions_follow_the_protocol():
    """Baseline positions are 50 distinct positions in the protocol's range."""
    pos = baseline_positions(256)
    assert len(pos) == len(set(pos.tolist())) == 50
    assert all(1 <= p < 250 for p in pos)
    rng = np.random.RandomState(0)
    first = rng.randint(1, 255)
    assert pos[0] == first or first in (0, *range(250, 256))


def test_repeated_random_probe():
    """The repeated-random probe is R followed by R, independent of the vocabulary size."""
    probe = make_repeated_random_probe(8, 16, vocab_range=(5, 50), seed=1)
    R = np.random.RandomState(1).randint(5, 50, size=(8, 16))
    assert np.array_equal(probe.tokens.numpy(), np.concatenate([R, R], 1))
    assert RepeatedRandomProbe(n=8, seq_len=32, vocab_range=(5, 50)).build(100).hash == probe.hash


def test_natural_probe_from_stream_rows_and_bos():
    """Natural windows are cut from a stream or rows, optionally after a BOS token."""
    stream = torch.arange(1000) % 97
    p = make_natural_probe(stream, n=5, seq_len=20)
    assert torch.equal(p.tokens[1], stream[20:40])
    p_bos = make_natural_probe(stream, n=5, seq_len=20, bos_token_id=96)
    assert (p_bos.tokens[:, 0] == 96).all() and torch.equal(p_bos.tokens[0, 1:], stream[:19])
    rows = make_natural_probe(torch.arange(300).view(10, 30), n=4, seq_len=25)
    assert rows.tokens.shape == (4, 25)
    with pytest.raises(ValueError, match="need 60"):
        make_natural_probe(stream, n=60, seq_len=20)


def test_natural_probe_from_text_file(tmp_path, char_tokenizer):
    """A natural probe read from a text file holds its first tokens."""
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    probe = NaturalProbe(text_file=str(text), tokenizer=char_tokenizer, n=10, seq_len=32).build(char_tokenizer.vocab_size)
    ids = read_text_tokens(text, char_tokenizer)
    assert probe.tokens.shape == (10, 32)
    assert torch.equal(probe.tokens.flatten(), ids[:320])
    assert probe.params["source"] == "corpus.txt"


def test_hash_roundtrip_and_sensitivity(tmp_path):
    """A saved probe loads with its hash; any change to tokens, fields or params changes the hash."""
    p = make_induction_probe(20, 64, vocab_range=(10, 200))
    q = ProbeSet.load(p.save(tmp_path / "p.npz"))
    assert q.hash == p.hash and torch.equal(q.tokens, p.tokens) and q.kind == p.kind and q.params == p.params
    for name in p.fields:
        assert np.array_equal(q.fields[name], p.fields[name])
    changed = p.tokens.clone()
    changed[3, 7] += 1
    assert ProbeSet(p.kind, changed, p.fields, p.params).hash != p.hash
    assert ProbeSet(p.kind, p.tokens, {**p.fields, "ab": p.fields["ab"] + 1}, p.params).hash != p.hash
    assert ProbeSet(p.kind, p.tokens, p.fields, {**p.params, "seed": 1}).hash != p.hash


def test_corrupt_probe_file_is_refused(tmp_path):
    """A probe file whose tokens do not match its stored hash is refused."""
    p = make_repeated_random_probe(4, 8, vocab_range=(0, 20))
    data = bytearray(p.to_bytes())
    bad = ProbeSet("repeated", p.tokens + 1, {}, p.params).to_bytes()
    # splice: keep the stored hash of p but another probe's tokens
    import io
    import json
    z = dict(np.load(io.BytesIO(bad)))
    z["meta"] = np.frombuffer(json.dumps({"kind": "repeated", "params": p.params, "hash": p.hash}).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **z)
    (tmp_path / "x.npz").write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="corrupt"):
        ProbeSet.load(tmp_path / "x.npz")
    assert ProbeSet.from_bytes(bytes(data)).hash == p.hash


def test_vocab_range_adapts_to_small_vocabularies():
    """The vocabulary range adapts to small vocabularies and refuses one that cannot fit."""
    assert resolve_vocab_range(50304) == (100, 10000)
    assert resolve_vocab_range(256) == (100, 256)
    assert resolve_vocab_range(150) == (0, 150)
    with pytest.raises(ValueError, match="too small"):
        resolve_vocab_range(2)
    with pytest.raises(ValueError, match="--vocab-range"):
        InductionProbe(vocab_range=(100, 10000)).build(256)
    assert InductionProbe(n=3, seq_len=64).build(256).tokens.max() < 256


def test_recipes_validate_arguments():
    """Probe recipes refuse bad arguments at construction."""
    with pytest.raises(ValueError, match="seq_len"):
        InductionProbe(seq_len=40)
    with pytest.raises(ValueError, match="even"):
        RepeatedRandomProbe(seq_len=31)
    with pytest.raises(ValueError, match="exactly one"):
        NaturalProbe()
    with pytest.raises(ValueError, match="tokenizer"):
        NaturalProbe(text_file="x.txt")
    with pytest.raises(ValueError, match="positive"):
        InductionProbe(n=0)


def test_out_of_vocabulary_tokens_are_refused():
    """A probe with tokens beyond the vocabulary is refused with the vocabulary size."""
    p = make_natural_probe(torch.arange(500), n=4, seq_len=100)
    with pytest.raises(ValueError, match="vocabulary has 300"):
        p.check_vocab(300)
