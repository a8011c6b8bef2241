"""Every pretraining recipe (recipes/*.py) runs for a few steps, using only what the README's main
command installs (``pip install -e ".[all]"``).

The recipe runs in a child process for two steps. What each recipe needs beyond the core (its
trainer's hard requirements: transformers' Trainer refuses to start without accelerate) must be in
the dependency closure of sinkwatch's core requirements plus its ``all`` extra, read from
pyproject.toml: the dev extra, which also brings accelerate, does not count. (The set of modules a
run imports is no test of this: transformers imports every optional package it finds installed.)
"""

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.py"))

# distributions a recipe cannot run without (its trainer's hard requirements), by recipe
NEEDS = {
    "hf_trainer_pretrain": {"transformers", "accelerate", "torch"},
    "lightning_pretrain": {"lightning", "transformers", "torch"},
    "olmo_core_pretrain": {"ai2-olmo-core", "torch"},
}


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _closure(names: set[str]) -> set[str]:
    """The distributions ``names`` need, transitively, as installed here (extras of dependencies ignored)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo.extend(_name(r) for r in requires if "extra ==" not in r)
    return seen


def readme_environment() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["all"]}
    return _closure(wanted)


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_runs_with_the_readme_install(recipe, tmp_path):
    """Each recipe trains two steps from the README install and records the first and the last."""
    missing = sorted(NEEDS[recipe.stem] - readme_environment())
    assert not missing, f"{recipe.name} needs {missing}, which pip install -e '.[all]' does not install"
    argv = ["--steps", "2", "--batch-size", "4", "--wandb", "disabled", "--out", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    res = subprocess.run([sys.executable, str(recipe), *argv], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    # the OLMo-core recipe keeps its records beside its data and checkpoints, in run/sinkwatch/
    path = next((tmp_path / "run").rglob("records.jsonl"))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps[0] == 0 and steps[-1] == 2, steps  # the initial model and the last step
