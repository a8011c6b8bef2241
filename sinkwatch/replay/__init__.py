"""Replay published training checkpoints (docs/design.md §8): one record per revision, resumable, on any engine.

    sinkwatch replay pythia-1b                      # a packaged recipe (or recipes/pythia-1b.yaml)
    sinkwatch replay EleutherAI/pythia-410m --log-spaced 8 --out runs/pythia-410m

Each revision is downloaded by the commit its branch resolved to (or read from a local Hugging Face cache when
``HF_HUB_OFFLINE=1``), probed with the same ``Monitor`` as a live run, and written whole as one record,
``DIR/records/KEY.json`` (KEY: its done key). A revision done anywhere in the store is skipped; one that fails is recorded
with its reason and the others go on. The plan is the store's manifest, written once; engines (Slurm arrays, submitit,
Ray) schedule its tasks, plain workers share them by a stride and one pass (``run``).

One module per idea:

- ``recipes``: what to replay (``Recipe``, packaged and YAML recipes);
- ``options``: how to replay it: every option of ``replay``, ``replay_plan``, the unit and the CLI, once (``ReplayOptions``);
- ``revisions``: revision names, steps, tokens, training order, listing (hub or local cache), the selection rule;
- ``store``: the replay key, the done key, the record files;
- ``merged``: the store as the report reads it (duplicate groups from the manifest, stages over the trajectory);
- ``workers``: who this worker is, whatever launched it;
- ``manifest``: the plan: refs, commits, fingerprints, duplicate groups and named tasks, written once (``DIR/manifest.json``);
- ``attempts``: one attempt at a task: a download folder and a marker of its own, held (flock) while it lives;
- ``signals``: SIGTERM as an exception, so a replay writes its failed rows before it exits;
- ``fetch``: download by commit into the task's folder, prefetch, retries;
- ``plan``: sizes, disk, memory and time before the work (``--plan``); the hub's side and where a model fits are ``models/``'s;
- ``ablation``: the paper's group ablation at one revision (``DIR/ablation.json``);
- ``prepare``: what one replay measures, resolved once (the manifest and its tasks, protocol, probe sets, replay key);
- ``measure``: one task placed, fetched, probed, written and its folder emptied (and the ablation, once);
- ``devices``: a worker's device, the out-of-memory retry, peak memory, memory given back;
- ``run``: workers without an engine: a stride of the tasks, then one pass (``replay``, ``replay_plan``);
- ``unit``: the engines' side: ``write_manifest``, the per-task unit ``replay_revision``, ``failed_tasks``, ``finalize``;
- ``ray_limits``: a time limit for Ray tasks (``run_with_limit``: ``ray.wait``, cancel).
"""

from __future__ import annotations

from ..models.hub import check_hub, list_refs
from .ablation import (
    ABLATION_FILE,
    PAPER_ABLATION_DTYPE,
    PAPER_CONTROL_RULE,
    ablation_key,
    check_ablation,
    paper_ablation_sets,
    read_ablation,
    run_ablation,
)
from .fetch import FetchConfig
from .manifest import MANIFEST_FILE, Manifest, Task, array_range, read_manifest
from .merged import duplicate_groups, merged_records
from .options import ReplayOptions
from .plan import Plan, format_plan
from .ray_limits import run_with_limit
from .recipes import Recipe, is_recipe, load_recipe, packaged_recipes
from .revisions import (
    Revision,
    list_revisions,
    parse_revision,
    parse_revisions,
    revision_step,
    revision_tokens,
    runs_of,
    select_log_spaced,
    select_revisions,
    training_order,
)
from .run import replay, replay_plan
from .store import (
    ReplayStore,
    StoreMismatchError,
    done_key,
    failed_revisions,
    key_difference,
    key_of,
    record_files,
    replay_key,
)
from .unit import RevisionFailed, failed_tasks, finalize, replay_revision, write_manifest
from .workers import Worker, detect_worker, parse_shard

__all__ = ["ABLATION_FILE", "MANIFEST_FILE", "Manifest", "RevisionFailed", "PAPER_ABLATION_DTYPE", "PAPER_CONTROL_RULE", "FetchConfig",
    "Plan", "Recipe", "ReplayOptions", "ReplayStore", "Revision", "StoreMismatchError", "Task", "Worker", "ablation_key",
    "array_range", "check_ablation", "check_hub", "detect_worker", "done_key", "duplicate_groups", "failed_revisions", "failed_tasks",
    "finalize", "format_plan", "is_recipe", "key_difference", "key_of", "list_refs", "list_revisions", "load_recipe", "merged_records",
    "packaged_recipes", "paper_ablation_sets", "parse_revision", "parse_revisions", "parse_shard", "read_ablation", "read_manifest",
    "record_files", "replay", "replay_key", "replay_plan", "replay_revision", "revision_step", "revision_tokens", "run_ablation",
    "run_with_limit", "runs_of", "select_log_spaced", "select_revisions", "training_order", "write_manifest"]  # fmt: skip
