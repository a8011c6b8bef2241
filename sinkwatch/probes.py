"""Probe sets (docs/design.md §3): fixed token batches with per-row metadata, hashed and stored with a run.

Three kinds:

- ``induction``: the paper's synthetic A...A->B batch (Xu 2026); one query row per sequence (the
  last position, holding the second A), the induction target (B, at ab+1) and duplicate target
  (the first A, at ab).
- ``repeated``: Olsson-style prefix matching; random tokens R followed by R again. Rows L..2L-1
  are induction queries and row i's target is i - L + 1.
- ``natural``: windows of the user's own text; every row is a query (for the sink statistics).

A ``ProbeSet`` is the frozen data; ``InductionProbe``/``RepeatedRandomProbe``/``NaturalProbe`` are
the typed recipes that build one for a model's vocabulary. Both kinds are accepted by ``Monitor``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROBE_KINDS = ("induction", "repeated", "natural")
PAPER_VOCAB_RANGE = (100, 10000)  # Xu 2026: token ids drawn from [100, 10000)
_MIN_VOCAB_IDS = 3  # A != B, plus at least one other id to fill the sequence with
MIN_INDUCTION_SEQ_LEN = 57  # the 50 baseline positions come from 1..T-7


@dataclass(frozen=True, eq=False)
class ProbeSet:
    """Fixed probe tokens plus named per-sequence metadata arrays.

    tokens: (N, T) int64. ``fields`` maps a name to an int64 array whose first dim is N (per
    sequence) or to a 1-D array shared by all sequences (``baseline_positions``). ``params`` holds
    the JSON-able generation parameters. Equal content gives an equal ``hash``.
    """

    kind: str
    tokens: torch.Tensor
    fields: Mapping[str, np.ndarray] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in PROBE_KINDS:
            raise ValueError(f"probe kind must be one of {PROBE_KINDS}, got {self.kind!r}")
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dim() != 2:
            raise ValueError("probe tokens must be a 2-D (N, T) integer tensor")
        object.__setattr__(self, "tokens", self.tokens.detach().to("cpu", torch.int64).contiguous())
        object.__setattr__(self, "fields", {k: np.asarray(v, dtype=np.int64) for k, v in self.fields.items()})
        object.__setattr__(self, "params", json.loads(json.dumps(dict(self.params), sort_keys=True)))

    @property
    def n(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def hash(self) -> str:
        """sha256 over kind, params, tokens and every field (16 hex digits)."""
        h = hashlib.sha256()
        h.update(self.kind.encode())
        h.update(json.dumps(self.params, sort_keys=True).encode())
        h.update(np.ascontiguousarray(self.tokens.numpy(), dtype="<i8").tobytes())
        for name in sorted(self.fields):
            h.update(name.encode())
            arr = np.ascontiguousarray(self.fields[name], dtype="<i8")
            h.update(str(arr.shape).encode())
            h.update(arr.tobytes())
        return h.hexdigest()[:16]

    def subset(self, n: int) -> ProbeSet:
        """The first ``n`` sequences (metadata sliced alongside)."""
        if not 1 <= n <= self.n:
            raise ValueError(f"subset size must be in [1, {self.n}], got {n}")
        fields = {k: (v[:n] if v.ndim and v.shape[0] == self.n and k not in _SHARED_FIELDS else v) for k, v in self.fields.items()}
        return ProbeSet(self.kind, self.tokens[:n], fields, {**self.params, "n": n})

    # ---- storage -------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        arrays = {f"field__{k}": v for k, v in self.fields.items()}
        meta = json.dumps({"kind": self.kind, "params": self.params, "hash": self.hash}).encode()
        np.savez_compressed(buf, tokens=self.tokens.numpy(), meta=np.frombuffer(meta, dtype=np.uint8), **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> ProbeSet:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            fields = {k[len("field__"):]: z[k] for k in z.files if k.startswith("field__")}
            probe = cls(meta["kind"], torch.from_numpy(z["tokens"]), fields, meta["params"])
        if probe.hash != meta["hash"]:
            raise ValueError(f"probe file is corrupt: stored hash {meta['hash']} but content hashes to {probe.hash}")
        return probe

    def save(self, path: str | os.PathLike) -> Path:
        """Write an ``.npz`` file (no pickle); returns its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(self.to_bytes())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProbeSet:
        return cls.from_bytes(Path(path).read_bytes())

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a token id falls outside [0, vocab_size)."""
        lo, hi = int(self.tokens.min()), int(self.tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"{self.kind} probe has token ids in [{lo}, {hi}] but the model's vocabulary has {vocab_size} ids; "
                f"rebuild the probe with vocab_range inside [0, {vocab_size}) (CLI: --vocab-range LO HI)"
            )


_SHARED_FIELDS = frozenset({"baseline_positions"})


# ---- vocabulary range -----------------------------------------------------------------------
def resolve_vocab_range(vocab_size: int, requested: Sequence[int] | None = None) -> tuple[int, int]:
    """Token-id range [lo, hi) for the synthetic probes.

    An explicit range must fit the vocabulary. The default is the paper's [100, 10000), clipped to
    the vocabulary; when fewer than 100 ids would remain above 100 (byte-level or toy
    vocabularies) it starts at 0 instead.
    """
    if requested is not None:
        lo, hi = (int(x) for x in requested)
        if not 0 <= lo < hi:
            raise ValueError(f"vocab_range must satisfy 0 <= LO < HI, got [{lo}, {hi})")
        if hi > vocab_size:
            raise ValueError(
                f"vocab_range [{lo}, {hi}) does not fit the model's vocabulary of {vocab_size} ids; "
                f"pass a range with HI <= {vocab_size} (CLI: --vocab-range LO HI)"
            )
    else:
        hi = min(PAPER_VOCAB_RANGE[1], vocab_size)
        lo = PAPER_VOCAB_RANGE[0] if hi - PAPER_VOCAB_RANGE[0] >= 100 else 0
    if hi - lo < _MIN_VOCAB_IDS:
        raise ValueError(
            f"token-id range [{lo}, {hi}) has {max(hi - lo, 0)} ids; the synthetic probes need at least "
            f"{_MIN_VOCAB_IDS} (a vocabulary of {vocab_size} ids is too small, or pass a wider --vocab-range)"
        )
    return lo, hi


# ---- builders ---------------------------------------------------------------------------------
def make_induction_probe(n: int, seq_len: int, *, vocab_range: tuple[int, int] = PAPER_VOCAB_RANGE, seed: int = 42) -> ProbeSet:
    """The paper's induction batch (Xu 2026), drawn sequence by sequence from RandomState(seed).

    Per sequence, in this order: ``seq = randint(lo, hi, size=T)``; A, B distinct from
    ``choice(arange(lo, hi), 2, replace=False)``; ``ab = randint(20, T // 2)``; seq[ab] = A,
    seq[ab+1] = B; every other occurrence of A is redrawn with ``randint(lo, hi)``, then every other
    occurrence of B; finally seq[T-1] = A. Drawing sequentially makes the first m sequences of a
    larger probe equal to the m-sequence probe.
    """
    lo, hi = (int(x) for x in vocab_range)
    T = int(seq_len)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if T < MIN_INDUCTION_SEQ_LEN:
        raise ValueError(f"the induction probe needs seq_len >= {MIN_INDUCTION_SEQ_LEN} (50 baseline positions in 1..T-7), got {T}")
    if hi - lo < _MIN_VOCAB_IDS:
        raise ValueError(f"vocab_range [{lo}, {hi}) is too small for the induction probe (needs >= {_MIN_VOCAB_IDS} ids)")
    rng = np.random.RandomState(seed)
    ids = np.arange(lo, hi)
    tokens = np.empty((n, T), dtype=np.int64)
    a_tok = np.empty(n, dtype=np.int64)
    b_tok = np.empty(n, dtype=np.int64)
    ab_pos = np.empty(n, dtype=np.int64)
    for s in range(n):
        seq = rng.randint(lo, hi, size=T)
        A, B = rng.choice(ids, size=2, replace=False)
        ab = rng.randint(20, T // 2)
        seq[ab], seq[ab + 1] = A, B
        for pos in np.flatnonzero(seq == A):
            if pos != ab:
                seq[pos] = rng.randint(lo, hi)
        for pos in np.flatnonzero(seq == B):
            if pos != ab + 1:
                seq[pos] = rng.randint(lo, hi)
        seq[T - 1] = A
        tokens[s], a_tok[s], b_tok[s], ab_pos[s] = seq, A, B, ab
    # Validity (paper): B occurs exactly once in tokens[:-1]; ab = that position - 1.
    valid = np.array([np.count_nonzero(tokens[s, :-1] == b_tok[s]) == 1 for s in range(n)])
    fields = {
        "query_row": np.full(n, T - 1),
        "ab": ab_pos,
        "token_a": a_tok,
        "token_b": b_tok,
        "valid": valid.astype(np.int64),
        "baseline_positions": baseline_positions(T),
    }
    params = {"n": n, "seq_len": T, "vocab_range": [lo, hi], "seed": seed}
    return ProbeSet("induction", torch.from_numpy(tokens), fields, params)


def baseline_positions(seq_len: int, count: int = 50, seed: int = 0) -> np.ndarray:
    """The selectivity screen's 50 fixed baseline positions (Xu 2026).

    Drawn one at a time as ``RandomState(seed).randint(1, T - 1)``, skipping repeats and
    {0, T-6, ..., T-1}, until ``count`` are collected (kept in draw order).
    """
    T = int(seq_len)
    excluded = {0, *range(T - 6, T)}
    available = len(set(range(1, T - 1)) - excluded)
    if available < count:
        raise ValueError(f"seq_len {T} leaves only {available} baseline positions; need {count} (use seq_len >= {count + 7})")
    rng = np.random.RandomState(seed)
    chosen: list[int] = []
    while len(chosen) < count:
        p = int(rng.randint(1, T - 1))
        if p in excluded or p in chosen:
            continue
        chosen.append(p)
    return np.array(chosen, dtype=np.int64)


def make_repeated_random_probe(
    n: int, half_len: int, *, vocab_range: tuple[int, int] = PAPER_VOCAB_RANGE, seed: int = 1
) -> ProbeSet:
    """Random tokens R (n, L) followed by R again: ``RandomState(seed).randint(lo, hi, size=(n, L))``."""
    lo, hi = (int(x) for x in vocab_range)
    L = int(half_len)
    if n < 1 or L < 2:
        raise ValueError(f"the repeated-random probe needs n >= 1 and half length >= 2, got n={n}, L={L}")
    R = np.random.RandomState(seed).randint(lo, hi, size=(n, L)).astype(np.int64)
    tokens = np.concatenate([R, R], axis=1)
    params = {"n": n, "half_len": L, "seq_len": 2 * L, "vocab_range": [lo, hi], "seed": seed}
    return ProbeSet("repeated", torch.from_numpy(tokens), {}, params)


def make_natural_probe(
    tokens: torch.Tensor | np.ndarray | Sequence[int], n: int, seq_len: int, *, bos_token_id: int | None = None, source: str = ""
) -> ProbeSet:
    """``n`` windows of ``seq_len`` tokens from the user's own data.

    ``tokens`` is a 1-D token stream (cut into consecutive, non-overlapping windows) or a 2-D
    (rows, >= seq_len) batch (the first ``seq_len`` tokens of the first ``n`` rows). With
    ``bos_token_id`` each window is that id followed by ``seq_len - 1`` tokens of text.
    """
    data = torch.as_tensor(np.asarray(tokens) if not isinstance(tokens, torch.Tensor) else tokens).to(torch.int64).cpu()
    T = int(seq_len)
    body = T - (bos_token_id is not None)
    if n < 1 or body < 1:
        raise ValueError(f"the natural probe needs n >= 1 and seq_len >= 2, got n={n}, seq_len={T}")
    if data.dim() == 1:
        have = data.numel() // body
        if have < n:
            raise ValueError(
                f"text gives {data.numel()} tokens = {have} windows of {body}; need {n} (use less --n or --seq-len, or more text)"
            )
        windows = data[: n * body].view(n, body)
    elif data.dim() == 2:
        if data.shape[0] < n or data.shape[1] < body:
            raise ValueError(f"token batch {tuple(data.shape)} is too small for {n} windows of {body} tokens")
        windows = data[:n, :body]
    else:
        raise ValueError(f"natural-probe tokens must be 1-D (a stream) or 2-D (rows), got shape {tuple(data.shape)}")
    if bos_token_id is not None:
        windows = torch.cat([torch.full((n, 1), int(bos_token_id), dtype=torch.int64), windows], dim=1)
    params = {"n": n, "seq_len": T, "bos_token_id": bos_token_id, "source": source}
    return ProbeSet("natural", windows.clone(), {}, params)


# ---- natural windows cut from a training batch (the live natural probe) ----------------------------
def input_ids_of(batch) -> torch.Tensor | None:
    """The (B, T) token ids in a training batch: a tensor, dict["input_ids"], or the first item of a tuple/list."""
    if isinstance(batch, torch.Tensor):
        ids = batch
    elif isinstance(batch, dict) or hasattr(batch, "keys"):
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
    elif isinstance(batch, (tuple, list)) and batch:
        ids = batch[0] if isinstance(batch[0], torch.Tensor) else None
    else:
        ids = None
    if ids is None or ids.dtype.is_floating_point or ids.dim() != 2:
        return None
    return ids


def attention_mask_of(batch, ids: torch.Tensor) -> torch.Tensor | None:
    """The batch's (B, T) ``attention_mask`` (1 = real token), when it has one of the ids' shape."""
    mask = batch.get("attention_mask") if hasattr(batch, "get") else None
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        return mask
    return None


def bos_of_batch(ids: torch.Tensor, bos_token_id: int | None, *, attention_mask: torch.Tensor | None = None) -> int | None:
    """``bos_token_id`` when every row of a (B, T) batch starts with it (after any left padding): a
    run trained with a BOS at every sequence start; else None."""
    if bos_token_id is None or ids is None or ids.dim() != 2 or ids.shape[1] < 1:
        return None
    ids = ids.detach().to("cpu", torch.int64)
    if attention_mask is not None:
        first = (attention_mask.detach().to("cpu") != 0).int().argmax(dim=1)  # the first real token of each row
        starts = ids.gather(1, first[:, None])[:, 0]
    else:
        starts = ids[:, 0]
    return int(bos_token_id) if bool((starts == int(bos_token_id)).all()) else None


def natural_windows(
    ids: torch.Tensor,
    seq_len: int,
    n: int,
    *,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> torch.Tensor:
    """Up to ``n`` windows (m, seq_len) of real tokens from a (B, T) training batch, spread over its rows.

    Each row's real tokens (``attention_mask`` 1; without a mask, the row minus any leading or
    trailing run of ``pad_token_id``, i.e. left or right padding) are cut into consecutive
    non-overlapping windows; windows are then taken round-robin, row 0's first, row 1's first, ...,
    row 0's second, ..., so a (8, 2048) batch gives 32 windows from all 8 rows, not 32 from row 0.
    With ``bos_token_id`` (a run whose rows start with that BOS: ``bos_of_batch``) every window is
    the BOS followed by ``seq_len - 1`` tokens of its row after the row's own BOS, so a window cut
    mid-row starts the way the model saw every sequence start in training.
    """
    ids = ids.detach().to("cpu", torch.int64)  # (B, T)
    keep = torch.ones_like(ids, dtype=torch.bool)
    if attention_mask is not None:
        keep = attention_mask.detach().to("cpu") != 0
    elif pad_token_id is not None:
        is_pad = ids == int(pad_token_id)
        real = ~is_pad
        # a position is padding when every token before it, or every token after it, is padding
        keep = (real.cumsum(1) > 0) & (real.flip(1).cumsum(1).flip(1) > 0)
    per_row = []
    body = seq_len - (bos_token_id is not None)
    for row, ok in zip(ids, keep):
        tokens = row[ok]
        if bos_token_id is not None:
            tokens = tokens[1:] if tokens.numel() and int(tokens[0]) == int(bos_token_id) else tokens
        m = tokens.numel() // body if body > 0 else 0
        windows = tokens[: m * body].view(m, body)
        if bos_token_id is not None:
            windows = torch.cat([torch.full((m, 1), int(bos_token_id), dtype=torch.int64), windows], dim=1)
        per_row.append(windows)
    picked = []
    for j in range(max((w.shape[0] for w in per_row), default=0)):
        for w in per_row:
            if j < w.shape[0] and len(picked) < n:
                picked.append(w[j])
    return torch.stack(picked) if picked else torch.empty(0, seq_len, dtype=torch.int64)


def batch_windows(
    ids: torch.Tensor, attention_mask: torch.Tensor | None, *, n: int, seq_len: int, context: int | None, config
) -> torch.Tensor:
    """The (m, T) natural windows of a first training batch (m may be 0), ``T = min(seq_len, the batch's
    length, context)``, padding and BOS read from the batch and the model's ``config`` (docs/design.md §3): a run
    whose rows all start with the model's BOS gets windows that all start with it too."""
    T = min(seq_len, ids.shape[1], context or ids.shape[1])
    pad_id = getattr(config, "pad_token_id", None) if attention_mask is None else None
    bos = bos_of_batch(ids, getattr(config, "bos_token_id", None), attention_mask=attention_mask)
    return natural_windows(ids, T, n, attention_mask=attention_mask, pad_token_id=pad_id, bos_token_id=bos)


