"""Each metric of docs/design.md §5 on hand-built inputs whose answer is known."""

import numpy as np
import pytest
import torch

from sinkwatch import metrics as M


def test_sink_alpha_averages_over_queries_at_or_after_k():
    """alpha_k averages only over queries at or after key k; k >= S is undefined."""
    S, K = 5, 3
    first = torch.zeros(1, 1, S, K)
    first[0, 0, :, 0] = torch.tensor([1.0, 0.5, 0.2, 0.2, 0.1])
    first[0, 0, :, 2] = torch.tensor([0.0, 0.0, 0.6, 0.3, 0.0])
    alpha = M.sink_alpha(first)
    assert alpha[0, 0, 0].item() == pytest.approx(2.0 / 5)
    assert alpha[0, 0, 2].item() == pytest.approx(0.9 / 3)  # queries 2, 3, 4 only
    assert torch.isnan(M.sink_alpha(torch.zeros(1, 1, 2, 4))[0, 0, 3])  # k >= S: undefined


def test_sink_fractions_use_a_strict_epsilon_per_sample():
    """Sink fractions count alpha > epsilon strictly, per sample; the sink centre follows the mass."""
    alpha = np.zeros((2, 2, 2, 3))  # (N, L, H, K)
    alpha[0, 0, 0, 0] = 0.3  # not > 0.3
    alpha[0, 0, 1, 0] = 0.31
    alpha[1, 1, :, 0] = 0.9
    alpha[1, 1, 0, 1] = 0.5
    alpha[..., 2] = np.nan
    f = M.sink_fractions(alpha)
    assert f["rate"] == pytest.approx(3 / 8)
    assert f["per_layer"].tolist() == pytest.approx([1 / 4, 2 / 4])
    assert f["profile"].tolist() == pytest.approx([3 / 8, 1 / 8, 0.0])
    assert M.sink_center(alpha) == 0
    alpha[..., 1] += 0.6
    assert M.sink_center(alpha) == 1
    # relative to the largest Sink_k (a quarter of 0.5), and above the floor
    assert M.sink_positions(np.array([0.5, 0.06, 0.04, 0.2]), 0.25, 0.02) == 2
    assert M.sink_positions(np.array([0.5, 0.125, 0.04, 0.2]), 0.25, 0.02) == 3  # inclusive
    assert M.sink_positions(np.array([0.01, 0.01, 0.0]), 0.25, 0.02) == 0  # no position reaches the floor
    assert M.sink_positions(np.array([np.nan, 0.3]), 0.25, 0.02) == 1


def test_p0_circuit_emergence_persistence_concentration():
    """The circuit description on hand-made rho profiles (docs/stages.md)."""
    kw = dict(min_ratio=2.0, min_consistency=0.8, min_persistence=0.5)
    # SmolLM2's shape: a small precursor at blocks 1-2 that falls back, then x170 from block 5 on
    rho = np.array([1.2, 3.0, 9.8, 1.0, 1.0, 170.0, 160.0, 150.0])
    c = np.ones(8)
    got = M.p0_circuit(rho, 1.0, c, **kw)
    assert (got["p0_emergence_block"], got["circuit_layer"], got["rho_max_block"]) == (5, 5, 5)
    assert got["p0_persistence"] == 1.0
    assert got["p0_concentration"] == pytest.approx(np.log(3.0) / np.log(170.0))
    assert M.p0_circuit(rho, 1.0, np.where(np.arange(8) == 5, 0.5, 1.0), **kw)["circuit_layer"] is None  # no stable direction
    assert M.p0_circuit(rho, 1.0, None, **kw)["circuit_layer"] == 5  # the BOS anchor: no direction test
    # a random stack: block 0 stands out, the next block undoes it
    rnd = M.p0_circuit(np.array([2.2, 1.6, 1.4, 1.3]), 1.0, np.zeros(4), **kw)
    assert rnd["p0_persistence"] == 0.0 and rnd["circuit_layer"] is None
    assert rnd["p0_emergence_block"] is None and np.isnan(rnd["p0_concentration"])  # nothing amplified: no block, no share
    assert rnd["rho_max"] == 2.2 and rnd["rho_max_block"] == 0  # the profile itself is still reported
    # amplified and persisting but pointing nowhere: the block and the share are reported, no circuit
    wobbly = M.p0_circuit(rho, 1.0, np.zeros(8), **kw)
    assert wobbly["p0_emergence_block"] == 5 and wobbly["p0_concentration"] > 0 and wobbly["circuit_layer"] is None
    # gains are measured from the embeddings; nothing above 1: no concentration
    assert M.p0_circuit(np.array([30.0, 30.0]), 1.0, None, **kw)["p0_concentration"] == 1.0
    # the embeddings already set position 0 apart (a learned position embedding): as shallow as it gets
    assert M.p0_circuit(np.array([30.0, 30.0]), 30.0, None, **kw)["p0_concentration"] == 1.0
    flat = M.p0_circuit(np.array([0.9, 0.95]), 1.0, None, **kw)
    assert np.isnan(flat["p0_concentration"]) and flat["circuit_layer"] is None
    last = M.p0_circuit(np.array([1.0, 1.0, 50.0]), 1.0, None, **kw)  # the last block: nothing after it to persist
    assert last["p0_emergence_block"] is None and np.isnan(last["p0_persistence"]) and last["circuit_layer"] is None
    assert np.isnan(last["p0_concentration"])


