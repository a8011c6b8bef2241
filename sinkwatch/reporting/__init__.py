"""Reporters: where records and events go. Only ``wandb_run`` imports wandb, and only when used."""

from .base import MultiReporter, Reporter
from .console import ConsoleReporter
from .jsonl import JSONLReporter

__all__ = ["ConsoleReporter", "JSONLReporter", "MultiReporter", "Reporter"]