def short_windows(windows: torch.Tensor, n: int, seq_len: int) -> str | None:
    """The warning when a first batch gives fewer or shorter windows than asked (None: it does not)."""
    m, T = windows.shape
    if m >= n and T >= seq_len:
        return None
    return (
        f"sinkwatch: the first training batch gives {m} natural windows of {T} tokens where {n} x {seq_len} were asked; the "
        "natural probe is frozen from it (step 0 is probed before any later batch arrives, and every record uses the same "
        "windows), so later, longer batches change nothing. Records say natural_probe {n, seq_len}. Lower natural_n / "
        "natural_seq_len, make the first batch longer, or pass probes=[..., make_natural_probe(tokens, n, seq_len)] built "
        "from your data."
    )


def probe_of_windows(windows: torch.Tensor, *, bos_token_id: int | None, requested: tuple[int, int]) -> ProbeSet:
    """The natural probe of frozen windows (m, T); its params say what was asked (``requested`` n and
    seq_len) beside what the windows hold, so a short first batch shows in every record."""
    n, T = windows.shape
    if bos_token_id is not None and bool((windows[:, 0] == int(bos_token_id)).all()):  # BOS windows: the params say so
        probe = make_natural_probe(windows[:, 1:], n=n, seq_len=T, bos_token_id=int(bos_token_id), source="first training batch")
    else:
        probe = make_natural_probe(windows, n=n, seq_len=T, source="first training batch")
    probe.params.update({"requested_n": requested[0], "requested_seq_len": requested[1]})
    return probe


