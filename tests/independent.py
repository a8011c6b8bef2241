"""An independent computation of every record metric, from eager attention with output_attentions=True.

Shares nothing with sinkwatch: it materialises the attention matrices with the model's own eager
implementation, reads residual streams and output-projection inputs through its own hooks, and
re-derives every definition of SPEC §5 with plain numpy loops. The tests compare the two.
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


def eager_run(model, family: str, tokens: torch.Tensor) -> dict:
    """Attention (N, L, H, S, S) float64, block outputs (N, L, S, d), o_proj inputs (N, L, S, H*D), logits."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    blocks = blocks_of(model)
    resid, oproj = {}, {}
    handles = []
    for i, block in enumerate(blocks):
        handles.append(
            block.register_forward_hook(lambda m, a, o, i=i: resid.__setitem__(i, (o[0] if isinstance(o, tuple) else o).double()))
        )
        proj = block.get_submodule(OUTPUT_PROJECTION[family])
        handles.append(proj.register_forward_pre_hook(lambda m, a, i=i: oproj.__setitem__(i, a[0].double())))
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
    }


# ---- SPEC §5, re-derived -----------------------------------------------------------------------------
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


def p0_metrics(resid: np.ndarray, tokens: np.ndarray) -> dict:
    N, L, S, d = resid.shape
    norms = np.linalg.norm(resid, axis=-1)  # (N, L, S)
    rho = np.median(norms[:, :, 0] / np.median(norms[:, :, 1:], axis=-1), axis=0)
    cons = np.zeros(L)
    for l in range(L):
        cos = []
        for i, j in itertools.combinations(range(N), 2):
            if tokens[i, 0] != tokens[j, 0]:
                a, b = resid[i, l, 0], resid[j, l, 0]
                cos.append(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        cons[l] = np.mean(cos) if cos else np.nan
    return {"p0_norm_ratio": rho, "p0_direction_consistency": cons}


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
    p0 = p0_metrics(run["resid"], nat.tokens.numpy())
    close(record["p0_norm_ratio"], p0["p0_norm_ratio"], rtol=RATIO_RTOL)
    close(record["p0_direction_consistency"], p0["p0_direction_consistency"], atol=1e-5)
    cfg = monitor.config.stages
    amplified = p0["p0_norm_ratio"] >= cfg.circuit_min_norm_ratio
    ok = amplified & np.append(amplified[1:], True) & (p0["p0_direction_consistency"] >= cfg.circuit_min_consistency)
    assert record["circuit_layer"] == (int(np.argmax(ok)) if ok.any() else None)  # held by the next block too (docs/stages.md)

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
