"""Where a replay's revisions come from (a hub model or its local cache, or a folder of the user's checkpoints) and how
each is loaded: the one entry point the loop calls (``revision_source``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.loading import load_model
from .local import LocalRun, is_local, local_run, warn_notes
from .provenance import Weights
from .recipes import Recipe
from .revisions import Revision


@dataclass
class RevisionSource:
    """The revisions to measure (training order), their weights (read by the fingerprint and duplicate check before any
    download), refs that may name a duplicate group without being measured (``main``), and the loader."""

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
        """A hub revision by the commit its branch resolved to when listed (a moving branch cannot mix weights into this
        record); a local one from its files."""
        rev = self.revision(rev) if isinstance(rev, str) else rev
        if self.local is not None:
            return self.local.load(rev, dtype=dtype, device=device)
        return load_model(self.model, revision=rev.commit or rev.name, dtype=dtype, device=device, cache_dir=self.cache_dir)

    def live_probes(self) -> list | None:
        """A local run's live probe sets (its callback state), else None."""
        return self.local.live_probes() if self.local is not None else None


def revision_source(recipe: Recipe, *, tokens_per_step: int | None = None, lightning_module: str | None = None,
                    live_store: str | None = None) -> RevisionSource:  # fmt: skip
    """Every checkpoint of the local run ``recipe.model`` (a folder), with its weights: the listing a manifest is written
    from (a hub model's listing is the manifest's own)."""
    if not is_local(recipe.model):
        raise ValueError(f"{recipe.model} is no path on this machine")
    run = local_run(recipe.model, tokens_per_step=tokens_per_step, lightning_module=lightning_module, live_store=live_store)
    warn_notes(run)
    return RevisionSource(recipe.model, run.revisions, weights=run.weights, local=run)
