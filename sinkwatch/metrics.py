"""Metrics of docs/design.md §5 as pure functions over attention statistics.

Notation: A[l, h, i, j] is the attention probability of query i on key j in head h of layer l.
"Selectivity" is a ratio of means. Every threshold below is inclusive unless it says strict.

Sources:
- sink importance / sink rate: Gu et al. 2024, "When Attention Sink Emerges in Language Models".
- selectivity screen, participation ratio, induction circuit, sink heads: Xu 2026, "When Do
  Attention Circuits Form?" (arXiv 2606.02378), released protocol.
- prefix-matching induction score and ICL score: Olsson et al. 2022, "In-context Learning and
  Induction Heads".
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

SINK_EPSILON = 0.3  # Gu et al.: alpha_k > epsilon (strict)
SINK_PROFILE_K = 8  # Sink_0 .. Sink_{K-1}
SINK_HEAD_MIN_SELECTIVITY = 30.0  # first-token selectivity for a sink head (Xu)
BEST_CLASS_MIN_SELECTIVITY = 30.0  # below this a head is "unclassified" (Xu)
INDUCTION_CIRCUIT_MIN_SELECTIVITY = 50.0  # induction circuit (Xu)
INDUCTION_HEAD_MIN_SELECTIVITY = 30.0  # the paper's per-revision ind_ge30 count
PREVIOUS_TOKEN_MIN_SELECTIVITY = 100.0  # previous-token circuit (Xu): best class and >= 100x
SELECTIVITY_CLASSES = ("induction", "duplicate", "previous", "self", "first", "local")
# The paper's class order (its ``classes`` list): a stable sort in this order breaks ties between classes.
PAPER_CLASS_ORDER = ("induction", "previous", "duplicate", "first", "self", "local")
BASELINE_FLOOR = 1e-8  # the paper divides by max(baseline, 1e-8)
PAPER_CONTROL_SEED = 123  # RandomState of the group-ablation controls
PAPER_SWEEP_THRESHOLDS = (2.0, 10.0, 30.0, 50.0, 100.0)  # the paper's ablation sweep, in its order
UNCLASSIFIED = "unclassified"
LOCAL_OFFSETS = (3, 4, 5, 6)  # local class: mean attention on T-3 .. T-6


# ---- attention sinks (Gu et al. 2024) ---------------------------------------------------------
def sink_alpha(first: torch.Tensor) -> torch.Tensor:
    """Sink importance per sample: alpha_k = mean over queries i >= k of A[i, k].

    first: (B, H, S, K) probabilities on keys 0..K-1 for every query row 0..S-1.
    Returns (B, H, K) float32; NaN for k >= S (no query sees key k).
    """
    S, K = first.shape[-2:]
    i = torch.arange(S, device=first.device)[:, None]
    k = torch.arange(K, device=first.device)[None, :]
    sees = (i >= k).to(first.dtype)  # (S, K)
    total = (first * sees).sum(-2)
    count = sees.sum(0)
    return (total / count).float()


def learned_sink_alpha(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Importance of a learned sink (gpt-oss, OLMo-core attention sinks), averaged like alpha_0: the
    sink's probability exp(s_h - lse_i) at every query row i (every row sees it), mean over rows.

    lse: (B, H, S) row log-sum-exps that include the sink; sinks: (H,). Returns (B, H) float32.
    """
    s = sinks.to(device=lse.device, dtype=torch.float32)[None, :, None]
    return torch.exp(s - lse.float()).mean(-1)


def softmax_mask(n_layers: int, softmax_layers: Iterable[int] | None) -> np.ndarray:
    """(L,) bool: the blocks with softmax attention (all of them when ``softmax_layers`` is None)."""
    mask = np.zeros(n_layers, dtype=bool)
    mask[list(range(n_layers)) if softmax_layers is None else list(softmax_layers)] = True
    return mask