def test_selectivity_columns_and_scores():
    """Selectivity columns sit at the protocol's positions and scores divide by the baseline."""
    T = 64
    ab = np.array([20, 25])
    base = np.arange(1, 51)
    cols, layout = M.selectivity_columns(T, ab, base)
    assert cols[0, layout["induction"]].tolist() == [21] and cols[1, layout["duplicate"]].tolist() == [25]
    assert cols[0, layout["previous"]].tolist() == [62] and cols[0, layout["self"]].tolist() == [63]
    assert cols[0, layout["first"]].tolist() == [0] and cols[0, layout["local"]].tolist() == [61, 60, 59, 58]
    G = cols.shape[1]
    g = np.full((2, 1, 1, G), 0.01)
    g[:, 0, 0, 0] = [0.6, 0.2]  # induction
    g[0, 0, 0, 4] = 0.7  # first token, sequence 0
    valid = np.array([True, False])
    sel = M.selectivity(g, layout, valid)
    assert sel["induction"][0, 0] == pytest.approx(0.6 / 0.01)  # only the valid sequence
    assert sel["first"][0, 0] == pytest.approx((0.7 + 0.01) / 2 / 0.01)  # all sequences
    assert sel["local"][0, 0] == pytest.approx(1.0)
    best = M.best_class(sel)
    assert best[0, 0] == "induction"
    sel_none = M.selectivity(g, layout, np.array([False, False]))
    assert (sel_none["induction"] == 0).all()  # the paper's convention: 0 with no valid sequence
    assert M.best_class(sel_none)[0, 0] == "first"


def test_head_screen_thresholds_are_inclusive():
    """Head-screen thresholds (30x, 50x) are inclusive."""
    z = np.zeros((2, 2))
    scores = {c: z.copy() for c in M.SELECTIVITY_CLASSES}
    scores["first"][1] = [30.0, 29.99]
    scores["induction"][0] = [50.0, 30.0]
    scores["previous"][1, 1] = 100.0
    best = M.best_class(scores)
    s = M.head_screen(scores, best)
    assert s["sink_heads_per_layer"] == [0, 1]
    assert s["induction_heads"] == ["L0H0"] and s["n_induction_ge50"] == 1 and s["n_induction_ge30"] == 2
    assert s["previous_token_heads"] == ["L1H1"]
    assert s["bos_fraction_raw"] == 0.25 and s["bos_fraction_bestclass"] == 0.25


def test_participation_ratio_matches_svd_and_its_range():
    """PR equals the SVD formula, spans 1 .. d_head, and is NaN for zero or NaN input."""
    rng = np.random.RandomState(0)
    M_ = rng.randn(40, 6) * np.array([5, 1, 1, 0.1, 0.1, 0.1])
    s = np.linalg.svd(M_, compute_uv=False)
    p = s**2 / (s**2).sum()
    expected = np.exp(-(p * np.log(p)).sum())
    assert M.participation_ratio(M_.T @ M_) == pytest.approx(expected, rel=1e-9)
    assert M.participation_ratio(np.eye(6)) == pytest.approx(6.0)  # isotropic: d_head
    rank1 = np.outer(np.ones(6), np.ones(6))
    assert M.participation_ratio(rank1) == pytest.approx(1.0)
    assert M.participation_ratio(np.zeros((6, 6))) == 1.0  # the paper's code: an all-zero M has PR 1
    assert np.isnan(M.participation_ratio(np.full((6, 6), np.nan)))  # NaN activations: undefined, no crash
    c = M_ - M_.mean(0)
    lam = np.linalg.eigvalsh(c.T @ c / 40)
    assert M.participation_ratio_classical(M_.T @ M_, M_.sum(0), 40) == pytest.approx(lam.sum() ** 2 / (lam**2).sum(), rel=1e-9)


