"""GPT-2 models whose weights are set by hand, so each circuit is known exactly (no training).

Every feature lives on its own orthonormal direction orthogonal to the all-ones vector, so each
LayerNorm (weight 1, bias 0) acts as a pure rescale x -> sqrt(d) x / |x|. Directions:

    P[t]   position t (128 positions; also the "position 0/1/2" detectors)
    T[v]   token v (64 tokens)          T1[v]  "the previous token was v"   T2[v]  "predict v"
    s      the sink direction written by the P0 circuit's MLP

Building blocks:
- ``amplify(block)``: that block's MLP detects position 0 (reads P[0]) and writes ~100 * s, so
  position 0's residual norm is amplified along a fixed direction from that block on.
- ``sink_heads(layer, positions)``: every head of the layer attends to the listed early positions
  (a constant query against keys that read s for position 0 once amplified, else P[k]).
- ``induction()``: layer 0 head 0 is a previous-token head (query P[t] -> key P[t-1], copies T into
  T1); layer 1 head 0 is an induction head (query T[tok] against key T1, copies T into T2), and
  the unembedding reads T2: in-context copying of the A...A -> B pattern.
Heads and MLPs that are not planted are zero (uniform attention, no output).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

D_MODEL = 384
N_HEADS = 3  # head_dim 128: the previous-token head matches one-hot positions
HEAD_DIM = D_MODEL // N_HEADS
VOCAB = 64
POSITIONS = 128
# LayerNorm's rescale of a unit feature when the residual holds n unit features: sqrt(d / n)
LN2, LN3 = (D_MODEL / 2) ** 0.5, (D_MODEL / 3) ** 0.5


class Basis:
    def __init__(self, seed: int = 0):
        rng = np.random.RandomState(seed)
        ones = np.ones((D_MODEL, 1)) / np.sqrt(D_MODEL)
        m = rng.randn(D_MODEL, D_MODEL)
        m -= ones @ (ones.T @ m)  # orthogonal to the all-ones vector: LayerNorm's mean is 0
        q, _ = np.linalg.qr(m)
        dirs = torch.tensor(q[:, : D_MODEL - 1].T, dtype=torch.float32)  # (D-1, D) orthonormal rows
        i = 0

        def take(n):
            nonlocal i
            out = dirs[i : i + n]
            i += n
            return out

        self.P, self.T, self.T1, self.T2 = take(POSITIONS), take(VOCAB), take(VOCAB), take(VOCAB)
        self.s = take(1)[0]


class Planted:
    """Builder: ``Planted(n_layers).amplify(0).sink_heads(2, [0]).model()``."""

    def __init__(self, n_layers: int, seed: int = 0):
        self.n_layers = n_layers
        self.basis = Basis(seed)
        cfg = GPT2Config(
            vocab_size=VOCAB, n_positions=POSITIONS, n_embd=D_MODEL, n_layer=n_layers, n_head=N_HEADS,
            activation_function="relu", tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        self.m = GPT2LMHeadModel(cfg).eval()
        self.amplified_from: int | None = None
        with torch.no_grad():
            for p in self.m.parameters():
                p.zero_()
            for ln in [self.m.transformer.ln_f] + [blk.ln_1 for blk in self.m.transformer.h] + [blk.ln_2 for blk in self.m.transformer.h]:
                ln.weight.fill_(1.0)
            self.m.transformer.wte.weight.copy_(self.basis.T)  # token v -> T[v]
            self.m.transformer.wpe.weight.copy_(self.basis.P)  # position t -> P[t]
            self.m.lm_head.weight.copy_(2.0 * self.basis.T2)  # predict v from T2[v]

    # c_attn is a Conv1D: y = x @ W + b, W (d, 3d) = [q | k | v], head h in columns h*hd:(h+1)*hd
    def _qkv(self, layer: int, head: int):
        W = self.m.transformer.h[layer].attn.c_attn.weight
        b = self.m.transformer.h[layer].attn.c_attn.bias
        sl = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
        return (W[:, sl], b[sl]), (W[:, D_MODEL:][:, sl], b[D_MODEL:][sl]), (W[:, 2 * D_MODEL :][:, sl], b[2 * D_MODEL :][sl])

    def amplify(self, block: int, gain: float = 15.0) -> Planted:
        """Block ``block``'s MLP writes gain * LN2 / 2 (~100) * s at position 0 only."""
        mlp = self.m.transformer.h[block].mlp
        with torch.no_grad():
            mlp.c_fc.weight[:, 0] = self.basis.P[0]  # LN(x0) . P[0] = LN2 ~ 13.9 at position 0, 0 elsewhere
            mlp.c_fc.bias[0] = -LN2 / 2
            mlp.c_proj.weight[0] = gain * self.basis.s
        self.amplified_from = block if self.amplified_from is None else min(self.amplified_from, block)
        return self

    def amplify_token(self, block: int, token: int, gain: float = 5.5) -> Planted:
        """Block ``block``'s MLP writes gain * LN2 / 2 * s wherever the token is ``token`` (a BOS),
        whatever its position: the BOS anchor. gain 5.5: rho ~ 26 after the block (a BOS-trained
        270M model reads 24-29)."""
        mlp = self.m.transformer.h[block].mlp
        with torch.no_grad():
            mlp.c_fc.weight[:, 1] = self.basis.T[token]  # LN(x) . T[token] = LN2 where the token is there, 0 elsewhere
            mlp.c_fc.bias[1] = -LN2 / 2
            mlp.c_proj.weight[1] = gain * self.basis.s
        self.amplified_token = (block, token)
        return self

    def sink_heads_on_token(self, layer: int, token: int, strength: float = 14.0, heads=range(N_HEADS)) -> Planted:
        """``heads`` of ``layer`` attend to wherever ``token`` sits: on the token's own direction before
        the block that amplifies it, on the amplified direction s after it."""
        block, amplified = getattr(self, "amplified_token", (None, None))
        with torch.no_grad():
            for h in heads:
                (Wq, bq), (Wk, _), _ = self._qkv(layer, h)
                bq[0] = 1.0
                if amplified == token and block < layer:
                    Wk[:, 0] += self.basis.s * strength / (D_MODEL**0.5 * HEAD_DIM**-0.5)
                else:
                    Wk[:, 0] += self.basis.T[token] * strength / (LN2 * HEAD_DIM**-0.5)
        return self

    def sink_heads(self, layer: int, positions, strength: float = 14.0, heads=range(N_HEADS)) -> Planted:
        """All ``heads`` of ``layer`` sink onto ``positions`` (logit ~ strength there, 0 elsewhere)."""
        with torch.no_grad():
            for h in heads:
                (Wq, bq), (Wk, _), _ = self._qkv(layer, h)
                bq[0] = 1.0  # constant query along head coordinate 0
                for k in positions:
                    if k == 0 and self.amplified_from is not None and self.amplified_from < layer:
                        # read the amplified direction: LN(x0) . s ~ sqrt(d)
                        Wk[:, 0] += self.basis.s * strength / (D_MODEL**0.5 * HEAD_DIM**-0.5)
                    else:
                        # read the position detector: LN(x_k) . P[k] = LN2
                        Wk[:, 0] += self.basis.P[k] * strength / (LN2 * HEAD_DIM**-0.5)
        return self

    def induction(self, prev_layer: int = 0, ind_layer: int = 1, strength: float = 15.0) -> Planted:
        B = self.basis
        scale = HEAD_DIM**-0.5
        with torch.no_grad():
            # previous-token head: query at t carries P[t-1] (as head coords 0..63), key at j carries P[j]
            (Wq, _), (Wk, _), (Wv, _) = self._qkv(prev_layer, 0)
            n0 = LN2  # LN(x) . P[t] before block 0 (|x|^2 = 2)
            shift = torch.zeros(POSITIONS, HEAD_DIM)
            for t in range(1, POSITIONS):
                shift[t, t - 1] = 1.0
            Wq += B.P.T @ shift * strength / (n0 * n0 * scale)
            Wk += B.P.T @ torch.eye(POSITIONS, HEAD_DIM)
            Wv += B.T.T @ torch.eye(VOCAB, HEAD_DIM) / n0  # value: the token, unit size
            proj = self.m.transformer.h[prev_layer].attn.c_proj.weight  # (d, d): out = z @ W
            proj[0:HEAD_DIM] += torch.eye(HEAD_DIM, VOCAB) @ B.T1  # head 0 coords -> T1[v]
            # induction head: query T[tok_t], key T1[tok_{j-1}]: match where the previous token equals the current one
            (Wq, _), (Wk, _), (Wv, _) = self._qkv(ind_layer, 0)
            n1 = LN3  # LN(x) . T[v] before block 1 (|x|^2 = 3)
            Wq += B.T.T @ torch.eye(VOCAB, HEAD_DIM) * strength / (n1 * n1 * scale)
            Wk += B.T1.T @ torch.eye(VOCAB, HEAD_DIM)
            Wv += B.T.T @ torch.eye(VOCAB, HEAD_DIM) / n1
            proj = self.m.transformer.h[ind_layer].attn.c_proj.weight
            proj[0:HEAD_DIM] += torch.eye(HEAD_DIM, VOCAB) @ B.T2 * 4.0
        return self

    def model(self) -> GPT2LMHeadModel:
        return self.m