def tokenizer_bos(tokenizer) -> int | None:
    """The BOS id ``tokenizer`` puts first when it encodes text with its special tokens (Gemma,
    Llama 3, OLMo-2 ...), else None (GPT-2, Pythia, SmolLM2 add none): the convention the model was
    trained with, which natural windows follow (docs/design.md §3)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return int(bos) if len(ids) and int(ids[0]) == int(bos) else None


def read_text_tokens(path: str | os.PathLike, tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """Tokenize a UTF-8 text file into a 1-D id stream (no special tokens)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"text file {path} is empty")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.int64)
    return ids if max_tokens is None else ids[:max_tokens]


# ---- recipes: typed, validated, built for one vocabulary ------------------------------------------
def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class InductionProbe:
    """Recipe for the paper's induction batch. Paper: n=2000, seq_len=256, seed 42."""

    n: int = 500
    seq_len: int = 256
    vocab_range: tuple[int, int] | None = None
    seed: int = 42
    kind = "induction"

    def __post_init__(self) -> None:
        _check_positive("n", self.n)
        if not isinstance(self.seq_len, int) or self.seq_len < MIN_INDUCTION_SEQ_LEN:
            raise ValueError(
                f"induction probe seq_len must be an int >= {MIN_INDUCTION_SEQ_LEN} "
                f"(positions 1..T-7 must hold the 50 baseline positions), got {self.seq_len!r}"
            )

    def build(self, vocab_size: int) -> ProbeSet:
        return make_induction_probe(self.n, self.seq_len, vocab_range=resolve_vocab_range(vocab_size, self.vocab_range), seed=self.seed)