def sink_fractions(alpha: np.ndarray, epsilon: float = SINK_EPSILON, softmax_layers: Iterable[int] | None = None) -> dict:
    """Gu et al. Sink_k: fraction of (sample, layer, head) triples with alpha_k > epsilon (strict).

    alpha: (N, L, H, K) per-sample sink importance. Returns ``profile`` (K,) = Sink_k,
    ``rate`` = Sink_0 and ``per_layer`` (L,) = Sink_0 within each layer. Hybrid stacks: only the
    ``softmax_layers`` count (their triples are the denominator); other blocks' ``per_layer`` is NaN.
    """
    layers = softmax_mask(alpha.shape[1], softmax_layers)
    above = np.nan_to_num(alpha, nan=-np.inf) > epsilon  # NaN (k beyond the sequence) never counts
    profile = above[:, layers].mean(axis=(0, 1, 2))
    per_layer = np.where(layers, above[..., 0].mean(axis=(0, 2)), np.nan)
    return {"profile": profile, "rate": float(profile[0]), "per_layer": per_layer}


def sink_alpha_mean(alpha: np.ndarray) -> np.ndarray:
    """alpha_0 per head, mean over samples: (N, L, H, K) -> (L, H)."""
    return alpha[..., 0].mean(axis=0)


def sink_center(alpha: np.ndarray) -> int | None:
    """argmax_k of mean alpha_k over (sample, layer, head), k < K; None when every alpha is NaN
    (non-finite activations)."""
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # k >= S columns are all-NaN
        mean = np.nanmean(alpha, axis=(0, 1, 2))
        if np.isnan(mean).all():
            return None
        return int(np.nanargmax(mean))


def sink_positions(profile: np.ndarray, ratio: float, floor: float) -> int:
    """How many early positions sink: Sink_k >= ``ratio`` x the largest Sink_k, and Sink_k >= ``floor``
    (0 when no position reaches ``floor``). Relative, so a converged model's faint second position
    (a few % beside a 70 % sink) is not a second sink, while two comparable sinks are."""
    p = np.nan_to_num(np.asarray(profile, dtype=float), nan=0.0)
    if p.size == 0:
        return 0
    return int(np.count_nonzero((p >= ratio * p.max()) & (p >= floor)))


# ---- selectivity screen (Xu 2026) --------------------------------------------------------------
def selectivity_columns(seq_len: int, ab: np.ndarray, baseline: np.ndarray) -> tuple[np.ndarray, dict[str, slice]]:
    """Key columns read at the query row T-1, per sequence, and where each class sits in them.

    Returns cols (N, 9 + len(baseline)) = [ab+1, ab, T-2, T-1, 0, T-3, T-4, T-5, T-6, baseline...]
    and a map class -> slice of those columns (``baseline`` included).
    """
    T = int(seq_len)
    n = len(ab)
    fixed = np.array([T - 2, T - 1, 0, *(T - o for o in LOCAL_OFFSETS)])
    cols = np.concatenate(
        [ab[:, None] + 1, ab[:, None], np.broadcast_to(fixed, (n, len(fixed))), np.broadcast_to(baseline, (n, len(baseline)))], axis=1
    )
    layout = {
        "induction": slice(0, 1),
        "duplicate": slice(1, 2),
        "previous": slice(2, 3),
        "self": slice(3, 4),
        "first": slice(4, 5),
        "local": slice(5, 5 + len(LOCAL_OFFSETS)),
        "baseline": slice(5 + len(LOCAL_OFFSETS), 5 + len(LOCAL_OFFSETS) + len(baseline)),
    }
    return cols.astype(np.int64), layout


