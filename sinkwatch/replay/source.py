"""Where a replay's revisions come from — a hub model (or its local cache) or a folder of the user's own
checkpoints — and how each is loaded: the one entry point the loop calls (``revision_source``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..loading import load_model
from .local import LocalRun, is_local, local_run, warn_notes
from .provenance import DuplicateGroup, Weights, find_duplicates, fingerprints
from .recipes import Recipe
from .revisions import Revision, check_hub, resolve_revisions, select_log_spaced


@dataclass
class RevisionSource:
    """The revisions to measure (training order), their weights (what the fingerprint and the duplicate
    check read, before any download), the refs that may name a duplicate group without being measured
    (``main``), and the loader."""

    model: str
    revisions: list[Revision]
    weights: dict[str, Weights] = field(default_factory=dict)
    aliases: list[Revision] = field(default_factory=list)
    local: LocalRun | None = None
    cache_dir: str | None = None

    def revision(self, name: str) -> Revision:
        """A revision by name (the ablation's ``main`` may be no measured revision: its ref's commit)."""
        for r in [*self.revisions, *self.aliases]:
            if r.name == name:
                return r
        return Revision(name)

    def load(self, rev: Revision | str, *, dtype: str, device: str | None = None):
        """A hub revision by the commit its branch resolved to when listed (a branch that moves meanwhile
        cannot mix weights into this record); a local one from its files."""
        rev = self.revision(rev) if isinstance(rev, str) else rev
        if self.local is not None:
            return self.local.load(rev, dtype=dtype, device=device)
        return load_model(self.model, revision=rev.commit or rev.name, dtype=dtype, device=device, cache_dir=self.cache_dir)

    def duplicates(self) -> dict[str, DuplicateGroup]:
        """name -> flagged group, for the revisions whose weight files are another's (from metadata
        only: what ``--skip-duplicates`` and the plan drop before downloading)."""
        return find_duplicates(self.revisions, self.weights, aliases=self.aliases)

    def live_probes(self) -> list | None:
        """A local run's live probe sets (its callback state), else None."""
        return self.local.live_probes() if self.local is not None else None


def revision_source(
    recipe: Recipe,
    names: Sequence[str] | None = None,
    *,
    log_spaced: int | None = None,
    cache_dir: str | None = None,
    tokens_per_step: int | None = None,
    lightning_module: str | None = None,
    live_store: str | None = None,
) -> RevisionSource:
    """The revisions of ``recipe.model`` — a hub id or a local path — to replay, with their commits and weights."""
    if is_local(recipe.model):
        run = local_run(
            recipe.model, names=names, tokens_per_step=tokens_per_step, lightning_module=lightning_module, live_store=live_store
        )
        warn_notes(run)
        revs = select_log_spaced(run.revisions, log_spaced) if log_spaced and not names else run.revisions
        return RevisionSource(recipe.model, revs, weights=run.weights, local=run)
    if lightning_module or live_store:
        raise ValueError(
            f"--lightning-module and --live-store are for a local folder of checkpoints; {recipe.model} is no path on this machine"
        )
    check_hub(recipe.model)
    revs, refs = resolve_revisions(
        recipe.model, names, cache_dir=cache_dir, pattern=recipe.revision_pattern, tokens_per_step=tokens_per_step, log_spaced=log_spaced
    )
    measured = {r.name for r in revs}
    aliases = [Revision("main", commit=refs["main"])] if "main" in refs and "main" not in measured else []
    weights = fingerprints(recipe.model, [*revs, *aliases], cache_dir=cache_dir)
    return RevisionSource(recipe.model, revs, weights=weights, aliases=aliases, cache_dir=cache_dir)
