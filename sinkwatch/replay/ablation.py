"""The paper's group ablation at one revision of a replay (docs/design.md §5), kept in ``DIR/ablation.json``."""

from __future__ import annotations

import gc
import json
import os
import time
import warnings
from pathlib import Path

import numpy as np

from .. import metrics
from ..models.loading import HubUnreachableError, load_model, loaded_attention
from ..probe.monitor import Monitor
from ..records import jsonable
from ..reporters.jsonl import read_jsonl
from .progress import _status
from .recipes import Recipe
from .store import StoreMismatchError, key_difference, key_of, record_files, write_order

# ---- the paper's group ablation (docs/design.md §5) -------------------------------------------------------------------
ABLATION_FILE = "ablation.json"
PAPER_ABLATION_DTYPE = "float16"  # the paper ran every ablation in float16, Pythia too
PAPER_CONTROL_RULE = (
    "the fourth draw of one RandomState(123) shared across the sweep thresholds [2, 10, 30, 50, 100], "
    "min(picks, eligible) in a short layer (metrics.paper_control_sets)"
)


def ablation_key(key: dict, revision: str, commit: str | None = None) -> dict:
    """What makes two ablations the same measurement: the store's replay key, the revision and its commit when known
    (a branch that moved, as OLMoE's ``main`` did, is ablated again)."""
    return {**key, "revision": revision, **({"commit": commit} if commit else {})}


def read_ablation(out_dir: str | os.PathLike) -> dict | None:
    """The store's ablation result (``DIR/ablation.json``), or None when there is none yet."""
    path = Path(out_dir) / ABLATION_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:  # written by rename, so only a hand-edited file lands here
        warnings.warn(f"sinkwatch replay: {path} is not valid JSON; the ablation will be redone", RuntimeWarning, stacklevel=2)
        return None


def check_ablation(out_dir: str | os.PathLike, wanted: dict) -> None:
    """Refuse (StoreMismatchError) when the store holds a successful ablation made another way."""
    stored = read_ablation(out_dir)
    if stored is None or stored.get("status") != "ok":
        return
    diff = key_difference(stored["ablation_key"], wanted)
    if stored["ablation_key"].get("revision") != wanted.get("revision"):
        diff.append(f"ablation revision: {stored['ablation_key'].get('revision')} -> {wanted.get('revision')}")
    if diff:
        raise StoreMismatchError(
            f"{Path(out_dir) / ABLATION_FILE} was made another way ({'; '.join(diff)}). "
            "Replay into another --out, or move ablation.json away to redo it"
        )


