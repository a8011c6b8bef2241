"""An independent computation of every record metric, from eager attention with output_attentions=True.

Shares nothing with sinkwatch: it materialises the attention matrices with the model's own eager
implementation, reads residual streams and output-projection inputs through its own hooks, and
re-derives every definition of docs/design.md §5 with plain numpy loops. The tests compare the two.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from tiny_models import OUTPUT_PROJECTION


def blocks_of(model):
    for path in ("gpt_neox.layers", "model.layers", "transformer.h"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return list(obj)
        except AttributeError:
            continue
    raise AssertionError("unknown model layout")


# What each family's sublayers write into the residual stream, named here independently of sinkwatch's
# lookup: the attention / MLP module's output, or the post-norm that takes it (Gemma 3, OLMo 2)
WRITTEN = {
    "gpt_neox": {"attention": "attention", "mlp": "mlp"},
    "gpt2": {"attention": "attn", "mlp": "mlp"},
    "gemma3": {"attention": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"},
    "gemma3_text": {"attention": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"},
    "olmo2": {"attention": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"},
}
DEFAULT_WRITTEN = {"attention": "self_attn", "mlp": "mlp"}  # llama, olmo, olmoe, qwen2, qwen3


def _first(o):
    return (o[0] if isinstance(o, (tuple, list)) else o).double()


def eager_run(model, family: str, tokens: torch.Tensor) -> dict:
    """Attention (N, L, H, S, S) float64, block outputs (N, L, S, d), o_proj inputs (N, L, S, H*D), logits;
    block 0's input (N, S, d) and what each block's attention and MLP write (N, L, S, d)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    blocks = blocks_of(model)
    resid, oproj, written, emb = {}, {}, {"attention": {}, "mlp": {}}, {}
    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_hook(lambda m, a, o, i=i: resid.__setitem__(i, _first(o))))
        proj = block.get_submodule(OUTPUT_PROJECTION[family])
        handles.append(proj.register_forward_pre_hook(lambda m, a, i=i: oproj.__setitem__(i, a[0].double())))
        for kind, name in WRITTEN.get(family, DEFAULT_WRITTEN).items():
            sub = block.get_submodule(name)
            handles.append(sub.register_forward_hook(lambda m, a, o, i=i, kind=kind: written[kind].__setitem__(i, _first(o))))
    handles.append(
        blocks[0].register_forward_pre_hook(
            lambda m, a, kw: emb.__setitem__(0, (a[0] if a else kw["hidden_states"]).double()), with_kwargs=True
        )
    )
    try:
        with torch.no_grad():
            out = model(input_ids=tokens, output_attentions=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(previous)
    L = len(blocks)
    return {
        "attn": torch.stack([a.double() for a in out.attentions], dim=1).numpy(),
        "resid": torch.stack([resid[i] for i in range(L)], dim=1).numpy(),
        "oproj": torch.stack([oproj[i] for i in range(L)], dim=1).numpy(),
        "logits": out.logits.double().numpy(),
        "emb": emb[0].numpy(),
        "written": {kind: torch.stack([w[i] for i in range(L)], dim=1).numpy() for kind, w in written.items()},
    }


# ---- docs/design.md §5, re-derived -----------------------------------------------------------------------------
def sink_metrics(attn: np.ndarray, K: int = 8, eps: float = 0.3) -> dict:
    N, L, H, S, _ = attn.shape
    alpha = np.zeros((N, L, H, K))
    for k in range(K):
        alpha[..., k] = attn[:, :, :, k:, k].mean(axis=-1) if k < S else np.nan
    ind = alpha > eps
    return {
        "alpha": alpha,
        "sink_rate": ind[..., 0].mean(),
        "sink_profile": ind.mean(axis=(0, 1, 2)),
        "sink_rate_per_layer": ind[..., 0].mean(axis=(0, 2)),
        "sink_alpha": alpha[..., 0].mean(axis=0),
        "sink_center": int(np.argmax(alpha.mean(axis=(0, 1, 2)))),
    }


def baseline_50(T: int) -> list[int]:
    rng = np.random.RandomState(0)
    got = []
    while len(got) < 50:
        p = rng.randint(1, T - 1)
        if p == 0 or p >= T - 6 or p in got:
            continue
        got.append(p)
    return got


def selectivity_metrics(attn: np.ndarray, tokens: np.ndarray, ab: np.ndarray, token_b: np.ndarray) -> dict:
    N, L, H, T, _ = attn.shape
    row = attn[:, :, :, T - 1, :]  # (N, L, H, T)
    base = row[:, :, :, baseline_50(T)].mean(axis=-1).mean(axis=0)
    valid = np.array([list(tokens[n, :-1]).count(token_b[n]) == 1 for n in range(N)])
    idx = np.arange(N)
    cls = {
        "induction": row[idx, :, :, ab + 1][valid].mean(axis=0),
        "duplicate": row[idx, :, :, ab][valid].mean(axis=0),
        "previous": row[:, :, :, T - 2].mean(axis=0),
        "self": row[:, :, :, T - 1].mean(axis=0),
        "first": row[:, :, :, 0].mean(axis=0),
        "local": row[:, :, :, [T - 3, T - 4, T - 5, T - 6]].mean(axis=-1).mean(axis=0),
    }
    sel = {k: v / base for k, v in cls.items()}
    names = list(sel)
    best = np.empty((L, H), dtype=object)
    for l, h in itertools.product(range(L), range(H)):
        vals = [sel[c][l, h] for c in names]
        best[l, h] = names[int(np.argmax(vals))] if max(vals) >= 30 else "unclassified"
    sink = sel["first"] >= 30
    return {
        "selectivity": sel,
        "best_class": best,
        "sink_heads_per_layer": sink.sum(axis=1).tolist(),
        "bos_fraction_raw": sink.mean(),
        "bos_fraction_bestclass": (best == "first").mean(),
        "induction_heads": [f"L{l}H{h}" for l, h in itertools.product(range(L), range(H)) if sel["induction"][l, h] >= 50],
        "n_induction_ge30": int((sel["induction"] >= 30).sum()),
        "n_induction_ge50": int((sel["induction"] >= 50).sum()),
        "valid": valid,
    }


def participation_ratio(oproj: np.ndarray, n_heads: int) -> np.ndarray:
    N, L, S, width = oproj.shape
    D = width // n_heads
    out = np.zeros((L, n_heads))
    for l, h in itertools.product(range(L), range(n_heads)):
        M = oproj[:, l, S - 1, h * D : (h + 1) * D]  # (N, D), uncentered
        s = np.linalg.svd(M, compute_uv=False)
        p = s**2 / (s**2).sum()
        p = p[p > 0]
        out[l, h] = np.exp(-(p * np.log(p)).sum())
    return out


def prefix_metrics(attn: np.ndarray, logits: np.ndarray, tokens: np.ndarray, half: int) -> dict:
    N, L, H, S, _ = attn.shape
    score = np.zeros((L, H))
    for i in range(half, 2 * half):
        score += attn[:, :, :, i, i - half + 1].mean(axis=0)
    score /= half
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]  # column t predicts t+1
    first = np.mean([nll[:, t - 1] for t in range(1, half)])
    second = np.mean([nll[:, t - 1] for t in range(half + 1, 2 * half)])
    return {"induction_score": score, "icl_score": second - first}