def selectivity(gathered: np.ndarray, layout: Mapping[str, slice], valid: np.ndarray) -> dict[str, np.ndarray]:
    """Class selectivity per head: (mean over sequences of class attention) / max(baseline, 1e-8).

    gathered: (N, L, H, G) attention at the query row on the columns of ``selectivity_columns``.
    The baseline and the non-induction classes average over all sequences; ``induction`` and
    ``duplicate`` only over ``valid`` ones (B occurs exactly once in tokens[:-1]). Multi-column
    classes (local, baseline) first average their columns per sequence. Returns class -> (L, H).

    Conventions of the paper's code (per-head mechinterp scripts): the baseline is floored at 1e-8,
    so a head that never looks at the baseline positions gets a large finite ratio, not inf; with
    no valid sequence ``induction`` and ``duplicate`` are 0 (its sum over valid ones / max(n_valid, 1)).
    """
    valid = np.asarray(valid, dtype=bool)
    per_seq = {name: gathered[..., sl].mean(axis=-1) for name, sl in layout.items()}  # (N, L, H)
    base = np.maximum(per_seq["baseline"].mean(axis=0), BASELINE_FLOOR)
    out = {}
    for name in SELECTIVITY_CLASSES:
        x = per_seq[name][valid] if name in ("induction", "duplicate") else per_seq[name]
        mean = x.mean(axis=0) if len(x) else np.zeros(base.shape)
        out[name] = mean / base
    return out


def best_class(
    scores: Mapping[str, np.ndarray], minimum: float = BEST_CLASS_MIN_SELECTIVITY, softmax_layers: Iterable[int] | None = None
) -> np.ndarray:
    """Per head: the argmax class if its selectivity >= ``minimum``, else "unclassified". (L, H) str.

    As the paper: non-finite values (inf, NaN) take no part in the choice, and a tie goes to the
    class first in the paper's order (induction, previous, duplicate, first, self, local).
    Hybrid stacks: heads of blocks outside ``softmax_layers`` get None (no class to speak of).
    """
    stack = np.stack([np.where(np.isfinite(scores[c]), scores[c], -np.inf) for c in PAPER_CLASS_ORDER])  # (6, L, H)
    idx = stack.argmax(axis=0)  # the first maximum: the paper's order breaks ties
    names = np.array(PAPER_CLASS_ORDER, dtype=object)[idx]
    best = np.where(stack.max(axis=0) >= minimum, names, UNCLASSIFIED).astype(object)
    best[~softmax_mask(best.shape[0], softmax_layers)] = None
    return best


def head_names(mask: np.ndarray) -> list[str]:
    """ "L{l}H{h}" for every True cell of an (L, H) mask, in layer-then-head order."""
    return [f"L{l}H{h}" for l, h in zip(*np.nonzero(mask))]


def head_index(name: str) -> tuple[int, int]:
    """(layer, head) of a name "L{l}H{h}" (``head_names``' inverse): a sort key in layer-then-head order."""
    layer, head = name[1:].split("H")
    return int(layer), int(head)


def head_screen(scores: Mapping[str, np.ndarray], best: np.ndarray, softmax_layers: Iterable[int] | None = None) -> dict:
    """Sink heads, BOS fractions, induction and previous-token circuits from a selectivity screen.

    Hybrid stacks: fractions are over the heads of the ``softmax_layers`` only, and the other blocks'
    ``sink_heads_per_layer`` entries are None (no softmax there to screen)."""
    first = np.nan_to_num(scores["first"], nan=-np.inf)
    induction = np.nan_to_num(scores["induction"], nan=-np.inf)
    previous = np.nan_to_num(scores["previous"], nan=-np.inf)
    layers = softmax_mask(first.shape[0], softmax_layers)
    sink = first >= SINK_HEAD_MIN_SELECTIVITY  # no best-class filter
    total = int(layers.sum()) * first.shape[1]
    return {
        "sink_heads": sink,
        "sink_heads_per_layer": [int(n) if ok else None for n, ok in zip(sink.sum(axis=1), layers)],
        "bos_fraction_raw": float(sink.sum() / total),
        "bos_fraction_bestclass": float((best == "first").sum() / total),
        "induction_heads": head_names(induction >= INDUCTION_CIRCUIT_MIN_SELECTIVITY),
        "n_induction_ge30": int((induction >= INDUCTION_HEAD_MIN_SELECTIVITY).sum()),
        "n_induction_ge50": int((induction >= INDUCTION_CIRCUIT_MIN_SELECTIVITY).sum()),
        "previous_token_heads": head_names((best == "previous") & (previous >= PREVIOUS_TOKEN_MIN_SELECTIVITY)),
    }