def paper_ablation_sets(induction: np.ndarray, n_heads: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The >= 50x induction set of a screen ((L, H) selectivities) and the paper's control for it: the fourth draw of
    the shared-stream sweep, every threshold drawn in the paper's order."""
    t = metrics.INDUCTION_CIRCUIT_MIN_SELECTIVITY
    screens = metrics.screen_sets(induction, metrics.PAPER_SWEEP_THRESHOLDS)
    return screens[t], metrics.paper_control_sets(screens, n_heads)[t]


def _stored_record(out_dir, revision: str, key: dict) -> dict | None:
    """The latest successful record of ``revision`` made with ``key``, from any worker's file."""
    rows = [r for path in record_files(out_dir) for r in read_jsonl(path)]
    found = [r for r in write_order(rows) if r.get("revision") == revision and r.get("status", "ok") == "ok" and "n_layers" in r]
    found = [r for r in found if key_of(r) == key]
    return found[-1] if found else None


def run_ablation(monitor: Monitor, recipe: Recipe, revision: str, *, out_dir, key: dict, dtype: str, device=None, cache_dir=None,
                 bar=None, load=None, commit: str | None = None) -> dict:  # fmt: skip
    """Group ablation of the >= 50x induction circuit at ``revision``, written to ``DIR/ablation.json``; returns it.

    The set comes from that revision's screen: its record in the store, else a probe made here the same way (its
    induction selectivities kept in the result). Protocol "paper": float16 and the paper's control
    (``paper_ablation_sets``); "sinkwatch": the replay's dtype and ``Monitor.ablate``'s own draw. Done already (same
    key): skipped. A failure is written with its reason and warned about; a rerun retries it. ``commit``: what
    ``revision`` resolved to (recorded; a successful ablation at another commit, a moved branch, is kept as
    ``ablation.<commit>.json``).
    """
    if load is None:  # ``load(revision, dtype)``: the replay's loader (a hub revision by its listed commit, a local checkpoint)

        def load(rev, dt):
            return load_model(recipe.model, revision=rev, dtype=dt, device=device, cache_dir=cache_dir)

    wanted = ablation_key(key, revision, commit)
    stored = read_ablation(out_dir)
    if stored is not None and stored.get("status") == "ok" and stored.get("ablation_key") == wanted:
        _status(bar, revision, "ablation done already")
        return stored
    paper = monitor.config.protocol == "paper"
    abl_dtype = PAPER_ABLATION_DTYPE if paper else dtype
    base = {
        "kind": "ablation", "model": recipe.model, "revision": revision, "commit": commit, "protocol": monitor.config.protocol,
        "dtype": abl_dtype,
    }  # fmt: skip
    t0 = time.perf_counter()
    model = None
    try:
        record = _stored_record(out_dir, revision, key)
        screen = {"screen": "record"}
        if record is None:
            _status(bar, revision, "screen for the ablation")
            model = load(revision, dtype)
            default = loaded_attention(model)  # sdpa, or eager for a class without sdpa (gpt-oss, Gemma 2)
            if paper and dtype in ("float16", "bfloat16"):
                model.set_attn_implementation("eager")  # as the per-revision records (measure.Measurer._probe)
            record = monitor.probe(model, revision=revision, model_name=recipe.model).to_record()
            screen = {"screen": "probed for the ablation", "screen_induction": record["selectivity"]["induction"]}
        induction = np.asarray(record["selectivity"]["induction"], dtype=float)  # (L, H)
        if paper:
            heads, control = paper_ablation_sets(induction, int(record["n_heads"]))
        else:
            heads, control = metrics.screen_sets(induction, [metrics.INDUCTION_CIRCUIT_MIN_SELECTIVITY])[50.0], None
        if model is None or dtype != abl_dtype:
            model = None
            gc.collect()
            _status(bar, revision, f"load in {abl_dtype} for the ablation")
            model = load(revision, abl_dtype)
        else:
            model.set_attn_implementation(default)  # the screen's eager attention was for its rounding only
        _status(bar, revision, f"ablation of {len(heads)} head(s)")
        scores = monitor.ablate(model, heads, control=control)
        result = {
            **base, "status": "ok", "ablation_key": wanted, "threshold": metrics.INDUCTION_CIRCUIT_MIN_SELECTIVITY,
            "control_rule": PAPER_CONTROL_RULE if paper else "RandomState(123) for this set alone; a short layer raises",
            **screen, **scores, "seconds": time.perf_counter() - t0,
        }  # fmt: skip
        if not heads:
            result["note"] = "no head reaches 50x at this revision: the ablated and baseline scores are the same forward"
    except HubUnreachableError:
        raise
    except Exception as exc:  # noqa: BLE001 - the records are kept; the ablation is retried on a rerun
        result = {**base, "status": "failed", "ablation_key": wanted, "error": f"{type(exc).__name__}: {exc}"}
        msg = f"sinkwatch replay: the ablation at {recipe.model}@{revision} failed ({result['error']}); rerun to retry"
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    finally:
        del model
        gc.collect()
    if stored is not None and stored.get("status") == "ok":
        # made at another commit of the revision (check_ablation refused any other difference): kept, never overwritten
        earlier = (stored.get("ablation_key") or {}).get("commit") or "unrecorded"
        os.replace(Path(out_dir) / ABLATION_FILE, Path(out_dir) / f"ablation.{earlier[:12]}.json")
    _write_atomic(Path(out_dir) / ABLATION_FILE, result)
    return result


def _write_atomic(path: Path, data: dict) -> None:
    """Written whole or not at all: a crash leaves the previous file (or none), never a torn one."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jsonable(data), indent=1))
    os.replace(tmp, path)
