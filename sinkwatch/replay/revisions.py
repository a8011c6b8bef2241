"""Revisions of a run: their names, steps and tokens, training order, listing from the hub or a local cache."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..loading import HubUnreachableError, _is_network_error, hub_offline

_STEP = re.compile(r"step(\d+)")
_TOKENS = re.compile(r"tokens(\d+(?:\.\d+)?)([KMBT])", re.IGNORECASE)
_UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


@dataclass(frozen=True)
class Revision:
    """One point of a trajectory, as the replay loop sees it (the seam between listing and fetching).

    ``name``: the branch, tag or folder name as the run published it; ``step``/``tokens``: where in
    training (None when the name does not say); ``run``: which trajectory it belongs to when a model
    publishes parallel ones (OLMo-2's stage-2 ingredients), None for the main one; ``commit``: the
    commit a hub branch resolved to when listed (weights are fetched by it, so a branch that moves
    mid-run cannot mix); ``path``: a local folder or file holding the weights (a user's own run), in
    which case nothing is downloaded.
    """

    name: str
    step: int | None = None
    tokens: int | None = None
    run: str | None = None
    commit: str | None = None
    path: str | None = None


# ---- revisions -----------------------------------------------------------------------------------------
def revision_step(name: str) -> int | None:
    m = _STEP.search(name)
    return int(m.group(1)) if m else None


def revision_tokens(name: str, tokens_per_step: int | None = None) -> int | None:
    """Tokens seen at a revision: from its name (``...-tokens23B``), else step x tokens_per_step."""
    m = _TOKENS.search(name)
    if m:
        return int(round(float(m.group(1)) * _UNITS[m.group(2).upper()]))
    step = revision_step(name)
    if step is not None and tokens_per_step:
        return step * tokens_per_step
    return None


def training_order(revisions: Sequence[str]) -> list[str]:
    """Revisions sorted by step (names without a step go last, in their given order)."""
    with_step = [r for r in revisions if revision_step(r) is not None]
    without = [r for r in revisions if revision_step(r) is None]
    return sorted(with_step, key=revision_step) + without


def select_log_spaced(revisions: Sequence[str], count: int) -> list[str]:
    """About ``count`` revisions whose steps are closest to log-spaced targets (first and last kept)."""
    ordered = [r for r in training_order(revisions) if revision_step(r) is not None]
    if len(ordered) <= count:
        return ordered
    steps = np.array([max(revision_step(r), 1) for r in ordered], dtype=float)
    targets = np.geomspace(steps[0], steps[-1], num=count)
    picked = {int(np.argmin(np.abs(np.log(steps) - np.log(t)))) for t in targets}
    return [ordered[i] for i in sorted(picked)]


def list_revisions(model: str, *, cache_dir: str | None = None) -> list[str]:
    """Branch names of a hub model via ``huggingface_hub.list_repo_refs`` (never computed).

    Offline (``HF_HUB_OFFLINE=1``), the refs of the local cache are listed instead.
    """
    import huggingface_hub

    if not hub_offline():
        try:
            refs = huggingface_hub.list_repo_refs(model)
            return [b.name for b in refs.branches]
        except Exception as exc:  # noqa: BLE001 - classified: network problems get advice
            if _is_network_error(exc):
                raise HubUnreachableError(_offline_advice(model)) from exc
            raise
    refs = _cache_repo_dir(model, cache_dir) / "refs"
    if not refs.is_dir():
        raise HubUnreachableError(_offline_advice(model))
    return sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file())


def _cache_repo_dir(model: str, cache_dir: str | None) -> Path:
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(cache_dir or HF_HUB_CACHE) / ("models--" + model.replace("/", "--"))


def _offline_advice(model: str) -> str:
    return (
        f"cannot reach the Hugging Face hub to list or download {model}'s revisions. Replay from a local cache "
        "instead: on a machine with network run `hf download MODEL --revision REV` for each revision "
        "(or copy an existing HF cache), then set HF_HUB_OFFLINE=1 and HF_HOME (or pass --cache-dir) to point at it"
    )


def check_hub(model: str) -> None:
    """Fail fast with advice when the hub cannot be reached and replay is not explicitly offline."""
    if hub_offline() or os.path.isdir(model):
        return
    import huggingface_hub

    try:
        huggingface_hub.model_info(model, timeout=10)
    except Exception as exc:  # noqa: BLE001
        if _is_network_error(exc):
            raise HubUnreachableError(_offline_advice(model)) from exc