@dataclass(frozen=True, kw_only=True)
class RepeatedRandomProbe:
    """Recipe for the repeated-random batch; ``seq_len`` is the full length 2L."""

    n: int = 64
    seq_len: int = 128
    vocab_range: tuple[int, int] | None = None
    seed: int = 1
    kind = "repeated"

    def __post_init__(self) -> None:
        _check_positive("n", self.n)
        if not isinstance(self.seq_len, int) or self.seq_len < 4 or self.seq_len % 2:
            raise ValueError(f"repeated-random seq_len is 2L and must be an even int >= 4, got {self.seq_len!r}")

    def build(self, vocab_size: int) -> ProbeSet:
        return make_repeated_random_probe(
            self.n, self.seq_len // 2, vocab_range=resolve_vocab_range(vocab_size, self.vocab_range), seed=self.seed
        )


@dataclass(frozen=True, kw_only=True)
class NaturalProbe:
    """Recipe for natural-text windows (Gu et al. 2024 use 100 x 64) from a token stream or a text file."""

    tokens: Any = None  # 1-D stream or 2-D rows of ids
    text_file: str | None = None
    tokenizer: Any = None  # needed with text_file (a transformers tokenizer or a name to load)
    n: int = 100
    seq_len: int = 64
    bos_token_id: int | None = None  # the BOS put first in every window (None: see ``bos``)
    # None: the tokenizer's convention (a BOS first when it adds one to the text it encodes; with
    # tokens= and no tokenizer, a BOS only when bos_token_id is given); True: always (bos_token_id,
    # else the tokenizer's BOS); False: never, whatever the tokenizer does (the BOS-free twin by hand)
    bos: bool | None = None
    kind = "natural"

    def __post_init__(self) -> None:
        _check_positive("n", self.n)
        _check_positive("seq_len", self.seq_len)
        if (self.tokens is None) == (self.text_file is None):
            raise ValueError("NaturalProbe needs exactly one of tokens= (ids) or text_file= (with tokenizer=)")
        if self.text_file is not None and self.tokenizer is None:
            raise ValueError("NaturalProbe(text_file=...) needs tokenizer= (a tokenizer object or a hub id / local dir)")
        if self.bos is not None and not isinstance(self.bos, bool):
            raise TypeError(f"NaturalProbe(bos=...) is True, False or None (the tokenizer's convention), got {self.bos!r}")
        if self.bos_token_id is not None and (not isinstance(self.bos_token_id, int) or self.bos_token_id < 0):
            raise ValueError(f"bos_token_id must be a token id (int >= 0) or None, got {self.bos_token_id!r}")

    def _tokenizer(self):
        tok = self.tokenizer
        if isinstance(tok, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(tok))
        return tok

    def resolved_bos(self, tokenizer=None) -> int | None:
        """The BOS id every window starts with, or None."""
        if self.bos is False:
            return None
        if self.bos_token_id is not None:
            return self.bos_token_id
        if tokenizer is None:
            if self.bos:
                raise ValueError("NaturalProbe(bos=True) needs bos_token_id= or a tokenizer that has a BOS token")
            return None
        if self.bos:
            bos = getattr(tokenizer, "bos_token_id", None)
            if bos is None:
                raise ValueError(f"NaturalProbe(bos=True): {type(tokenizer).__name__} has no BOS token; pass bos_token_id=")
            return int(bos)
        return tokenizer_bos(tokenizer)

    def build(self, vocab_size: int) -> ProbeSet:
        tok = self._tokenizer() if self.tokenizer is not None else None
        if self.text_file is not None:
            stream = read_text_tokens(self.text_file, tok)
            source = os.path.basename(str(self.text_file))
        else:
            stream, source = self.tokens, "tokens"
        probe = make_natural_probe(stream, self.n, self.seq_len, bos_token_id=self.resolved_bos(tok), source=source)
        probe.check_vocab(vocab_size)
        return probe


