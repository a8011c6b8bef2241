"""The protocol label a replay's records carry: ``paper``, ``sinkwatch`` or ``custom``.

``paper`` and ``sinkwatch`` name the precision choices the numbers were computed with (docs/design.md §8). A recipe
file also fixes what is measured, its probes and dtype: an option that changes those (``--probe``, ``--n``,
``--seq-len``, ``--vocab-range``, ``--text``, ``--dtype``) makes the records ``protocol: custom``, with
``protocol_base`` (the precision choices used) and ``protocol_changes`` (``induction probe n: 2000 -> 500``), and is
refused under an explicit ``--protocol paper`` (the label would promise the paper's measurement). Memory or speed
options (``--batch-tokens``, ``--device``, ``--shard``) change nothing here. A hub id or a local folder without a
recipe file has no recipe to depart from: the options given are its measurement, labelled by its protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .recipes import Recipe
from .store import key_difference, replay_key

CUSTOM = "custom"
LABELS = ("paper", "sinkwatch", CUSTOM)


@dataclass(frozen=True)
class ProtocolLabel:
    computation: str  # "paper" | "sinkwatch": the precision choices (MonitorConfig.protocol)
    label: str  # what the records say: the computation, or "custom"
    changes: tuple[str, ...] = ()  # what departs from the recipe file

    def record_fields(self) -> dict:
        if self.label != CUSTOM:
            return {"protocol": self.label}
        return {"protocol": CUSTOM, "protocol_base": self.computation, "protocol_changes": list(self.changes)}


def resolve_protocol(recipe: Recipe, *, probes: Sequence | None, dtype: str | None, protocol: str | None) -> ProtocolLabel:
    """The label for a replay of ``recipe`` with these options (None: the recipe's); a ValueError for an explicit
    ``protocol="paper"`` with options that change what the recipe measures."""
    computation = protocol or recipe.protocol
    if recipe.source is None:
        return ProtocolLabel(computation, computation)
    wanted = replay_key(recipe.model, dtype or recipe.dtype, computation, probes if probes is not None else recipe.probe_recipes())
    stored = replay_key(recipe.model, recipe.dtype, recipe.protocol, recipe.probe_recipes())
    measured = [d for d in key_difference(stored, wanted) if not d.startswith("protocol:")]
    if not measured:
        return ProtocolLabel(computation, computation)
    if protocol == "paper":
        raise ValueError(
            f"--protocol paper promises the measurement of recipe {recipe.name or recipe.source}, but the options change it "
            f"({'; '.join(measured)}). Drop those options to reproduce the paper, or drop --protocol paper: the records are "
            "then labelled protocol: custom with what changed"
        )
    changes = [d for d in key_difference(stored, wanted)]
    return ProtocolLabel(computation, CUSTOM, tuple(changes))


def probes_with_options(recipe: Recipe, kinds: Sequence[str] | None, *, n: int | None = None, seq_len: int | None = None,
                        vocab_range: Sequence[int] | None = None, text: str | None = None,
                        bos: bool | None = None) -> list | None:  # fmt: skip
    """The recipe's probes with the command line's probe options laid over them (None: no option given, the recipe's
    own). A kind the recipe has keeps its parameters where no option is given (``--probe induction,repeated`` adds the
    repeated probe; the induction probe stays the recipe's 2000 x 256); a kind it lacks starts from that probe's
    defaults. ``bos``: ``--bos/--no-bos`` for natural windows (None: the tokenizer's convention)."""
    if kinds is None and n is None and seq_len is None and vocab_range is None and text is None and bos is None:
        return None
    specs = {}
    for kind in kinds or list(recipe.probes):
        spec = dict(recipe.probes.get(kind) or {})
        spec.update({k: v for k, v in (("n", n), ("seq_len", seq_len)) if v is not None})
        if kind in ("induction", "repeated") and vocab_range is not None:
            spec["vocab_range"] = list(vocab_range)
        if kind == "natural":
            if text is not None:
                spec.pop("tokens", None)
                spec["text_file"] = text
            if "text_file" not in spec and "tokens" not in spec:
                raise ValueError("the natural probe needs --text FILE (a UTF-8 text file tokenized with the model's tokenizer)")
            if bos is not None:
                spec["bos"] = bos
        specs[kind] = spec
    return Recipe(model=recipe.model, probes=specs).probe_recipes()