# ---- the planted P0 stages (4 blocks x 3 heads) ---------------------------------------------------
def p0_final() -> GPT2LMHeadModel:
    """Block 0 amplifies position 0; layers 2-3 sink onto it (layers 0-1 stay sink-free)."""
    return Planted(4).amplify(0).sink_heads(2, [0]).sink_heads(3, [0]).model()


def p0_early() -> GPT2LMHeadModel:
    """Only a middle block (2) amplifies; layer 3 sinks onto position 0."""
    return Planted(4).amplify(2).sink_heads(3, [0]).model()


def p0_shifted_position1() -> GPT2LMHeadModel:
    """The circuit sits in block 0, but later heads sink onto position 1 alone (sink centre 1): an
    established single sink off position 0 held by a shallow circuit, the ``shifted`` outcome."""
    return Planted(4).amplify(0).sink_heads(2, [1]).sink_heads(3, [1]).model()


def p0_transitional_spread() -> GPT2LMHeadModel:
    """Later heads split their mass over positions 0, 1 and 2: several early sinks."""
    return Planted(4).sink_heads(2, [0, 1, 2]).sink_heads(3, [0, 1, 2]).model()


BOS = 1  # the planted BOS token


def p0_final_bos() -> GPT2LMHeadModel:
    """The BOS anchor (the profile of a BOS-trained 270M model, Gemma 3 270M): block 0 amplifies the BOS token wherever
    it is (rho ~ 26 after block 0); two of block 0's heads and every later head (but one in the last
    block) sink onto it, 12 of 15 heads (0.8; block 0: 0.67). Without the BOS nothing is amplified
    (rho ~ 1) and nothing sinks."""
    b = Planted(5).amplify_token(0, BOS).sink_heads_on_token(0, BOS, heads=[0, 1])
    for layer in (1, 2, 3):
        b.sink_heads_on_token(layer, BOS)
    return b.sink_heads_on_token(4, BOS, heads=[0]).model()


def p0_none() -> GPT2LMHeadModel:
    return Planted(4).model()


def induction_circuit() -> GPT2LMHeadModel:
    """L0H0 previous-token head + L1H0 induction head (2 blocks x 3 heads)."""
    return Planted(2).induction().model()
