"""A user's own run as replay revisions: ``sinkwatch replay DIR`` over a folder of checkpoints.

What a folder may hold (one kind per folder; each child is one revision):

- HF Trainer ``checkpoint-N/``, or ``save_pretrained`` folders with a step in the name (``step100/``, ``model_step_100/``);
- OLMo-core ``stepN/`` with ``model_and_optim/``, converted by OLMo-core's ``save_hf_model``; the model config is the
  experiment config its ``ConfigSaverCallback`` writes beside each checkpoint (``config.json``, key ``model``), or one in DIR;
- LitGPT ``step-NNNNNNNN/`` (``lit_model.pth``, ``model_config.yaml``), loaded into litgpt's ``GPT`` (``models.litgpt_checkpoints``);
- Lightning ``.ckpt`` files, loaded with ``Class.load_from_checkpoint`` of ``--lightning-module pkg.module:Class``
  (``last.ckpt`` is a copy and is skipped).

Revisions go in step order: the step from the name (``checkpoint-1000``, ``epoch=0-step=100.ckpt``), else the trainer's
state. Tokens seen: ``--tokens-per-step``, else the live callback's count (its state in the checkpoint), else the trainer's
(``num_input_tokens_seen``, OLMo-core's ``global_train_tokens_seen``); step 0 is 0 tokens.

A run with the sinkwatch callback carries its state in each checkpoint (HF ``trainer_state.json``, Lightning's callback
states, OLMo-core's ``train/rank0.pt``) or in its live store (``probes.json``, for ``--live-store``): the natural windows
frozen from the first training batch and the live probe sets' parameters. Replay rebuilds exactly those probe sets
(checked against the live run's hashes), so live = replay holds at the callbacks' defaults.

A folder that is itself one checkpoint is one revision; ``--revisions`` on it is refused (every name is the same weights).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models import litgpt_checkpoints
from ..models.hub import is_weight_file
from ..probes import ProbeSet, make_induction_probe, make_repeated_random_probe
from ..reporters.jsonl import PROBES_FILE  # in a live store: the callback's probe sets and natural windows
from .provenance import Weights, weights_of_files
from .revisions import SCHEMES, Revision, training_order

_LOCAL_STEP = re.compile(r"(?:^|[^a-z])(?:step|iter|checkpoint|ckpt)[-_=]?(\d+)", re.IGNORECASE)
_SKIPPED_CKPTS = re.compile(r"last(-v\d+)?\.ckpt")


def is_local(target: str) -> bool:
    """A path on disk (a folder of checkpoints, one checkpoint, a .ckpt file), not a hub id or recipe."""
    return os.path.exists(target) and not target.endswith((".yaml", ".yml"))


def local_step(name: str) -> int | None:
    """The step in a checkpoint's name: a published scheme (``checkpoint-1000``), else ``step``, ``iter``, ``checkpoint``
    or ``ckpt`` followed by digits anywhere in it (``epoch=0-step=100.ckpt``)."""
    for _, scheme in SCHEMES:
        m = scheme.fullmatch(name)
        if m and m.groupdict().get("step") is not None:
            return int(m.group("step"))
    m = _LOCAL_STEP.search(name)
    return int(m.group(1)) if m else None


# ---- what a checkpoint holds ------------------------------------------------------------------------------
def kind_of(path: Path) -> str | None:
    if path.is_file():
        return "lightning" if path.suffix == ".ckpt" and not _SKIPPED_CKPTS.fullmatch(path.name) else None
    if (path / "model_and_optim").is_dir():
        return "olmo-core"
    if litgpt_checkpoints.is_litgpt_checkpoint(path):
        return "litgpt"
    if (path / "config.json").is_file() and any(is_weight_file(p.name) for p in path.iterdir()):
        return "hf"
    return None


@dataclass
class _State:
    """What a checkpoint says about itself beyond its weights."""

    step: int | None = None
    trainer_tokens: int | None = None  # the trainer's own count
    sinkwatch: dict | None = None  # the live callback's state_dict


def _sinkwatch_state(states: dict) -> dict | None:
    for state in states.values():
        if isinstance(state, dict) and {"version", "probe_hashes", "natural_tokens"} <= set(state):
            return state
    return None


def read_state(path: Path, kind: str) -> _State:
    if kind == "hf":
        f = path / "trainer_state.json"
        if not f.is_file():
            return _State()
        data = json.loads(f.read_text())
        cbs = {}
        for name, entry in (data.get("stateful_callbacks") or {}).items():
            entry = entry[0] if isinstance(entry, list) and entry else entry
            cbs[name] = ((entry or {}).get("attributes") or {}).get("sinkwatch_state")
        return _State(data.get("global_step"), data.get("num_input_tokens_seen") or None, _sinkwatch_state(cbs))
    if kind == "olmo-core":
        f = path / "train" / "rank0.pt"
        if not f.is_file():
            return _State()
        data = torch.load(f, map_location="cpu", weights_only=False)
        return _State(data.get("global_step"), data.get("global_train_tokens_seen") or None, _sinkwatch_state(data.get("callbacks") or {}))
    if kind == "litgpt":
        return _State(litgpt_checkpoints.saved_step(path))
    data = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return _State(data.get("global_step"), None, _sinkwatch_state(data.get("callbacks") or {}))


# ---- the run ------------------------------------------------------------------------------------------------
@dataclass
class LocalRun:
    """A folder of checkpoints (or one) as revisions, with what its live callback left behind."""

    root: Path
    kind: str
    revisions: list[Revision]
    weights: dict[str, Weights]
    single: bool = False
    lightning_module: str | None = None
    natural: ProbeSet | None = None
    live_state: dict | None = None  # a sinkwatch callback state (probe hashes and parameters)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.root.name

    def live_probes(self) -> list[ProbeSet] | None:
        """The live callback's probe sets, rebuilt from its state; None (no callback, or a state without the saved
        parameters): replay uses the recipe's or the options' probes."""
        state = self.live_state
        if state is None or not state.get("probe_params"):
            return None
        sets = []
        for kind, params in state["probe_params"].items():
            if kind == "natural":
                if self.natural is None:
                    raise ValueError(
                        f"{self.root}: the live run probed natural windows, but no checkpoint or live store holds them. "
                        "Point --live-store at the run's sinkwatch out_dir (its probes.json holds them), or give the probes "
                        "yourself: --probe induction,repeated,natural --text FILE"
                    )
                sets.append(self.natural)
            elif kind in ("induction", "repeated"):
                make, length = (make_induction_probe, "seq_len") if kind == "induction" else (make_repeated_random_probe, "half_len")
                sets.append(make(params["n"], params[length], vocab_range=tuple(params["vocab_range"]), seed=params["seed"]))
        got = {s.kind: s.hash for s in sets}
        if state.get("probe_hashes") and got != state["probe_hashes"]:
            raise ValueError(
                f"{self.root}: the probe sets rebuilt from the callback state hash to {got}, the live run's to {state['probe_hashes']}"
            )
        return sets

    def load(self, rev: Revision, *, dtype: str = "float32", device: str | None = None):
        """The model of one revision, in eval mode on ``device``."""
        from ..models.loading import default_device, load_model, parse_dtype

        if self.kind == "hf":
            return load_model(str(rev.path), dtype=dtype, device=device)
        if self.kind == "olmo-core":
            with tempfile.TemporaryDirectory(prefix="sinkwatch-olmo-core-") as tmp:
                hf = convert_olmo_core(Path(rev.path), Path(tmp) / "hf", config_dirs=[Path(rev.path), self.root])
                return load_model(str(hf), dtype=dtype, device=device)
        if self.kind == "litgpt":
            return litgpt_checkpoints.load_litgpt(Path(rev.path), dtype=parse_dtype(dtype), device=device or default_device())
        from ..capture import UnsupportedModelError, find_transformers_model

        module = load_lightning(self.lightning_module, rev.path)
        try:
            model = find_transformers_model(module)  # the HF model inside: the eager/sdpa switches act on it
        except UnsupportedModelError:
            model = module  # a custom model (sinkwatch_target() / sinkwatch.attend): probed as the live run probed it
        return model.to(parse_dtype(dtype)).to(device or default_device()).eval()


def local_run(path: str | os.PathLike, *, names: Sequence[str] | None = None, tokens_per_step: int | None = None,
              lightning_module: str | None = None, live_store: str | os.PathLike | None = None) -> LocalRun:  # fmt: skip
    """The revisions of a local run (the module docstring), each with its weights' fingerprint as its commit (a
    rewritten checkpoint is measured again)."""
    root = Path(path)
    own = kind_of(root)
    children = {}
    if root.is_dir():
        for child in sorted(root.iterdir()):
            k = kind_of(child)
            if k is not None:
                children.setdefault(k, []).append(child)
    if len(children) > 1:
        raise ValueError(
            f"{root} mixes checkpoint kinds ({', '.join(f'{k}: {len(v)}' for k, v in children.items())}); replay one kind per folder"
        )
    if children:
        kind, paths, single = next(iter(children)), next(iter(children.values())), False
    elif own is not None:
        if names:
            raise _one_checkpoint(root, own)
        kind, paths, single = own, [root], True
    else:
        raise FileNotFoundError(
            f"no checkpoints in {root}: expected HF Trainer checkpoint-N/ or save_pretrained folders (config.json + weights), "
            "OLMo-core checkpoints (stepN/model_and_optim/), LitGPT checkpoints (step-N/lit_model.pth + model_config.yaml), "
            "or Lightning *.ckpt files"
        )
    if kind == "lightning" and not lightning_module:
        raise ValueError(f"{root} holds Lightning checkpoints: name your LightningModule with --lightning-module pkg.module:Class")
    run = LocalRun(root=root, kind=kind, revisions=[], weights={}, single=single, lightning_module=lightning_module)
    if names is not None:
        by_name = {p.name: p for p in paths}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise FileNotFoundError(f"{root} has no checkpoint {missing}; it has {sorted(by_name)}")
        paths = [by_name[n] for n in names]
    naturals: dict[str, ProbeSet] = {}
    for p in paths:
        state = read_state(p, kind)
        step = local_step(p.name)
        if step is None:
            step = state.step
        elif state.step is not None and state.step != step:
            run.notes.append(f"{p.name}: the name says step {step}, the trainer state {state.step}; the state's step is used")
            step = state.step
        tokens = _tokens(step, state, tokens_per_step)
        if state.sinkwatch is not None and state.sinkwatch.get("probe_hashes"):  # a state saved before the first probe has none
            if run.live_state is not None and run.live_state["probe_hashes"] != state.sinkwatch["probe_hashes"]:
                run.notes.append(f"{p.name}: the live run's probe sets changed (a resume with other probes); the first ones are replayed")
            run.live_state = run.live_state or state.sinkwatch
            nat = _natural_of(state.sinkwatch)
            if nat is not None:
                naturals[p.name] = nat
        weight_paths = sorted((p / "model_and_optim").glob("*.distcp")) if kind == "olmo-core" else None
        weights = weights_of_files(p, weight_paths)
        run.weights[p.name] = weights
        run.revisions.append(Revision(p.name, step=step, tokens=tokens, commit=weights.fingerprint, path=str(p)))
    if live_store is not None:
        f = Path(live_store) / PROBES_FILE
        if not f.is_file():
            raise FileNotFoundError(f"no {PROBES_FILE} in the live store {live_store} (the callback writes it at its first probe)")
        state = json.loads(f.read_text())
        run.live_state = run.live_state or state
        nat = _natural_of(state)
        if nat is not None:
            naturals["live store"] = nat
    hashes = {n.hash for n in naturals.values()}
    if len(hashes) > 1:
        raise ValueError(f"{root}: checkpoints hold different natural windows ({sorted(naturals)}); they come from more than one run")
    run.natural = next(iter(naturals.values()), None)
    run.revisions = training_order(run.revisions)
    if any(r.step is None for r in run.revisions) and not single:
        unplaced = [r.name for r in run.revisions if r.step is None]
        run.notes.append(f"no step in the name or the trainer state of {unplaced}: they are replayed last, outside the trajectory")
    return run


def _tokens(step: int | None, state: _State, tokens_per_step: int | None) -> int | None:
    if step is None:
        return None
    if tokens_per_step:
        return step * tokens_per_step
    if step == 0:
        return 0
    if state.sinkwatch is not None and state.sinkwatch.get("tokens_seen"):
        return int(state.sinkwatch["tokens_seen"])  # what the live records at this step were labelled with
    return int(state.trainer_tokens) if state.trainer_tokens else None


def _natural_of(state: dict) -> ProbeSet | None:
    if state.get("natural_tokens") is None:
        return None
    return ProbeSet("natural", torch.tensor(state["natural_tokens"]), {}, state.get("natural_params") or {})


# ---- OLMo-core and Lightning --------------------------------------------------------------------------------
def convert_olmo_core(checkpoint: Path, out: Path, *, config_dirs: Sequence[Path]) -> Path:
    """An OLMo-core checkpoint as a Hugging Face model, by OLMo-core's own converter (``load_model_and_optim_state``
    into the model the experiment config builds, then ``save_hf_model``)."""
    try:
        from olmo_core.distributed.checkpoint import load_model_and_optim_state
        from olmo_core.nn.hf.checkpoint import save_hf_model
        from olmo_core.nn.transformer import TransformerConfig
    except ImportError as exc:
        raise ImportError("replaying OLMo-core checkpoints needs OLMo-core: pip install 'sinkwatch[olmo-core]'") from exc
    config = None
    for d in config_dirs:
        f = Path(d) / "config.json"
        if f.is_file():
            data = json.loads(f.read_text())
            if isinstance(data, dict) and "model" in data:
                config = dict(data["model"])
                break
    if config is None:
        raise FileNotFoundError(
            f"no OLMo-core experiment config (config.json with a 'model' key) in {checkpoint} or {config_dirs[-1]}: "
            "OLMo-core's ConfigSaverCallback writes it beside each checkpoint; copy your run's config.json there"
        )
    for key in ("compile", "dp_config", "tp_config", "float8_config"):  # training-only keys, as OLMo-core's converter drops them
        config.pop(key, None)
    model = TransformerConfig.from_dict(config).build(init_device="cpu")
    load_model_and_optim_state(str(checkpoint / "model_and_optim"), model)
    save_hf_model(out, model.state_dict(), model)
    return out


def load_lightning(spec: str | None, path: str | os.PathLike):
    """``Class.load_from_checkpoint(path)`` of the LightningModule ``pkg.module:Class``."""
    if not spec or ":" not in spec:
        raise ValueError(f"--lightning-module must be pkg.module:Class, got {spec!r}")
    module_name, _, cls_name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import the LightningModule {spec!r} ({exc}); is its package on PYTHONPATH?") from exc
    try:
        return cls.load_from_checkpoint(str(path), map_location="cpu")
    except TypeError as exc:
        raise ValueError(
            f"{spec}.load_from_checkpoint({path}) failed ({exc}): the module must rebuild itself from its saved "
            "hyperparameters (call self.save_hyperparameters() in __init__)"
        ) from exc


def check_local_names(run: LocalRun | None, names: Sequence[str] | None) -> None:
    """Names asked of a local run (``--revisions``) must be its checkpoints; on one model folder there are none to ask for."""
    if run is None or names is None:
        return
    if run.single:
        raise _one_checkpoint(run.root, run.kind)
    have = {r.name for r in run.revisions}
    missing = [n for n in names if n not in have]
    if missing:
        raise FileNotFoundError(f"{run.root} has no checkpoint {missing}; it has {sorted(have)}")


def _one_checkpoint(root: Path, kind: str) -> ValueError:
    return ValueError(
        f"--revisions on {root}, which is one checkpoint ({kind}): every name would measure the same weights under "
        f"another label. Replay the folder that holds the checkpoints (checkpoint-N/, stepN/, *.ckpt) or probe this "
        f"one once with `sinkwatch probe {root}`"
    )


def describe(run: LocalRun) -> str:
    return f"{run.root} ({run.kind}, {len(run.revisions)} checkpoint(s))"


def warn_notes(run: LocalRun) -> None:
    for note in run.notes:
        warnings.warn(f"sinkwatch replay: {note}", RuntimeWarning, stacklevel=2)
