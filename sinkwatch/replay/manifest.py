"""The manifest (SPEC §8): what a replay measures, computed once, in ``DIR/manifest.json``.

The driver writes it (``sinkwatch replay MODEL --out DIR --manifest-only``, ``write_manifest``) before
any worker or engine task starts: the model's refs and the commit each resolved to, every listed
revision of the whole run with its weights (from the hub's file metadata, or a local checkpoint
hashed through the store's hash cache), the duplicate groups over the whole run (not only over the
revisions one call measures), the revisions to measure in training order, and the tasks: those
revisions grouped by identical weights, so an engine measures each group once.

Readers: the per-revision unit (``replay_revision``) and ``finalize`` read it and ask the hub nothing;
a claim-mode worker (``replay``) reuses it after one ``list_repo_refs`` (a branch that moved since is
fingerprinted again; the others are not). A worker start thus makes O(1) hub requests, whatever the
number of revisions.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .hub import RemoteFile, remember_files, remembered_files
from .provenance import DuplicateGroup, Weights, find_duplicates, fingerprints, hash_cache
from .recipes import Recipe
from .revisions import Revision, compile_pattern, list_refs, parse_revisions, select_log_spaced
from .source import RevisionSource, revision_source
from .store import key_difference

MANIFEST_FILE = "manifest.json"
HASHES_FILE = "hashes.json"
VERSION = 1
_COMMIT_LEN = 40


def manifest_command(model: str, out_dir) -> str:
    return f"sinkwatch replay {model} --out {out_dir} --manifest-only"


@dataclass
class Manifest:
    model: str
    replay_key: dict
    revisions: list[str]  # what the run measures, in training order
    entries: dict[str, dict]  # every listed revision of the whole run (+ aliases): Revision fields, weights, files
    aliases: list[str] = field(default_factory=list)  # refs that name a duplicate group without being points (main)
    refs: dict[str, str] = field(default_factory=dict)
    written_at: float = 0.0
    version: int = VERSION

    # ---- reading ------------------------------------------------------------------------------------
    def revision(self, name: str) -> Revision:
        e = self.entries[name]
        return Revision(name, step=e.get("step"), tokens=e.get("tokens"), run=e.get("run"), commit=e.get("commit"),
                        path=e.get("path"), stage=e.get("stage"))  # fmt: skip

    def weights(self) -> dict[str, Weights]:
        return {n: Weights(dict(e["weights"])) for n, e in self.entries.items() if e.get("weights")}

    def measured(self) -> list[Revision]:
        return [self.revision(n) for n in self.revisions]

    def groups(self) -> dict[str, DuplicateGroup]:
        """name -> flagged group, over every listed revision of the run (SPEC §8: pythia#205 needs the whole listing)."""
        points = [self.revision(n) for n in self.entries if n not in self.aliases]
        return find_duplicates(points, self.weights(), aliases=[self.revision(n) for n in self.aliases])

    def tasks(self) -> list[list[str]]:
        """The revisions to measure, grouped by identical weights (first member: the one measured), in training order."""
        weights = self.weights()
        out: list[list[str]] = []
        by_fp: dict[str, list[str]] = {}
        for n in self.revisions:
            w = weights.get(n)
            if w is None:
                out.append([n])
                continue
            fp = w.fingerprint
            if fp in by_fp:
                by_fp[fp].append(n)
            else:
                by_fp[fp] = [n]
                out.append(by_fp[fp])
        return out

    def task_of(self, name: str) -> list[str]:
        for t in self.tasks():
            if name in t:
                return t
        raise ValueError(f"{name} is not one of the revisions in {MANIFEST_FILE} ({', '.join(self.revisions)})")

    def blobs_except(self, names: Sequence[str]) -> set[str]:
        """Blob names (LFS sha256 / git blob id) every entry but ``names`` lists: what an eviction keeps."""
        skip = set(names)
        return {f[2] or f[3] for n, e in self.entries.items() if n not in skip for f in (e.get("files") or []) if f[2] or f[3]}

    def seed_hub_cache(self) -> None:
        """Give ``hub.remote_files`` the listings the manifest holds: the download asks no metadata again."""
        for e in self.entries.values():
            if e.get("files") is not None and e.get("commit") and len(e["commit"]) == _COMMIT_LEN:
                remember_files(self.model, e["commit"], [RemoteFile(*f) for f in e["files"]])

    def source(self, cache_dir: str | None, local=None) -> RevisionSource:
        weights = self.weights()
        return RevisionSource(
            self.model, self.measured(), weights={n: weights[n] for n in self.revisions if n in weights},
            aliases=[self.revision(n) for n in self.aliases], local=local, cache_dir=cache_dir,
        )  # fmt: skip

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        if data.get("version") != VERSION:
            raise ValueError(f"{MANIFEST_FILE} has version {data.get('version')}, this sinkwatch reads {VERSION}: write it again")
        return cls(**{k: data[k] for k in ("model", "replay_key", "revisions", "entries", "aliases", "refs", "written_at", "version")})


def read_manifest(out_dir: str | os.PathLike) -> Manifest | None:
    path = Path(out_dir) / MANIFEST_FILE
    try:
        return Manifest.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a manifest ({exc}): write it again with `{manifest_command('MODEL', out_dir)}`") from exc


def require_manifest(out_dir, model: str, key: dict) -> Manifest:
    """The store's manifest, made for this model and measurement; a clear error otherwise."""
    m = read_manifest(out_dir)
    if m is None:
        raise ValueError(
            f"no {MANIFEST_FILE} in {out_dir}: the per-revision unit and finalize read the revisions, commits and duplicate "
            f"groups from it. Write it once before starting the tasks: `{manifest_command(model, out_dir)}` "
            "(same recipe and options), or sinkwatch.replay.write_manifest(...)"
        )
    if m.model != model:
        raise ValueError(f"{out_dir}/{MANIFEST_FILE} is for {m.model}, not {model}: replay into another --out")
    diff = key_difference(m.replay_key, key)
    if diff:
        raise ValueError(
            f"{out_dir}/{MANIFEST_FILE} was written for another measurement ({'; '.join(diff)}): pass the options it was "
            f"written with, or write it again with `{manifest_command(model, out_dir)}` and these options"
        )
    return m


def write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    from filelock import FileLock

    out_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir / ".manifest.lock")):
        yield