def _ratio(x: np.ndarray) -> np.ndarray:
    """||x[..., 0, :]|| / median_{t>=1} ||x[..., t, :]||, then the median over sequences (axis 0)."""
    norms = np.linalg.norm(x, axis=-1)
    return np.median(norms[..., 0] / np.median(norms[..., 1:], axis=-1), axis=0)


def _mean_cosine(vectors: np.ndarray, first: np.ndarray) -> float:
    cos = []
    for i, j in itertools.combinations(range(len(vectors)), 2):
        if first[i] != first[j]:
            a, b = vectors[i], vectors[j]
            cos.append(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    return float(np.mean(cos)) if cos else np.nan


def p0_metrics(resid: np.ndarray, tokens: np.ndarray, emb: np.ndarray | None = None, written: dict | None = None) -> dict:
    """rho and direction consistency after each block (uncentred; centred on each sequence's mean of
    the other positions); with ``emb`` (N, S, d) rho before block 0, with ``written`` {kind: (N, L, S, d)}
    rho of what each block's attention and MLP write."""
    N, L, S, d = resid.shape
    out = {
        "p0_norm_ratio": _ratio(resid),
        "p0_direction_consistency": np.array([_mean_cosine(resid[:, l, 0], tokens[:, 0]) for l in range(L)]),
        "p0_direction_consistency_centered": np.array(
            [_mean_cosine(resid[:, l, 0] - resid[:, l, 1:].mean(axis=1), tokens[:, 0]) for l in range(L)]
        ),
    }
    if emb is not None:
        out["p0_norm_ratio_embeddings"] = float(_ratio(emb))
    for kind, key in (("attention", "p0_attn_norm_ratio"), ("mlp", "p0_mlp_norm_ratio")):
        if written is not None:
            out[key] = _ratio(written[kind])
    return out


def p0_circuit(rho, rho_emb, consistency, R: float, C: float, P: float, shallow: int = 2) -> dict:
    """docs/stages.md's circuit description, re-derived with loops: the emergence block (largest gain
    in log rho, block 0's over the embeddings), its persistence, the concentration within blocks
    0..shallow-1, the circuit layer; ``consistency`` None: no direction test (the BOS anchor). The emergence
    block and the concentration only where position 0 is amplified: some block >= R that persists (>= P)."""
    L = len(rho)
    logs = [np.log(rho_emb)] + [np.log(r) for r in rho]
    gains = [logs[l + 1] - logs[l] for l in range(L)]
    e = max(range(L), key=lambda l: gains[l])
    top = max(range(L), key=lambda l: rho[l])
    later = [rho[l] >= R for l in range(e + 1, L)]
    persistence = sum(later) / len(later) if later else np.nan
    concentration = min(1.0, max(0.0, max(logs[1 : shallow + 1]) / logs[top + 1])) if rho[top] > 1 else np.nan  # from 1: not amplified
    # amplified: some block >= R with >= P of the blocks after it >= R; else no emergence block, no concentration
    amplified = any(rho[b] >= R and b + 1 < L and sum(rho[k] >= R for k in range(b + 1, L)) / (L - b - 1) >= P for b in range(L))
    ok = rho[e] >= R and persistence >= P and (consistency is None or consistency[e] >= C)
    return {
        "rho_max": rho[top], "rho_max_block": top, "p0_emergence_block": e if amplified else None, "p0_persistence": persistence,
        "p0_concentration": concentration if amplified else np.nan, "circuit_layer": e if ok else None,
    }  # fmt: skip


def check_p0(record: dict, p0: dict, cfg) -> None:
    """A record's position-0 keys against ``p0_metrics`` (a positional anchor: windows whose first tokens differ)."""
    close(record["p0_norm_ratio"], p0["p0_norm_ratio"], rtol=RATIO_RTOL)
    close(record["p0_direction_consistency"], p0["p0_direction_consistency"], atol=1e-5)
    close(record["p0_direction_consistency_centered"], p0["p0_direction_consistency_centered"], atol=1e-5)
    for key in ("p0_attn_norm_ratio", "p0_mlp_norm_ratio"):
        if key in p0:
            close(record[key], p0[key], rtol=RATIO_RTOL)
    rho_emb = p0.get("p0_norm_ratio_embeddings")
    if rho_emb is not None:
        assert record["p0_norm_ratio_embeddings"] == pytest.approx(rho_emb, rel=RATIO_RTOL)
    want = p0_circuit(
        p0["p0_norm_ratio"], record["p0_norm_ratio_embeddings"], p0["p0_direction_consistency_centered"],
        cfg.circuit_min_norm_ratio, cfg.circuit_min_consistency, cfg.circuit_min_persistence, cfg.final_max_circuit_layer + 1,
    )  # fmt: skip
    for key, value in want.items():
        if isinstance(value, float) and np.isnan(value):
            assert record[key] is None, key  # NaN is written as null
        elif isinstance(value, float):
            assert record[key] == pytest.approx(value, rel=RATIO_RTOL, abs=1e-6), key
        else:
            assert record[key] == value, key
    amplified = p0["p0_norm_ratio"] >= cfg.circuit_min_norm_ratio  # earlier sinkwatch's circuit layer: the first block >= R
    ok = amplified & np.append(amplified[1:], True) & (p0["p0_direction_consistency"] >= cfg.circuit_min_consistency)
    assert record["circuit_layer_first"] == (int(np.argmax(ok)) if ok.any() else None)


def target_metrics(logits_last: np.ndarray, targets: np.ndarray) -> dict:
    z = logits_last - logits_last.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    loss = -logp[np.arange(len(targets)), targets].mean()
    order = np.argsort(-logits_last, axis=-1)
    return {"loss": loss, "top1": (order[:, 0] == targets).mean(), "top5": np.mean([t in o[:5] for t, o in zip(targets, order)])}


# ---- a whole record against the re-derivations --------------------------------------------------------
# Named tolerances (float32 statistics vs float64 eager re-computation)
PROB_ATOL = 2e-5  # attention probabilities and their means
RATIO_RTOL = 1e-4  # selectivity, PR, norm ratios: ratios of float32 means
RATIO_ATOL = 1e-6  # ... whose near-zero cells are float32 denormals (1e-42) on trained models
LOSS_ATOL = 1e-4  # ICL score, target loss (nats)


def close(a, b, *, atol=0.0, rtol=0.0) -> None:
    """Two arrays of one shape, equal within ``atol`` + ``rtol`` x |b|."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


def induction_ab(probe) -> np.ndarray:
    """Per sequence of an induction probe set, the position of A before B's first copy: found from the
    tokens where B occurs once before the last position, else the probe's own ``ab`` field."""
    toks, b, ab = probe.tokens.numpy(), probe.fields["token_b"], probe.fields["ab"]
    once = [(toks[n, :-1] == b[n]).sum() == 1 for n in range(len(toks))]
    return np.array([int(np.flatnonzero(toks[n, :-1] == b[n])[0]) - 1 if once[n] else ab[n] for n in range(len(toks))])


def check_record(record: dict, monitor, vocab: int, eager) -> None:
    """Every record key equals its float64 re-derivation: sinks and the P0 circuit from the natural
    probe set, the selectivity screen, PR and the induction target from the induction set, prefix
    matching and ICL from the repeated-random set. ``eager(tokens)`` runs the model as ``eager_run``
    does (attn, resid, oproj, logits); ``monitor`` made the record from its ``probe_sets(vocab)``."""
    sets = {s.kind: s for s in monitor.probe_sets(vocab)}

    nat = sets["natural"]
    run = eager(nat.tokens)
    sinks = sink_metrics(run["attn"])
    close(record["sink_alpha"], sinks["sink_alpha"], atol=PROB_ATOL)
    assert record["sink_rate"] == pytest.approx(sinks["sink_rate"])
    close(record["sink_profile"], sinks["sink_profile"])
    close(record["sink_rate_per_layer"], sinks["sink_rate_per_layer"])
    assert record["sink_center"] == sinks["sink_center"]
    check_p0(record, p0_metrics(run["resid"], nat.tokens.numpy(), run.get("emb"), run.get("written")), monitor.config.stages)

    probe = sets["induction"]
    run = eager(probe.tokens)
    sel = selectivity_metrics(run["attn"], probe.tokens.numpy(), induction_ab(probe), probe.fields["token_b"])
    for cls, expected in sel["selectivity"].items():
        close(record["selectivity"][cls], expected, rtol=RATIO_RTOL, atol=RATIO_ATOL)
    assert np.array_equal(np.array(record["best_class"], dtype=object), sel["best_class"])
    for key in ("sink_heads_per_layer", "induction_heads", "n_induction_ge30", "n_induction_ge50"):
        assert record[key] == sel[key], key
    assert record["bos_fraction_raw"] == pytest.approx(sel["bos_fraction_raw"])
    assert record["bos_fraction_bestclass"] == pytest.approx(sel["bos_fraction_bestclass"])
    close(record["pr"], participation_ratio(run["oproj"], record["n_heads"]), rtol=RATIO_RTOL)
    valid = sel["valid"]
    target = target_metrics(run["logits"][valid, -1], probe.fields["token_b"][valid])
    assert record["induction_target"]["loss"] == pytest.approx(target["loss"], abs=LOSS_ATOL)
    assert record["induction_target"]["top1"] == pytest.approx(target["top1"])
    assert record["induction_target"]["top5"] == pytest.approx(target["top5"])

    rep = sets["repeated"]
    run = eager(rep.tokens)
    pm = prefix_metrics(run["attn"], run["logits"], rep.tokens.numpy(), rep.params["half_len"])
    close(record["induction_score"], pm["induction_score"], atol=PROB_ATOL)
    assert record["icl_score"] == pytest.approx(pm["icl_score"], abs=LOSS_ATOL)
