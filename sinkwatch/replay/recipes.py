"""Replay recipes: what to replay (a hub model, its revisions, dtype, probes, protocol), packaged or from YAML."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from ..monitor import PROTOCOLS
from ..probes import InductionProbe, NaturalProbe, RepeatedRandomProbe


# ---- recipes -------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What to replay: a hub model, its revisions (or how many log-spaced ones), dtype and probes."""

    model: str
    name: str = ""
    revisions: tuple[str, ...] | None = None
    log_spaced: int | None = None
    dtype: str = "float32"
    probes: dict = field(default_factory=lambda: {"induction": {"n": 2000, "seq_len": 256, "seed": 42}})
    tokens_per_step: int | None = None
    reference: str | None = None  # key of the paper's figures (sinkwatch/data/xu2026_developmental.json)
    batch_tokens: int = 16384
    layers: int | None = None
    heads_per_layer: int | None = None
    protocol: str = "sinkwatch"  # the packaged recipes say "paper" (SPEC §8)
    ablation_revision: str | None = None  # where the paper ran its group ablation (Pythia step143000, OLMo/OLMoE main)

    def __post_init__(self) -> None:
        if self.revisions is not None and self.log_spaced is not None:
            raise ValueError("give revisions or log_spaced, not both")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"recipe protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        unknown = set(self.probes) - {"induction", "repeated", "natural"}
        if unknown:
            raise ValueError(f"unknown probe kinds in recipe: {sorted(unknown)}")

    def probe_recipes(self, text_tokenizer=None) -> list:
        out = []
        for kind, kw in self.probes.items():
            kw = dict(kw or {})
            if "vocab_range" in kw and kw["vocab_range"] is not None:
                kw["vocab_range"] = tuple(kw["vocab_range"])
            if kind == "induction":
                out.append(InductionProbe(**kw))
            elif kind == "repeated":
                out.append(RepeatedRandomProbe(**kw))
            else:
                out.append(NaturalProbe(tokenizer=kw.pop("tokenizer", text_tokenizer or self.model), **kw))
        return out


def packaged_recipes() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("sinkwatch.recipes").iterdir() if p.name.endswith(".yaml"))


def load_recipe(spec: str) -> Recipe:
    """A recipe from a YAML path or a packaged recipe name (``pythia-1b``)."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") and path.exists():
        text = path.read_text()
    elif spec in packaged_recipes():
        text = resources.files("sinkwatch.recipes").joinpath(f"{spec}.yaml").read_text()
    else:
        raise FileNotFoundError(f"no recipe {spec!r}: give a .yaml path or one of {packaged_recipes()}")
    data = yaml.safe_load(text) or {}
    if "revisions" in data and data["revisions"] is not None:
        data["revisions"] = tuple(str(r) for r in data["revisions"])
    allowed = set(Recipe.__dataclass_fields__)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"recipe {spec}: unknown keys {unknown}; valid: {sorted(allowed)}")
    return Recipe(**data)


def is_recipe(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or spec in packaged_recipes()
