"""What a replay measures, resolved once before anything is fetched (docs/design.md §8): the recipe, the manifest, the
tasks this call works on, the protocol label, probe sets, dtype and replay key; for the workers' loop (``run``), the
plan, and the engines' unit and finalize (``unit``)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..models.hub import check_hub
from ..probe.config import MonitorConfig
from .local import is_local
from .manifest import MANIFEST_FILE, Manifest, Task, local_source
from .manifest import resolve as resolve_manifest
from .options import ReplayOptions
from .protocol import ProtocolLabel, resolve_protocol
from .provenance import DuplicateGroup, warn_duplicates
from .recipes import Recipe
from .revisions import Revision
from .source import RevisionSource
from .store import check_records, replay_key, stored_records


@dataclass
class ReplaySetup:
    recipe: Recipe
    manifest: Manifest
    tasks: list[Task]  # the tasks this call works on, in the manifest's order
    key: dict
    cfg: MonitorConfig
    protocol: str
    probes: list
    dtype: str
    ablation: str | None
    source: RevisionSource  # where the revisions come from (a hub model or a local folder) and how a local one loads
    label: ProtocolLabel  # what the records say they measured (paper | sinkwatch | custom, and what changed)
    flags: dict[str, DuplicateGroup]  # revisions whose weights are another's (provenance.find_duplicates, over the whole run)
    skip_duplicates: bool = False
    changed: set[str] = field(default_factory=set)  # local checkpoints rewritten since the manifest was written
    unverified: dict[str, str] = field(default_factory=dict)  # revision -> why its weights could not be read

    @property
    def revisions(self) -> list[Revision]:
        """Every member of this call's tasks, in training order."""
        names = {n for t in self.tasks for n in t.members}
        return [r for r in self.manifest.measured() if r.name in names]

    def rev(self, name: str) -> Revision:
        return self.manifest.revision(name)

    def needed(self, task: Task) -> list[Revision]:
        """The members ``task`` records (under --skip-duplicates, not the flagged ones)."""
        return [self.rev(n) for n in task.members if not (self.skip_duplicates and n in self.flags)]


def prepare_replay(model, options: ReplayOptions, *, manifest: str = "use", running=()) -> ReplaySetup:
    """What to replay and how. ``manifest`` (``manifest.resolve``): ``use`` (a worker or the driver: written when there is
    none), ``require`` (the unit, finalize: read it, ask the hub nothing, the selection options unread), ``peek`` (the
    plan: write nothing). ``options.rewrite_manifest``: update the plan (refused while ``running`` names tasks)."""
    o = options
    out_dir = o.out_dir
    recipe = model if isinstance(model, Recipe) else Recipe(model=model)
    if is_local(recipe.model):  # one run, however its path is spelled (run/, ./run, /abs/run): one replay key, one store
        recipe = dataclasses.replace(recipe, model=str(Path(recipe.model).resolve()))
    if o.revisions is not None:
        names = [r.name if isinstance(r, Revision) else str(r) for r in o.revisions]
    elif o.all_revisions or o.log_spaced:
        names = None  # the listing: every published revision (log-spaced: N of them)
    else:
        names = list(recipe.revisions) if recipe.revisions else None
    tps = o.tokens_per_step or recipe.tokens_per_step
    protocol = o.protocol or (o.monitor_config.protocol if o.monitor_config else None)
    label = resolve_protocol(recipe, probes=o.probes, dtype=o.dtype, protocol=protocol)
    log_spaced = o.log_spaced or (recipe.log_spaced if names is None else None)
    local = None
    if is_local(recipe.model):  # a local run: its folder is its listing, each checkpoint hashed once (the store's hash cache)
        local = local_source(recipe, out_dir=out_dir, tokens_per_step=tps, lightning_module=o.lightning_module, live_store=o.live_store,
                             write=manifest != "peek")  # fmt: skip
    elif o.lightning_module or o.live_store:
        raise ValueError(f"--lightning-module and --live-store are for a local folder of checkpoints; {recipe.model} is no path on "
                         "this machine")  # fmt: skip
    if o.probes is not None:
        probe_list = list(o.probes)
    else:  # a live run's own probe sets (its store's probes.json), else the recipe's
        probe_list = (local.live_probes() if local is not None else None) or recipe.probe_recipes()
    # a live store's probe_dtype (the trainer's compute dtype the callback probed in), unless --dtype says otherwise
    live = (getattr(local.local, "live_state", None) or {}) if local is not None and local.local is not None else {}
    dtype = o.dtype or live.get("probe_dtype") or recipe.dtype
    key = replay_key(recipe.model, dtype, label.label, probe_list)
    if manifest == "use" and out_dir is not None and Path(out_dir).is_dir():
        check_records(stored_records(out_dir), key, out_dir)  # a store of another measurement: refused before the plan is touched
    has_manifest = out_dir is not None and (Path(out_dir) / MANIFEST_FILE).is_file()
    if local is None and manifest != "require" and (o.rewrite_manifest or not has_manifest):
        check_hub(recipe.model)  # the hub is asked: an unreachable one stops here, with the advice
    m, tasks = resolve_manifest(
        recipe, names, key=key, out_dir=out_dir, mode=manifest, log_spaced=log_spaced, cache_dir=o.cache_dir, tokens_per_step=tps,
        local_source=local, rewrite=o.rewrite_manifest, skip_duplicates=o.skip_duplicates, running=running, policy=o.fetch,
    )  # fmt: skip
    source = m.source(o.cache_dir, local.local if local is not None else None)
    whole = m.groups()
    planned = {n for t in tasks for n in t.members}
    flags = {n: g for n, g in whole.items() if n in planned}
    if manifest != "require":  # the driver and the workers say it; each engine task's records carry it
        warn_duplicates(recipe.model, flags)
    skip = o.skip_duplicates or m.skip_duplicates
    if not any(not (skip and n in flags) for n in planned) and manifest != "require":
        raise ValueError(f"no revisions to replay for {recipe.model}")
    changed = set()
    if local is not None:  # a checkpoint rewritten since the plan: its weights are not the planned ones
        now = {r.name: r.commit for r in local.revisions}
        changed = {n for n in planned if n in now and now[n] != m.entries[n].get("commit")}
        if changed:
            warnings.warn(
                f"sinkwatch replay: {', '.join(sorted(changed))} changed on disk since {out_dir}/manifest.json was written: the plan "
                "still holds the weights it fingerprinted then. Write it again with --rewrite-manifest to measure the new ones",
                RuntimeWarning, stacklevel=2,
            )  # fmt: skip
    cfg = o.monitor_config or MonitorConfig(batch_tokens=o.batch_tokens or recipe.batch_tokens)  # batch_tokens: memory only
    cfg = dataclasses.replace(cfg, protocol=label.computation)
    return ReplaySetup(recipe, m, tasks, key, cfg, label.computation, probe_list, dtype, None, source, label, flags,
                       skip_duplicates=skip, changed=changed)  # fmt: skip


def ablation_at(s: ReplaySetup, o: ReplayOptions) -> str | None:
    """Where the group ablation runs (``o.ablation_revision``, else the recipe's, else the last revision); None when
    ``o.ablate`` is off (default: on under protocol paper when the recipe names an ablation revision)."""
    at = o.ablation_revision or s.recipe.ablation_revision
    ablate = o.ablate if o.ablate is not None else (s.protocol == "paper" and at is not None)
    return (at or s.revisions[-1].name) if ablate else None