ProbeRecipe = InductionProbe | RepeatedRandomProbe | NaturalProbe


# ---- the live defaults ---------------------------------------------------------------------------------
# The probes of a live run (the callbacks, the demo, the recipes), as (sequences, tokens per sequence):
# cheap enough to run every few hundred steps, large enough for stable statistics. The recipes' own
# defaults above are a one-shot probe's (the paper's scale); a live run fits these to the model.
# A probe costs its tokens (it runs at ~1.0x their forwards), so each size is the smallest measured to
# read what the larger one reads (benchmarks/probe_sizes.py, docs/live.md "Overhead"): 50 induction
# sequences read the same stage as 100 on every probe of two demo trajectories and as many >= 50x heads
# on SmolLM2, as close to n = 500's; 16 repeated-random sequences moved the demo's events, so that probe keeps 32. PR's N is
# the induction probe's n (records: ``pr_sequences``): compare a live PR with PRs of the same probe size.
LIVE_PROBES = {"induction": (50, 256), "repeated": (32, 128), "natural": (32, 64)}


def default_probes(context: int | None, *, vocab_range: tuple[int, int] | None = None, natural=None) -> list:
    """The live probe sets fitted to a model's ``context`` (None: 2048): the induction probe (its tokens
    cut to the context; none when that leaves fewer than ``MIN_INDUCTION_SEQ_LEN``), the repeated-random
    probe (an even length), and ``natural`` when given: frozen windows (a ``ProbeSet``), or a token stream
    cut into ``LIVE_PROBES["natural"]`` windows. ``vocab_range``: the synthetic probes' token ids (a
    byte-level model's printable range; None: the paper's range fitted to the vocabulary)."""
    ctx = context or 2048
    probes: list = []
    n, T = LIVE_PROBES["induction"]
    if min(T, ctx) >= MIN_INDUCTION_SEQ_LEN:
        probes.append(InductionProbe(n=n, seq_len=min(T, ctx), vocab_range=vocab_range))
    n, T = LIVE_PROBES["repeated"]
    if min(T, ctx) // 2 * 2 >= 4:
        probes.append(RepeatedRandomProbe(n=n, seq_len=min(T, ctx) // 2 * 2, vocab_range=vocab_range))
    if isinstance(natural, ProbeSet):
        probes.append(natural)
    elif natural is not None:
        n, T = LIVE_PROBES["natural"]
        probes.append(NaturalProbe(tokens=natural, n=n, seq_len=T))
    return probes
