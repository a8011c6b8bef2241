"""Import paths that moved, kept working: ``import sinkwatch.monitor`` is ``sinkwatch.probe.monitor``, the same
module object (one class, one ``isinstance``), not a copy. docs/design.md §11 draws the layout these point into.

One table instead of a shim file per old path, so the package's top level shows only the rooms of the data
flow. A moved package carries its submodules (``sinkwatch.reporting.jsonl`` is ``sinkwatch.reporters.jsonl``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

# old path -> where it lives now
MOVED: dict[str, str] = {
    # the one-probe engine
    "sinkwatch.monitor": "sinkwatch.probe.monitor",
    "sinkwatch.collectors": "sinkwatch.probe.collectors",
    "sinkwatch.probe_share": "sinkwatch.probe.share",
    "sinkwatch.probe_memory": "sinkwatch.probe.memory",
    "sinkwatch.snapshot": "sinkwatch.probe.snapshot",
    # the live core
    "sinkwatch.live_config": "sinkwatch.live.config",
    # the adapters
    "sinkwatch.hf": "sinkwatch.adapters.hf",
    "sinkwatch.lightning": "sinkwatch.adapters.lightning",
    "sinkwatch.fabric": "sinkwatch.adapters.fabric",
    "sinkwatch.fabric_factory": "sinkwatch.adapters.fabric_factory",
    "sinkwatch.olmo_core": "sinkwatch.adapters.olmo_core",
    "sinkwatch.torchtitan": "sinkwatch.adapters.torchtitan",
    "sinkwatch.megatron": "sinkwatch.adapters.megatron",
    # models
    "sinkwatch.loading": "sinkwatch.models.loading",
    "sinkwatch.gguf": "sinkwatch.models.gguf",
    "sinkwatch.replay.hub": "sinkwatch.models.hub",
    "sinkwatch.replay.retries": "sinkwatch.models.hub",
    "sinkwatch.replay.litgpt_checkpoints": "sinkwatch.models.litgpt_checkpoints",
    # reporters, reports, the demos
    "sinkwatch.reporting": "sinkwatch.reporters",
    "sinkwatch.findings": "sinkwatch.report.findings",
    "sinkwatch.demo_p0": "sinkwatch.demo.p0",
}


def new_name(old: str) -> str | None:
    """Where ``old`` lives now (itself or a submodule of a moved package), or None when it did not move."""
    for prefix, target in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix) :]
    return None


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old path with the module of its new one (imported under its new name, once)."""

    def __init__(self):
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None or importlib.util.find_spec(new) is None:  # not moved, or nothing there: the old name's own error
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(new_name(spec.name))
        self._specs[spec.name] = module.__spec__  # the import system overwrites it with the old name's next
        return module

    def exec_module(self, module) -> None:
        # imported already, under its new name; its own spec back, so its relative imports and reload keep working
        module.__spec__ = self._specs.pop(module.__spec__.name)


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


install()  # on import: ``sinkwatch/__init__.py`` imports this module first