# ---- participation ratio (Xu 2026) -------------------------------------------------------------
def participation_ratio(gram: np.ndarray) -> np.ndarray:
    """PR = exp(-sum p log p), p = s^2 / sum s^2, s the singular values of the uncentered M.

    gram: (..., D, D) = M^T M for M the (N, D) per-head outputs at the query row; its eigenvalues
    are s^2. Range [1, min(N, D)]. An all-zero M gives 1, as in the paper's code (it clamps the
    sum at 1e-12 and adds 1e-12 inside the log); NaN activations give NaN.
    """
    gram = np.asarray(gram, dtype=np.float64)
    finite = np.isfinite(gram).all(axis=(-1, -2))  # NaN activations: PR is undefined, not an error
    lam = np.clip(np.linalg.eigvalsh(np.where(finite[..., None, None], gram, 0.0)), 0.0, None)
    total = np.where(finite, lam.sum(axis=-1), 0.0)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        p = lam / np.maximum(total, 1e-300)
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    pr = np.exp(-plogp.sum(axis=-1))  # all-zero M: p = 0 everywhere, PR = exp(0) = 1
    return np.where(finite, pr, np.nan)


def participation_ratio_classical(gram: np.ndarray, total: np.ndarray, count: int) -> np.ndarray:
    """Classical PR (sum lambda)^2 / sum lambda^2 of the *centered* covariance (an option, not Xu's PR).

    gram: (..., D, D) = M^T M, total: (..., D) = column sums of M, count = N.
    """
    mean = np.asarray(total, dtype=np.float64) / count
    cov = (np.asarray(gram, dtype=np.float64) - count * mean[..., :, None] * mean[..., None, :]) / count
    finite = np.isfinite(cov).all(axis=(-1, -2))
    lam = np.clip(np.linalg.eigvalsh(np.where(finite[..., None, None], cov, 0.0)), 0.0, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(finite, lam.sum(-1) ** 2 / (lam**2).sum(-1), np.nan)


# ---- prefix matching and in-context learning (Olsson et al. 2022) ------------------------------------------
def repeated_query_columns(half_len: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows L..2L-1 of the repeated-random probe and each row's target i - L + 1: (n, L), (n, L, 1)."""
    rows = np.arange(half_len, 2 * half_len)
    cols = rows - half_len + 1
    return np.broadcast_to(rows, (n, half_len)).copy(), np.broadcast_to(cols[:, None], (n, half_len, 1)).copy()


def induction_score(per_sample: np.ndarray) -> np.ndarray:
    """Prefix-matching score per head: mean over sequences of the per-sequence row means. (N, L, H) -> (L, H)."""
    return per_sample.mean(axis=0)


def copy_losses(token_loss: torch.Tensor, half_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence mean next-token loss on the first copy (positions 1..L-1) and second (L+1..2L-1).

    token_loss: (B, 2L - 1), loss of predicting position t + 1 from prefix ..t (column t).
    """
    L = half_len
    first = token_loss[:, 0 : L - 1]  # predicts positions 1..L-1
    second = token_loss[:, L : 2 * L - 1]  # predicts positions L+1..2L-1
    return first.mean(-1), second.mean(-1)


def icl_score(first_copy_loss: np.ndarray, second_copy_loss: np.ndarray) -> float:
    """Mean second-copy loss minus mean first-copy loss; negative means in-context learning."""
    return float(np.mean(second_copy_loss) - np.mean(first_copy_loss))


# ---- the P0-sink circuit --------------------------------------------------------------------------------------
def norm_ratio_per_sequence(norms: torch.Tensor) -> torch.Tensor:
    """||h[0]|| / median_{t>=1} ||h[t]|| per sequence. norms: (B, S) -> (B,). Median averages the middle two."""
    return norms[:, 0] / torch.quantile(norms[:, 1:].double(), 0.5, dim=1).to(norms.dtype)


def p0_norm_ratio(ratio_per_sequence: np.ndarray) -> np.ndarray:
    """rho_l = median over sequences of the per-sequence ratio. (N, L) -> (L,)."""
    return np.median(ratio_per_sequence, axis=0)


def direction_consistency(vectors: np.ndarray, first_tokens: np.ndarray) -> float:
    """Mean pairwise cosine of h_l[0] over pairs of sequences whose first tokens differ.

    vectors: (N, d); pairs with the same first token are excluded (their h_l[0] agree trivially,
    since position 0 only sees itself). NaN when no pair qualifies.
    """
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    u = np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)
    total = u.sum(axis=0)
    # sum over ordered pairs i != j with different tokens = |sum u|^2 - sum_groups |sum_group u|^2
    same = 0.0
    pairs_same = 0
    for tok in np.unique(first_tokens):
        g = u[first_tokens == tok]
        s = g.sum(axis=0)
        same += float(s @ s)
        pairs_same += len(g) ** 2
    n_pairs = len(u) ** 2 - pairs_same
    if n_pairs == 0:
        return float("nan")
    return float((total @ total - same) / n_pairs)


def circuit_layer(
    norm_ratio: np.ndarray, consistency: np.ndarray | None, min_ratio: float, min_consistency: float = 0.0
) -> int | None:
    """First block l where position 0's state is amplified along a stable direction and stays amplified:
    rho_l >= min_ratio and rho_{l+1} >= min_ratio (the last block needs only its own), and
    c_l >= min_consistency. ``consistency`` None: no direction test (every window starts with the
    same BOS, c is undefined; the BOS anchor, docs/stages.md). None when no block qualifies.

    Why two blocks: a circuit later heads anchor on persists into the blocks after it; one block's
    norm spike that the next block undoes (a random model's block 0: rho 2.2, then 1.6) is not one."""
    rho = np.nan_to_num(np.asarray(norm_ratio, dtype=float), nan=-np.inf)
    amplified = rho >= min_ratio
    held = amplified & np.append(amplified[1:], True)  # this block and the next (the last: itself)
    if consistency is not None:
        held &= np.nan_to_num(np.asarray(consistency, dtype=float), nan=-np.inf) >= min_consistency
    hits = np.flatnonzero(held)
    return int(hits[0]) if len(hits) else None


def direction_consistency_centered(vectors: np.ndarray, others_mean: np.ndarray, first_tokens: np.ndarray) -> float:
    """``direction_consistency`` of h_l[0] - mean_{t>=1} h_l[t] (each sequence's own mean of the other
    positions). Uncentred, a direction every position shares (a model with no amplification at all
    reads c ~ 0.96) passes for a stable position-0 direction; centred, only what sets position 0
    apart from its sequence counts. vectors, others_mean: (N, d)."""
    return direction_consistency(np.asarray(vectors, dtype=np.float64) - np.asarray(others_mean, dtype=np.float64), first_tokens)


def p0_circuit(
    norm_ratio: np.ndarray,
    embeddings_ratio: float | None,
    consistency: np.ndarray | None,
    *,
    min_ratio: float,
    min_consistency: float,
    min_persistence: float,
    shallow_blocks: int = 2,
) -> dict:
    """Where and how position 0 is amplified along the stack (the P0-sink circuit), continuously.

    ``norm_ratio``: rho_l after each block (L,); ``embeddings_ratio``: rho before block 0 (None or
    NaN: taken as 1); ``consistency``: the centred direction consistency per block, or None (every
    window starts with the same BOS: no direction test). Returns:

    - ``rho_max``, ``rho_max_block``: the largest rho_l and its block;
    - ``p0_emergence_block``: the block with the largest gain in log rho (block 0's gain is over the
      embeddings): where the amplification happens; None when nothing is amplified (below);
    - ``p0_persistence``: the share of the blocks after the largest-gain block whose rho stays >=
      ``min_ratio`` (NaN when it is the last block: nothing after it can anchor on it);
    - ``p0_concentration``: the share of log rho_max already reached by the end of block
      ``shallow_blocks``-1 (max log rho over blocks 0..shallow_blocks-1, over log rho_max), clipped to
      [0, 1]; measured from 1 (not amplified), so a position 0 set apart by the embeddings themselves (a
      learned position embedding) counts as shallow. The P0 paper's signal: the circuit
      concentrates in blocks 0-1 as training converges. Unlike the emergence block it moves
      continuously when two blocks amplify alike (the stage rules read it, not the block). NaN when
      nothing is amplified;
    - "amplified": some block's rho >= ``min_ratio`` and at least ``min_persistence`` of the blocks
      after it stay >= ``min_ratio`` (none after it: not amplified). A random initialisation's block 0
      makes position 0 stand out (rho ~2) and the next block undoes it, and a stack that never reaches
      ``min_ratio`` has no jump worth naming: an emergence block or a concentration there is noise;
    - ``circuit_layer``: the emergence block when it amplifies (rho >= ``min_ratio``), persists
      (persistence >= ``min_persistence``) and, with ``consistency``, points one way across
      sequences (c >= ``min_consistency``); else None.
    """
    rho = np.asarray(norm_ratio, dtype=float)
    base = float(embeddings_ratio) if embeddings_ratio is not None and math.isfinite(embeddings_ratio) and embeddings_ratio > 0 else 1.0
    out = {
        "rho_max": None,
        "rho_max_block": None,
        "p0_emergence_block": None,
        "p0_persistence": math.nan,
        "p0_concentration": math.nan,
        "circuit_layer": None,
    }
    finite = np.isfinite(rho) & (rho > 0)
    if not finite.any():
        return out
    log_rho = np.where(finite, np.log(np.where(finite, rho, 1.0)), np.nan)
    top = int(np.nanargmax(np.where(finite, rho, -np.inf)))
    out["rho_max"], out["rho_max_block"] = float(rho[top]), top
    gains = np.diff(np.concatenate([[math.log(base)], log_rho]))  # gain into each block, NaN around non-finite blocks
    if np.isnan(gains).all():
        return out
    e = int(np.nanargmax(gains))
    later = rho[e + 1 :]
    persistence = float(np.mean(np.nan_to_num(later, nan=-np.inf) >= min_ratio)) if later.size else math.nan
    out["p0_persistence"] = persistence
    up = np.nan_to_num(rho, nan=-np.inf) >= min_ratio
    amplified = any(up[b] and b + 1 < len(rho) and up[b + 1 :].mean() >= min_persistence for b in range(len(rho)))
    if not amplified:
        return out
    out["p0_emergence_block"] = e
    if rho[top] > 1:
        shallow = np.nanmax(np.concatenate([log_rho[:shallow_blocks], [-np.inf]]))
        out["p0_concentration"] = float(np.clip(shallow / log_rho[top], 0.0, 1.0))
    stable = consistency is None or np.nan_to_num(np.asarray(consistency, dtype=float)[e], nan=-np.inf) >= min_consistency
    if rho[e] >= min_ratio and persistence >= min_persistence and stable:  # NaN persistence fails
        out["circuit_layer"] = e
    return out


# ---- scoring, ablation, recall -----------------------------------------------------------------------------
def target_scores_per_sequence(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    """Per sequence (cross-entropy, top-1 hit, top-5 hit) of ``targets`` (N,) under ``logits`` (N, V): (N, 3) float64."""
    logits = logits.float()
    loss = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    topk = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
    hit = topk == targets[:, None]
    return torch.stack([loss.double(), hit[:, 0].double(), hit.any(-1).double()], dim=-1).numpy()


def mean_target_scores(per_sequence: np.ndarray) -> dict[str, float]:
    """Mean cross-entropy, top-1 and top-5 accuracy over the rows of ``target_scores_per_sequence``."""
    loss, top1, top5 = np.asarray(per_sequence, dtype=np.float64).mean(axis=0)
    return {"loss": float(loss), "top1": float(top1), "top5": float(top5)}


def target_scores(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Mean cross-entropy, top-1 and top-5 accuracy of ``targets`` (N,) under ``logits`` (N, V)."""
    return mean_target_scores(target_scores_per_sequence(logits, targets))


def matched_random_heads(
    heads: Iterable[tuple[int, int]], n_heads: int, seed: int | np.random.RandomState = PAPER_CONTROL_SEED, *, short_layer: str = "raise"
) -> list[tuple[int, int]]:
    """Group-ablation control: per layer, as many random heads as the set has there, disjoint from it.

    Drawn with RandomState(seed) layer by layer in increasing layer order (``seed`` may be a
    RandomState to continue a shared stream, as the paper's sweep does). A layer with more picks
    than eligible heads raises (``short_layer="raise"``) or draws ``min(picks, eligible)``
    (``"min"``, the paper's code).
    """
    if short_layer not in ("raise", "min"):
        raise ValueError(f"short_layer must be 'raise' or 'min', got {short_layer!r}")
    chosen = sorted(set(heads))
    by_layer: dict[int, list[int]] = {}
    for l, h in chosen:
        by_layer.setdefault(l, []).append(h)
    rng = seed if isinstance(seed, np.random.RandomState) else np.random.RandomState(seed)
    control = []
    for l in sorted(by_layer):
        pool = [h for h in range(n_heads) if h not in by_layer[l]]
        m = len(by_layer[l])
        if m > len(pool):
            if short_layer == "raise":
                raise ValueError(
                    f"layer {l} has {len(by_layer[l])} ablated heads of {n_heads}: no disjoint random control of the same size exists "
                    "(the paper's protocol draws min(picks, eligible): protocol='paper')"
                )
            m = len(pool)
        control += [(l, int(h)) for h in sorted(rng.choice(pool, size=m, replace=False))]
    return control


def paper_control_sets(
    screens: Mapping[float, Iterable[tuple[int, int]]], n_heads: int, seed: int = PAPER_CONTROL_SEED
) -> dict[float, list[tuple[int, int]]]:
    """The paper's matched-random controls of an ablation sweep: ONE RandomState(seed) shared across
    the thresholds in the order given (the paper's [2, 10, 30, 50, 100]: its >= 50x control is the
    fourth draw), every threshold drawn even when its head set repeats the previous one, and
    ``min(picks, eligible)`` heads in a short layer. screens: threshold -> heads at >= threshold."""
    rng = np.random.RandomState(seed)
    return {t: matched_random_heads(heads, n_heads, rng, short_layer="min") for t, heads in screens.items()}


def screen_sets(induction: np.ndarray, thresholds: Sequence[float] = PAPER_SWEEP_THRESHOLDS) -> dict[float, list[tuple[int, int]]]:
    """threshold -> heads with induction selectivity >= threshold (inclusive), from an (L, H) table."""
    sel = np.asarray(induction, dtype=float)
    return {float(t): [(int(l), int(h)) for l, h in zip(*np.nonzero(sel >= t))] for t in thresholds}


def circuit_recall(current: Iterable[str], final: Iterable[str]) -> float | None:
    """|S_t & S_final| / |S_final|; None when the final set is empty."""
    final = set(final)
    if not final:
        return None
    return len(set(current) & final) / len(final)
