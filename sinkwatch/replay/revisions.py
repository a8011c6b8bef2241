"""Revisions of a run: their names (steps, tokens, stages, parallel runs), training order, log-spaced selection, and
listing from the hub or a local cache with the commit each name resolved to.

Naming schemes in use (each a full match of the name; ``revision_pattern`` of a recipe is tried first):

==========================================  ==============================================================
``step143000``, ``step11000-tokens23B``       Pythia, OLMo-1 / OLMoE
``stage1-step928646-tokens3896B``             OLMo-2/3; ``stage2-ingredient1-step1000-tokens5B`` is run
                                              ``stage2-ingredient1``, a parallel run after stage 1
``step-125000``, ``step-001000-2BT``          SmolLM2; FineWeb ablation models (2BT: 2 billion tokens)
``iter_0373000``                              Megatron-LM conversions
``checkpoint-1000``                           the HF Trainer's ``output_dir``
==========================================  ==============================================================

A name without a step (``main``, a tag) is no trajectory point: listing leaves it out; a replay takes it only when named.
Tokens seen come from the name (``tokens23B``, ``-2BT``), else step x tokens_per_step. A later stage counts from its own
start (OLMo-2: ``stage2-…-tokens5B`` is 5B tokens after stage 1's end), so its tokens add the largest count of the stage
before it among the names listed together; without that stage they are None, never drawn as if training started there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from ..models.hub import is_commit_id, list_refs

_UNITS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
_NUM = r"\d+(?:\.\d+)?"
_TOKENS = rf"{_NUM}[KMBT]"
# (what it is, the full-match pattern); named groups: step, tokens, stage, run
SCHEMES: tuple[tuple[str, re.Pattern], ...] = (
    ("stepN / stepN-tokensNB (Pythia, OLMo-1)", re.compile(rf"step(?P<step>\d+)(?:-tokens(?P<tokens>{_TOKENS}))?", re.IGNORECASE)),
    (
        "stageK-…-stepN-tokensNB (OLMo-2/3)",
        re.compile(rf"stage(?P<stage>\d+)-(?:(?P<run>[A-Za-z][\w.]*?)-)?step(?P<step>\d+)(?:-tokens(?P<tokens>{_TOKENS}))?", re.IGNORECASE),
    ),
    ("step-N / step-N-xBT (SmolLM2, FineWeb ablations)", re.compile(rf"step-(?P<step>\d+)(?:-(?P<tokens>{_TOKENS})T)?", re.IGNORECASE)),
    ("iter_N (Megatron-LM)", re.compile(r"iter_(?P<step>\d+)")),
    ("checkpoint-N (HF Trainer)", re.compile(r"checkpoint-(?P<step>\d+)")),
)
PATTERN_GROUPS = ("step", "tokens", "stage", "run")


@dataclass(frozen=True)
class Revision:
    """One point of a trajectory, as the replay loop sees it (the seam between listing and fetching)."""

    name: str  # the branch, tag or folder name as the run published it
    step: int | None = None  # where in training; None when the name does not say
    tokens: int | None = None
    run: str | None = None  # a parallel trajectory (OLMo-2's stage-2 ingredients); None: the main one
    # a hub branch's commit when listed (fetched by it: a branch moving mid-run cannot mix); a local revision's weights
    # fingerprint (a rewritten checkpoint is measured again)
    commit: str | None = None
    path: str | None = None  # a local folder or file of weights (a user's own run): nothing is downloaded
    stage: int | None = None  # the training stage its name gives (OLMo-2's ``stage2-…``)


R = TypeVar("R", str, Revision, dict)


# ---- names ----------------------------------------------------------------------------------------------
def compile_pattern(pattern: str | re.Pattern | None) -> re.Pattern | None:
    """A recipe's ``revision_pattern``, checked: a regex with the named group ``step`` (others: tokens, stage, run)."""
    if pattern is None or isinstance(pattern, re.Pattern):
        return pattern
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"revision_pattern {pattern!r} is not a valid regular expression: {exc}") from None
    groups = set(compiled.groupindex)
    if "step" not in groups:
        raise ValueError(
            f"revision_pattern {pattern!r} needs a named group (?P<step>\\d+) (optional: tokens, stage, run), "
            r"e.g. 'ckpt-(?P<step>\d+)'"
        )
    unknown = groups - set(PATTERN_GROUPS)
    if unknown:
        raise ValueError(f"revision_pattern {pattern!r} has unknown named groups {sorted(unknown)}; valid: {list(PATTERN_GROUPS)}")
    return compiled