# ---- computing it ------------------------------------------------------------------------------------------
def resolve(
    recipe: Recipe,
    names: Sequence[str] | None,
    *,
    key: dict,
    out_dir,
    mode: str,
    log_spaced: int | None,
    cache_dir: str | None,
    tokens_per_step: int | None,
    local_source: RevisionSource | None = None,
) -> tuple[Manifest, RevisionSource]:
    """The manifest for this replay and the source it gives. ``mode``: ``require`` (read it; the unit,
    finalize), ``reuse`` (a claim-mode worker: reuse it after one refs listing, write it when absent or
    stale), ``refresh`` (the driver: compute what changed and write it), ``peek`` (``--plan``: write nothing)."""
    out = Path(out_dir) if out_dir is not None else None
    if mode == "require":
        m = require_manifest(out, recipe.model, key)
        m.seed_hub_cache()
        wanted = [n for n in names] if names else None
        if wanted:
            missing = [n for n in wanted if n not in m.revisions]
            if missing:
                raise ValueError(
                    f"{', '.join(missing)} not among the revisions of {out}/{MANIFEST_FILE}: write it again with them "
                    f"(`{manifest_command(recipe.model, out)} --revisions ...`)"
                )
        return m, m.source(cache_dir, local_source.local if local_source is not None else None)
    local = local_source.local if local_source is not None else None

    def compute(previous):
        return _compute(recipe, names, key=key, log_spaced=log_spaced, cache_dir=cache_dir, tokens_per_step=tokens_per_step,
                        previous=previous, local_source=local_source)  # fmt: skip

    def other(m: Manifest | None) -> list[str]:  # the manifest of another measurement: never overwritten here
        if m is None:
            return []
        return [f"model: {m.model} -> {recipe.model}"] if m.model != recipe.model else key_difference(m.replay_key, key)

    if mode == "peek" or out is None:
        existing = read_manifest(out) if out is not None and (out / MANIFEST_FILE).is_file() else None
        m = compute(None if other(existing) else existing)
        return m, m.source(cache_dir, local)
    with _locked(out):
        existing = read_manifest(out)
        diff = other(existing)
        if diff and mode == "refresh":
            raise ValueError(
                f"{out}/{MANIFEST_FILE} was written for another measurement ({'; '.join(diff)}): replay into another --out, "
                "or move the store's manifest.json and records away"
            )
        m = compute(None if diff else existing)
        if not diff and (mode == "refresh" or existing is None or _changed(existing, m)):
            write_atomic(out / MANIFEST_FILE, m.to_json())  # a store of another measurement is refused by the store check
    return m, m.source(cache_dir, local)