def test_repeated_probe_rows_and_copy_losses():
    """Repeated-probe query rows, copy losses and the ICL and induction scores follow their definitions."""
    rows, cols = M.repeated_query_columns(4, 2)
    assert rows[0].tolist() == [4, 5, 6, 7] and cols[0, :, 0].tolist() == [1, 2, 3, 4]
    loss = torch.arange(7.0)[None]  # column t predicts t + 1, 2L - 1 = 7 columns
    first, second = M.copy_losses(loss, 4)
    assert first.item() == pytest.approx(np.mean([0, 1, 2]))  # positions 1..3
    assert second.item() == pytest.approx(np.mean([4, 5, 6]))  # positions 5..7
    assert M.icl_score(np.array([3.0, 5.0]), np.array([1.0, 1.0])) == pytest.approx(-3.0)
    assert M.induction_score(np.ones((3, 2, 2)) * 0.5).tolist() == [[0.5, 0.5], [0.5, 0.5]]


def test_p0_norm_ratio_uses_true_medians():
    """The position-0 norm ratio uses true medians (even counts averaged)."""
    norms = torch.tensor([[10.0, 1.0, 2.0, 3.0, 4.0]])  # median of 1..4 is 2.5
    assert M.norm_ratio_per_sequence(norms).item() == pytest.approx(4.0)
    assert M.p0_norm_ratio(np.array([[1.0], [3.0], [10.0], [20.0]]))[0] == pytest.approx(6.5)


def test_direction_consistency_skips_same_token_pairs():
    """Direction consistency averages only pairs with different first tokens."""
    v = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    # pairs with different first tokens: (0,2) and (1,2): both orthogonal
    assert M.direction_consistency(v, np.array([5, 5, 6])) == pytest.approx(0.0)
    assert M.direction_consistency(v, np.array([5, 6, 7])) == pytest.approx(1 / 3)
    assert np.isnan(M.direction_consistency(v, np.array([1, 1, 1])))
    rng = np.random.RandomState(1)
    x, t = rng.randn(12, 4), rng.randint(0, 4, 12)
    pairs = [x[i] @ x[j] / np.linalg.norm(x[i]) / np.linalg.norm(x[j]) for i in range(12) for j in range(12) if i != j and t[i] != t[j]]
    assert M.direction_consistency(x, t) == pytest.approx(np.mean(pairs))


def test_circuit_layer_is_the_first_block_meeting_both_and_held_by_the_next():
    """The circuit layer: the first block meeting the norm and consistency thresholds whose next
    block is still amplified (the last block needs only its own)."""
    rho = np.array([1.0, 8.0, 9.0, 7.0])
    c = np.array([1.0, 0.5, 0.95, 1.0])
    assert M.circuit_layer(rho, c, 5.0, 0.9) == 2
    assert M.circuit_layer(rho, c, 10.0, 0.9) is None
    spike = np.array([6.0, 1.0, 1.0, 1.0])  # block 0 amplifies, block 1 undoes it: no circuit
    assert M.circuit_layer(spike, np.ones(4), 5.0, 0.9) is None
    assert M.circuit_layer(np.array([1.0, 1.0, 1.0, 6.0]), np.ones(4), 5.0, 0.9) == 3  # the last block
    assert M.circuit_layer(np.array([1.0, 6.0, 6.0, 1.0]), None, 5.0) == 1  # no direction test (BOS anchor)
    assert M.circuit_layer(np.array([1.0, 6.0, np.nan, 6.0]), np.ones(4), 5.0, 0.9) == 3  # NaN is not amplified


def test_target_scores_and_controls():
    """Target loss/top-k and the matched random control heads follow their definitions."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 3.0, 4.0, -1.0], [9.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    s = M.target_scores(logits, torch.tensor([1, 2]))
    assert s["top1"] == 0.5 and s["top5"] == 0.5
    lp = torch.log_softmax(logits, -1)
    assert s["loss"] == pytest.approx(float(-(lp[0, 1] + lp[1, 2]) / 2))
    ctrl = M.matched_random_heads([(0, 1), (0, 2), (3, 0)], n_heads=4)
    assert sorted(l for l, _ in ctrl) == [0, 0, 3]
    assert not {(0, 1), (0, 2), (3, 0)} & set(ctrl)
    assert ctrl == M.matched_random_heads([(3, 0), (0, 2), (0, 1)], n_heads=4)  # order-free, seeded
    with pytest.raises(ValueError, match="disjoint"):
        M.matched_random_heads([(0, 0), (0, 1)], n_heads=3)


def test_circuit_recall():
    """Circuit recall is the fraction of the final set found; undefined for an empty final set."""
    assert M.circuit_recall({"L1H1"}, {"L1H1", "L2H2"}) == 0.5
    assert M.circuit_recall([], []) is None
