"""The import paths that moved keep working (``sinkwatch._moved``): each old path is the new module itself, and
every ``sinkwatch`` import line of README.md, docs/ and recipes/ runs."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import sinkwatch  # noqa: F401 - installs the old paths
from sinkwatch._moved import MOVED, new_name

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_where_it_lives_now(old):
    """Not a copy: one module object, so one class for isinstance and one global for monkeypatch."""
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_a_moved_package_carries_its_submodules():
    from sinkwatch.reporters.jsonl import JSONLReporter
    from sinkwatch.reporting.jsonl import JSONLReporter as old

    assert old is JSONLReporter
    assert new_name("sinkwatch.reporting.wandb_run") == "sinkwatch.reporters.wandb_run"
    assert new_name("sinkwatch.metrics") is None
    # torchtitan's --module asks for MODULE.config_registry first and falls back when there is none: the old name's error
    with pytest.raises(ModuleNotFoundError) as missing:
        importlib.import_module("sinkwatch.reporting.config_registry")
    assert missing.value.name == "sinkwatch.reporting.config_registry"


def _import_lines() -> list[str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").rglob("*.py"))]
    lines = set()
    for f in files:
        for line in f.read_text().splitlines():
            m = re.match(r"^\s*(from sinkwatch[\w.]* import [\w, ]+|import sinkwatch[\w.]*)\s*([;#].*)?$", line)
            if m:
                lines.add(m.group(1).strip().rstrip(","))
    return sorted(lines)


def test_the_documented_imports_run():
    """Every one-line ``sinkwatch`` import that a user copies from the docs, the README or a recipe."""
    lines = _import_lines()
    assert len(lines) >= 10  # the files are read: they hold more than ten
    for line in lines:
        exec(line, {})


def test_an_old_path_leaves_the_module_its_own_name_and_spec():
    """Importing through an old path must not rename the module: its lazy relative imports (``from ..reporters ...``
    inside the adapters) and ``importlib.reload`` read ``__spec__``."""
    import warnings

    import sinkwatch.hf  # noqa: F401 - through the old path first
    from sinkwatch.adapters import hf

    assert hf.__spec__.name == hf.__name__ == "sinkwatch.adapters.hf"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a wrong __spec__ makes every relative import warn (ImportWarning)
        exec("from ..reporters.base import Reporter", vars(hf).copy())
    assert importlib.reload(hf) is hf and hf.__name__ == "sinkwatch.adapters.hf"
