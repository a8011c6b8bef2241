"""What a replay measures, resolved once before anything is fetched (SPEC §8): the recipe, the revisions in
training order (the manifest's: commits, weights, duplicate groups over the whole run), the protocol
label, the probe sets, the dtype and the replay key — shared by the claim loop (``run``), the plan,
and the engines' unit and finalize (``unit``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..monitor import MonitorConfig
from .local import is_local
from .manifest import MANIFEST_FILE, Manifest, local_source
from .manifest import resolve as resolve_manifest
from .protocol import ProtocolLabel, resolve_protocol
from .provenance import DuplicateGroup, warn_duplicates
from .recipes import Recipe
from .revisions import Revision, check_hub
from .source import RevisionSource
from .store import replay_key


@dataclass
class ReplaySetup:
    recipe: Recipe
    revisions: list[Revision]  # every revision of the replay, in training order
    mine: list[Revision]  # this worker's: all of them, or its static shard
    key: dict
    cfg: MonitorConfig
    protocol: str
    probes: list
    dtype: str
    ablation: str | None
    source: RevisionSource  # where the revisions come from (a hub model or a local folder) and how a local one loads
    label: ProtocolLabel  # what the records say they measured (paper | sinkwatch | custom, and what changed)
    flags: dict[str, DuplicateGroup]  # revisions whose weights are another's (provenance.find_duplicates, over the whole run)
    manifest: Manifest | None = None


def prepare_replay(
    model,
    *,
    revisions,
    log_spaced,
    probes,
    dtype,
    tokens_per_step,
    batch_tokens,
    monitor_config,
    protocol,
    cache_dir,
    shard,
    lightning_module=None,
    live_store=None,
    skip_duplicates=False,
    out_dir=None,
    manifest="reuse",
) -> ReplaySetup:
    """What to replay and how. ``manifest`` (``manifest.resolve``): ``reuse`` (a worker), ``refresh``
    (the driver writing ``DIR/manifest.json``), ``require`` (the unit, finalize: read it, ask the hub
    nothing), ``peek`` (the plan: write nothing)."""
    recipe = model if isinstance(model, Recipe) else Recipe(model=model)
    if is_local(recipe.model):  # one run, however its path is spelled (run/, ./run, /abs/run): one replay key, one store
        recipe = dataclasses.replace(recipe, model=str(Path(recipe.model).resolve()))
    names = list(revisions) if revisions is not None else (list(recipe.revisions) if recipe.revisions else None)
    names = [r.name if isinstance(r, Revision) else str(r) for r in names] if names is not None else None
    tps = tokens_per_step or recipe.tokens_per_step
    label = resolve_protocol(recipe, probes=probes, dtype=dtype, protocol=protocol or (monitor_config.protocol if monitor_config else None))
    log_spaced = log_spaced or recipe.log_spaced
    local = None
    if is_local(recipe.model):  # a local run: its folder is its listing, each checkpoint hashed once (the store's hash cache)
        local = local_source(
            recipe, None if manifest == "require" else names, out_dir=out_dir, log_spaced=log_spaced, tokens_per_step=tps,
            lightning_module=lightning_module, live_store=live_store, write=manifest != "peek",
        )  # fmt: skip
    elif lightning_module or live_store:
        raise ValueError(
            f"--lightning-module and --live-store are for a local folder of checkpoints; {recipe.model} is no path on this machine"
        )
    probe_list = list(probes) if probes is not None else ((local.live_probes() if local is not None else None) or recipe.probe_recipes())
    # a live store's probe_dtype (the trainer's compute dtype the callback probed in), unless --dtype says otherwise
    live = (getattr(local.local, "live_state", None) or {}) if local is not None and local.local is not None else {}
    dtype = dtype or live.get("probe_dtype") or recipe.dtype
    key = replay_key(recipe.model, dtype, label.label, probe_list)
    if local is None and manifest != "require" and not (out_dir is not None and (Path(out_dir) / MANIFEST_FILE).is_file()):
        check_hub(recipe.model)  # no manifest yet: an unreachable hub stops here, with the advice
    # each revision with the commit its name resolves to now (weights are fetched by it; its done key names
    # those weights), its weights' fingerprint from metadata, and the duplicate groups of the whole run
    m, source = resolve_manifest(
        recipe, names, key=key, out_dir=out_dir, mode=manifest, log_spaced=log_spaced, cache_dir=cache_dir, tokens_per_step=tps,
        local_source=local,
    )  # fmt: skip
    whole = m.groups()
    flags = {r.name: whole[r.name] for r in source.revisions if r.name in whole}
    warn_duplicates(recipe.model, flags)
    ordered = [r for r in source.revisions if not (skip_duplicates and r.name in flags)]  # --skip-duplicates: never downloaded
    if not ordered:
        raise ValueError(f"no revisions to replay for {recipe.model}")
    k, n = shard or (0, 1)
    cfg = monitor_config or MonitorConfig(batch_tokens=batch_tokens or recipe.batch_tokens)  # batch_tokens: memory only
    cfg = dataclasses.replace(cfg, protocol=label.computation)
    s = ReplaySetup(recipe, ordered, ordered[k::n], key, cfg, label.computation, probe_list, dtype, None, source, label, flags)
    s.manifest = m
    return s
