"""Replay recipes: what to replay (a hub model, its revisions, dtype, probes, protocol), packaged or from YAML.

A recipe is found by path (``recipes/x.yaml``), by name in the ``SINKWATCH_RECIPES`` directory (a team's own, taking
precedence over packaged ones of the same name), or by packaged name (``pythia-1b``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from ..probe.config import PROTOCOLS
from ..probes import InductionProbe, NaturalProbe, RepeatedRandomProbe
from .revisions import compile_pattern

RECIPES_ENV = "SINKWATCH_RECIPES"  # a directory of the user's own recipe files (NAME.yaml)


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
    protocol: str = "sinkwatch"  # the packaged recipes say "paper" (docs/design.md §8)
    ablation_revision: str | None = None  # where the paper ran its group ablation (Pythia step143000, OLMo/OLMoE main)
    # a regex for revision names no built-in scheme reads (named groups step, tokens, stage, run), tried first
    revision_pattern: str | None = None
    # the file it was loaded from (no YAML key): options that change what it measures make the records protocol "custom"
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        compile_pattern(self.revision_pattern)  # a bad pattern is an error now, not a silent empty listing
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
    """Recipe names: the packaged ones and those in the ``SINKWATCH_RECIPES`` directory."""
    return sorted({p.name[:-5] for p in resources.files("sinkwatch.recipes").iterdir() if p.name.endswith(".yaml")} | set(_user_recipes()))


def _user_recipes() -> dict[str, Path]:
    d = os.environ.get(RECIPES_ENV)
    if not d or not Path(d).is_dir():
        return {}
    return {p.stem: p for p in sorted(Path(d).iterdir()) if p.suffix in (".yaml", ".yml")}


def load_recipe(spec: str) -> Recipe:
    """A recipe from a YAML path, a name in the ``SINKWATCH_RECIPES`` directory, or a packaged name (``pythia-1b``)."""
    path = Path(spec)
    user = _user_recipes()
    if path.suffix in (".yaml", ".yml") and path.exists():
        text, source = path.read_text(), str(path)
    elif spec in user:
        text, source = user[spec].read_text(), str(user[spec])
    elif resources.files("sinkwatch.recipes").joinpath(f"{spec}.yaml").is_file():
        text, source = resources.files("sinkwatch.recipes").joinpath(f"{spec}.yaml").read_text(), spec
    else:
        where = os.environ.get(RECIPES_ENV)
        bad = where and not Path(where).is_dir()
        hint = f" ({RECIPES_ENV}={where} is not a directory)" if bad else f" (or set {RECIPES_ENV} to a directory of NAME.yaml files)"
        raise FileNotFoundError(f"no recipe {spec!r}: give a .yaml path or one of {packaged_recipes()}{hint}")
    data = yaml.safe_load(text) or {}
    if "revisions" in data and data["revisions"] is not None:
        data["revisions"] = tuple(str(r) for r in data["revisions"])
    allowed = set(Recipe.__dataclass_fields__) - {"source"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"recipe {spec}: unknown keys {unknown}; valid: {sorted(allowed)}")
    data.setdefault("name", path.stem if path.suffix in (".yaml", ".yml") else spec)
    return Recipe(**data, source=source)


def is_recipe(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or spec in packaged_recipes()