def _changed(old: Manifest, new: Manifest) -> bool:
    return old.revisions != new.revisions or old.entries != new.entries or old.aliases != new.aliases


def _entry(rev: Revision, weights: Weights | None, files: list[RemoteFile] | None) -> dict:
    return {
        "step": rev.step, "tokens": rev.tokens, "run": rev.run, "stage": rev.stage, "commit": rev.commit, "path": rev.path,
        "weights": dict(weights.files) if weights is not None else None,
        "fingerprint": weights.fingerprint if weights is not None else None,
        "files": [[f.path, f.size, f.sha256, f.blob_id] for f in files] if files is not None else None,
    }  # fmt: skip


def _compute(recipe, names, *, key, log_spaced, cache_dir, tokens_per_step, previous: Manifest | None, local_source) -> Manifest:
    model = recipe.model
    if local_source is not None:  # a local run: its folder is the listing, hashed through the store's hash cache
        entries = {r.name: _entry(r, local_source.weights.get(r.name), None) for r in local_source.revisions}
        return Manifest(model, key, [r.name for r in local_source.revisions], entries, written_at=time.time())
    refs = list_refs(model, cache_dir=cache_dir)  # one request: every branch and tag with its commit
    pattern = compile_pattern(recipe.revision_pattern)
    commits = {**{n: n for n in (names or ()) if len(n) == _COMMIT_LEN and all(c in "0123456789abcdef" for c in n)}, **refs}
    every = parse_revisions([*refs, *(names or ())], pattern=pattern, tokens_per_step=tokens_per_step, commits=commits)
    if names is None:
        chosen = [r for r in every if r.step is not None]
    else:
        wanted = set(names)
        chosen = [r for r in every if r.name in wanted]
    if log_spaced:
        chosen = select_log_spaced(chosen, log_spaced)
    measured = {r.name for r in chosen}
    whole = [r for r in every if r.step is not None or r.name in measured]  # the whole run, and what is named
    aliases = [Revision("main", commit=refs["main"])] if "main" in refs and "main" not in measured else []
    entries: dict[str, dict] = {}
    todo: list[Revision] = []
    for r in [*whole, *aliases]:
        old = previous.entries.get(r.name) if previous is not None else None
        if old is not None and old.get("commit") == r.commit and r.commit is not None and old.get("weights"):
            entries[r.name] = {**_entry(r, None, None), **{k: old[k] for k in ("weights", "fingerprint", "files")}}
        else:
            todo.append(r)
    if todo:  # one metadata request per new commit, here and never again (a commit never changes)
        weights = fingerprints(model, [r for r in todo if r.commit is not None], cache_dir=cache_dir)
        for r in todo:
            entries[r.name] = _entry(r, weights.get(r.name), remembered_files(model, r.commit) if r.commit else None)
    return Manifest(
        model, key, [r.name for r in chosen], entries, aliases=[a.name for a in aliases], refs=dict(refs), written_at=time.time()
    )


def local_source(recipe, names, *, out_dir, log_spaced, tokens_per_step, lightning_module, live_store, write: bool) -> RevisionSource:
    """A local run's revisions, each checkpoint hashed once per (path, size, mtime, inode) (``DIR/hashes.json``)."""
    path = Path(out_dir) / HASHES_FILE if out_dir is not None else None
    with hash_cache(path, write=write):
        return revision_source(
            recipe, names, log_spaced=log_spaced, tokens_per_step=tokens_per_step, lightning_module=lightning_module, live_store=live_store
        )