def parse_tokens(text: str) -> int:
    """``23B`` -> 23e9, ``1.5T``, ``614K``; a bare number is a token count."""
    m = re.fullmatch(rf"({_NUM})([KMBT]?)", text.strip(), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a token count from {text!r} (a number with an optional K/M/B/T unit)")
    return int(round(float(m.group(1)) * _UNITS[m.group(2).upper()]))


def _match(name: str, pattern: re.Pattern | None) -> re.Match | None:
    if pattern is not None:
        m = pattern.fullmatch(name)
        if m:
            return m
    for _, scheme in SCHEMES:
        m = scheme.fullmatch(name)
        if m:
            return m
    return None


def parse_revision(
    name: str, *, pattern: str | re.Pattern | None = None, tokens_per_step: int | None = None, commit: str | None = None
) -> Revision:
    """Step, tokens, stage and run of one name (a later stage's tokens its own; ``parse_revisions`` adds the stages before)."""
    m = _match(name, compile_pattern(pattern))
    if m is None:
        return Revision(name, commit=commit)
    g = {k: v for k, v in m.groupdict().items() if v is not None}
    step = int(g["step"]) if "step" in g else None
    stage = int(g["stage"]) if "stage" in g else None
    run = g.get("run")
    if run is not None and m.re is SCHEMES[1][1]:
        run = f"stage{stage}-{run}"  # OLMo-2's ingredients: the stage is part of the run's name
    tokens = parse_tokens(g["tokens"]) if "tokens" in g else None
    if tokens is None and step is not None and tokens_per_step:
        tokens = step * tokens_per_step
    return Revision(name, step=step, tokens=tokens, run=run, commit=commit, stage=stage)


def parse_revisions(names: Iterable[str], *, pattern: str | re.Pattern | None = None, tokens_per_step: int | None = None,
                    commits: dict[str, str | None] | None = None) -> list[Revision]:  # fmt: skip
    """Every name parsed, a later stage's tokens continued from the stage before it, in training order."""
    pattern = compile_pattern(pattern)
    commits = commits or {}
    revs = [parse_revision(n, pattern=pattern, tokens_per_step=tokens_per_step, commit=commits.get(n)) for n in dict.fromkeys(names)]
    return training_order(_continue_stages(revs))


def _continue_stages(revs: list[Revision]) -> list[Revision]:
    """Tokens of stage K >= 2 = their own + the largest (already continued) count of stage K - 1."""
    stages = sorted({r.stage for r in revs if r.stage is not None})
    end: dict[int, int | None] = {}
    out = {id(r): r for r in revs}
    for k in stages:
        members = [r for r in revs if r.stage == k]
        if k >= 2:
            offset = end.get(k - 1)
            for r in members:
                out[id(r)] = replace(r, tokens=None if offset is None or r.tokens is None else r.tokens + offset)
        counted = [out[id(r)].tokens for r in members if out[id(r)].tokens is not None]
        end[k] = max(counted) if counted else None
    return [out[id(r)] for r in revs]


def as_revision(item: str | Revision | dict, pattern: str | re.Pattern | None = None) -> Revision:
    """A name (parsed), a Revision (itself) or a stored record (its revision, step, run and stage)."""
    if isinstance(item, Revision):
        return item
    if isinstance(item, dict):
        return Revision(
            item.get("revision") or "", step=item.get("step"), tokens=item.get("tokens"), run=item.get("run"), stage=item.get("stage")
        )
    return parse_revision(item, pattern=pattern)


def order_key(item: str | Revision | dict, pattern: str | re.Pattern | None = None) -> tuple:
    """Training order: revisions with a step by stage, run (the main run first), step; names without a step last."""
    r = as_revision(item, pattern)
    return (r.step is None, r.stage or 0, r.run or "", r.step or 0)


def training_order(items: Sequence[R], pattern: str | re.Pattern | None = None) -> list[R]:
    """Names, Revisions or records in training order (stable: names without a step last, in their given order)."""
    pattern = compile_pattern(pattern)
    return sorted(items, key=lambda x: order_key(x, pattern))


def revision_step(name: str, pattern: str | re.Pattern | None = None) -> int | None:
    return parse_revision(name, pattern=pattern).step


def revision_tokens(name: str, tokens_per_step: int | None = None, pattern: str | re.Pattern | None = None) -> int | None:
    """Tokens seen at a revision: from its name (``...-tokens23B``, ``-2BT``), else step x tokens_per_step."""
    return parse_revision(name, pattern=pattern, tokens_per_step=tokens_per_step).tokens


def runs_of(items: Sequence[R], pattern: str | re.Pattern | None = None) -> dict[str | None, list[R]]:
    """The trajectory points (items with a step) grouped by run (None: the main run), each in training order."""
    out: dict[str | None, list[R]] = {}
    for item in training_order(items, pattern):
        r = as_revision(item, pattern)
        if r.step is not None:
            out.setdefault(r.run, []).append(item)
    return out


def lineage(items: Sequence[R], run: str | None, pattern: str | re.Pattern | None = None) -> list[R]:
    """What a run's stages are derived over, in training order: the main run's points; for a parallel run (an OLMo-2
    ingredient), the main run's points before it, then its own."""
    groups = runs_of(items, pattern)
    main = groups.get(None, [])
    if run is None:
        return main
    own = groups.get(run, [])
    if not own:
        return []
    first = order_key(own[0], pattern)
    return [m for m in main if order_key(m, pattern) < first] + own


def select_log_spaced(items: Sequence[R], count: int, pattern: str | re.Pattern | None = None) -> list[R]:
    """``count`` revisions of each run, closest to log-spaced steps (first and last kept; each target takes the nearest
    revision not yet taken: exactly ``count`` when there are as many). Names without a step are never picked."""
    picked: list[R] = []
    for members in runs_of(items, pattern).values():
        if len(members) <= count:
            picked += members
            continue
        logs = np.log([max(as_revision(m, pattern).step, 1) for m in members])
        targets = np.linspace(logs[0], logs[-1], num=count)
        taken = {0, len(members) - 1}
        for t in targets[1:-1]:
            free = [i for i in range(len(members)) if i not in taken]
            taken.add(min(free, key=lambda i: (abs(logs[i] - t), i)))
        picked += [members[i] for i in sorted(taken)]
    return training_order(picked, pattern)


# ---- listing ------------------------------------------------------------------------------------------
def list_revisions(model: str, *, cache_dir: str | None = None, pattern: str | re.Pattern | None = None,
                   tokens_per_step: int | None = None, stepless: bool = False) -> list[Revision]:  # fmt: skip
    """The revisions of a hub model (its listed refs; names are never computed), each with its commit, in training
    order. Names without a step (``main``, tags) only with ``stepless``."""
    refs = list_refs(model, cache_dir=cache_dir)
    revs = parse_revisions(refs, pattern=pattern, tokens_per_step=tokens_per_step, commits=refs)
    return revs if stepless else [r for r in revs if r.step is not None]


@dataclass(frozen=True)
class RevisionSelection:
    """What a replay measures of a run's listing, and what else the plan keeps of it (``select_revisions``)."""

    chosen: list[Revision]  # what is measured, in training order
    listed: list[Revision]  # every revision with a step, and every named one: the run the duplicate groups are found over
    aliases: list[Revision]  # refs without a step that were not named (main, tags): names a duplicate may be known by


def select_revisions(listing: Mapping[str, str | None] | Sequence[Revision], names: Sequence[str] | None = None, *,
                     pattern: str | re.Pattern | None = None, tokens_per_step: int | None = None,
                     log_spaced: int | None = None) -> RevisionSelection:  # fmt: skip
    """A replay's selection rule: the ``names`` asked for (a recipe's, ``--revisions``) or every listed revision with a
    step, then ``log_spaced`` of them per run, in training order.

    ``listing``: a local run's revisions (all listed), or a hub model's refs (name -> commit, ``list_refs``), parsed
    with ``names`` so a stage-2 name given alone continues from stage 1's listed end. A named revision that is no ref
    keeps its name as commit when it is a commit id (``is_commit_id``), else none (loading then fails, recorded as
    failed); a ref always wins. Unnamed refs without a step (``main``, tags) are ``aliases``, never measured; named, they
    are measured (last: no step)."""
    wanted = set(names or ())
    if isinstance(listing, Mapping):
        commits = {**{n: n for n in wanted if is_commit_id(n)}, **listing}
        every = parse_revisions([*listing, *(names or ())], pattern=pattern, tokens_per_step=tokens_per_step, commits=commits)
        listed = [r for r in every if r.step is not None or r.name in wanted]
        aliases = [r for r in every if r.step is None and r.name not in wanted]
    else:
        listed, aliases = list(listing), []
    chosen = [r for r in listed if r.step is not None] if names is None else [r for r in listed if r.name in wanted]
    if log_spaced:
        chosen = select_log_spaced(chosen, log_spaced)
    return RevisionSelection(chosen=chosen, listed=listed, aliases=aliases)
