"""Replay published training checkpoints (SPEC §8): one record per revision, resumable, shardable.

    sinkwatch replay pythia-1b                      # a packaged recipe (or recipes/pythia-1b.yaml)
    sinkwatch replay EleutherAI/pythia-410m --log-spaced 8 --out runs/pythia-410m

Each revision is loaded with ``from_pretrained(model, revision=...)`` — the real hub, or a local
Hugging Face cache when ``HF_HUB_OFFLINE=1`` — probed with the same ``Monitor`` as a live run, and
written as one record to ``DIR/records.jsonl`` (``records.shard-K-of-N.jsonl`` when sharded). A
record is appended only once complete; a rerun skips revisions already done; a revision that fails
is recorded with its reason and the others go on.

One module per idea:

- ``recipes``: what to replay (``Recipe``, packaged and YAML recipes);
- ``revisions``: revision names, steps, tokens, training order, listing (hub or local cache);
- ``store``: the replay key, the done key, the store's files and merged reading;
- ``ablation``: the paper's group ablation at one revision (``DIR/ablation.json``);
- ``run``: the loop (``replay``).
"""

from __future__ import annotations

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
from .recipes import Recipe, is_recipe, load_recipe, packaged_recipes
from .revisions import (
    Revision,
    check_hub,
    list_revisions,
    revision_step,
    revision_tokens,
    select_log_spaced,
    training_order,
)
from .run import replay
from .store import (
    ReplayStore,
    StoreMismatchError,
    done_key,
    failed_revisions,
    key_difference,
    key_of,
    merged_records,
    parse_shard,
    replay_key,
    shard_from_env,
)

__all__ = [
    "ABLATION_FILE",
    "PAPER_ABLATION_DTYPE",
    "PAPER_CONTROL_RULE",
    "Recipe",
    "ReplayStore",
    "Revision",
    "StoreMismatchError",
    "ablation_key",
    "check_ablation",
    "check_hub",
    "done_key",
    "failed_revisions",
    "is_recipe",
    "key_difference",
    "key_of",
    "list_revisions",
    "load_recipe",
    "merged_records",
    "packaged_recipes",
    "paper_ablation_sets",
    "parse_shard",
    "read_ablation",
    "replay",
    "replay_key",
    "revision_step",
    "revision_tokens",
    "run_ablation",
    "select_log_spaced",
    "shard_from_env",
    "training_order",
]
