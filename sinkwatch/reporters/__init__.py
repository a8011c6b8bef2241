"""Reporters: where records and events go. Only ``wandb_run`` imports wandb, and only when used."""

from .base import MultiReporter, Reporter
from .console import ConsoleReporter
from .jsonl import JSONLReporter

__all__ = ["ConsoleReporter", "JSONLReporter", "MultiReporter", "Reporter", "live_reporters"]


def live_reporters(config, *, wandb_run=None, warn=None) -> tuple[MultiReporter, JSONLReporter, object]:
    """The reporters of a live run's logging rank from its ``LiveConfig``: the JSONL store (always; a store
    holds one run: unless a checkpoint's state resumes this one first, an earlier run's files move aside),
    the console, W&B (the trainer's run, ``wandb_run``, or as ``config.wandb`` says) and the user's own.
    Returns (all of them, the store, the W&B reporter or None); ``warn(key, message)`` says wandb is missing."""
    jsonl = JSONLReporter(config.out_dir, new_run=True)
    reporters: list[Reporter] = [jsonl]
    if config.console:
        reporters.append(ConsoleReporter())
    wandb = None
    if config.wandb != "disabled":
        try:
            from .wandb_run import wandb_reporter

            wandb = wandb_reporter(
                config.wandb, trainer_run=wandb_run, project=config.wandb_project, dir=config.out_dir,
                heatmap_every=config.heatmap_every, init_kwargs=config.wandb_init,
            )  # fmt: skip
            reporters.append(wandb)
        except ImportError:
            if warn is not None:
                warn("no-wandb", "sinkwatch: wandb is not installed (pip install wandb); logging to the local JSONL only")
    reporters.extend(config.reporters)
    return MultiReporter(reporters), jsonl, wandb
