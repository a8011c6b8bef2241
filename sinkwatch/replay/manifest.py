"""The manifest: the plan of a replay, written once (``DIR/manifest.json``).

The driver writes it (``--manifest-only``, ``write_manifest``, or the first run into an empty ``--out``): the model's
refs and their commits, every listed revision of the whole run with its weights (the hub's file metadata, or a local
checkpoint hashed through the store's hash cache), and the ordered tasks, each a name and its members (revisions with
identical weights are one task, measured once). It never changes under a running job: units address tasks by name (an
array index maps into this list), and only ``--rewrite-manifest`` (``rewrite=True``) rewrites it, keeping every task's
name and index, appending new ones, refused while a task runs. Its readers (the unit, the workers, finalize) ask the
hub nothing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..models.hub import RemoteFile, is_commit_id, list_refs, remember_files, remembered_files
from .local import check_local_names
from .provenance import DuplicateGroup, Weights, find_duplicates, fingerprints, hash_cache
from .recipes import Recipe
from .revisions import Revision, select_revisions, training_order
from .source import RevisionSource, revision_source
from .store import StoreMismatchError, key_difference

MANIFEST_FILE = "manifest.json"
HASHES_FILE = "hashes.json"
VERSION = 2


def manifest_command(model: str, out_dir, *extra: str) -> str:
    return " ".join(["sinkwatch replay", str(model), "--out", str(out_dir), *extra, "--manifest-only"])


@dataclass
class Task:
    """One unit of work: ``members`` (training order) share their weights; the first is the one measured."""

    name: str
    members: list[str]


@dataclass
class Manifest:
    model: str
    replay_key: dict
    task_list: list[Task]  # the plan, in the order written (an array index is a position here)
    entries: dict[str, dict]  # every listed revision of the whole run (+ aliases): Revision fields, weights, files
    aliases: list[str] = field(default_factory=list)  # refs without a step that are not measured (main, tags)
    refs: dict[str, str] = field(default_factory=dict)
    selections: list[dict] = field(default_factory=list)  # what was asked for (revisions, log_spaced), each write
    skip_duplicates: bool = False
    written_at: float = 0.0
    version: int = VERSION

    # ---- the tasks ------------------------------------------------------------------------------------
    def tasks(self) -> list[list[str]]:
        """Each task's members, in the manifest's order."""
        return [list(t.members) for t in self.task_list]

    def task_names(self) -> list[str]:
        return [t.name for t in self.task_list]

    def find_task(self, name: str) -> Task:
        """The task named ``name``, else the task holding the revision ``name``."""
        for t in self.task_list:
            if t.name == name:
                return t
        for t in self.task_list:
            if name in t.members:
                return t
        raise ValueError(
            f"{name} is neither a task nor a revision of {MANIFEST_FILE} ({len(self.task_list)} tasks: "
            f"{', '.join(self.task_names()[:8])}{', ...' if len(self.task_list) > 8 else ''})"
        )

    def task_at(self, index: int) -> Task:
        if not 0 <= index < len(self.task_list):
            raise ValueError(f"--task {index}: {MANIFEST_FILE} has tasks {array_range(range(len(self.task_list))) or '(none)'}")
        return self.task_list[index]

    def index_of(self, name: str) -> int:
        return self.task_names().index(name)

    @property
    def revisions(self) -> list[str]:
        """Every member of every task, in training order."""
        return [r.name for r in training_order([self.revision(n) for t in self.task_list for n in t.members])]

    # ---- the revisions ------------------------------------------------------------------------------
    def revision(self, name: str) -> Revision:
        e = self.entries[name]
        return Revision(name, step=e.get("step"), tokens=e.get("tokens"), run=e.get("run"), commit=e.get("commit"),
                        path=e.get("path"), stage=e.get("stage"))  # fmt: skip

    def measured(self) -> list[Revision]:
        return [self.revision(n) for n in self.revisions]

    def weights(self) -> dict[str, Weights]:
        return {n: Weights(dict(e["weights"])) for n, e in self.entries.items() if e.get("weights")}

    def groups(self, extra: dict[str, Weights] | None = None) -> dict[str, DuplicateGroup]:
        """name -> flagged group, over every listed revision of the run (pythia#205 needs the whole listing);
        ``extra``: weights learned after the manifest was written (a task's second metadata request)."""
        points = [self.revision(n) for n in self.entries if n not in self.aliases]
        return find_duplicates(points, {**self.weights(), **(extra or {})}, aliases=[self.revision(n) for n in self.aliases])

    def seed_hub_cache(self) -> None:
        """Give ``hub.remote_files`` the listings the manifest holds: the download asks no metadata again."""
        for e in self.entries.values():
            if e.get("files") is not None and e.get("commit") and is_commit_id(e["commit"]):
                remember_files(self.model, e["commit"], [RemoteFile(*f) for f in e["files"]])

    def source(self, cache_dir: str | None, local=None) -> RevisionSource:
        weights = self.weights()
        measured = self.measured()
        return RevisionSource(
            self.model, measured, weights={r.name: weights[r.name] for r in measured if r.name in weights},
            aliases=[self.revision(n) for n in self.aliases], local=local, cache_dir=cache_dir,
        )  # fmt: skip

    # ---- json ---------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "version": self.version, "model": self.model, "replay_key": self.replay_key,
            "tasks": [{"name": t.name, "members": t.members} for t in self.task_list], "entries": self.entries,
            "aliases": self.aliases, "refs": self.refs, "selections": self.selections, "skip_duplicates": self.skip_duplicates,
            "written_at": self.written_at,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        if data.get("version") == 1:  # written before tasks had names: its tasks, as it computed them, named by their first member
            m = cls(data["model"], data["replay_key"], [], data["entries"], data.get("aliases", []), data.get("refs", {}),
                    [], False, data.get("written_at", 0.0))  # fmt: skip
            m.task_list = group_tasks(data["revisions"], m.weights(), [])
            return m
        if data.get("version") != VERSION:
            raise ValueError(f"{MANIFEST_FILE} has version {data.get('version')}, this sinkwatch reads {VERSION}")
        return cls(
            data["model"], data["replay_key"], [Task(t["name"], list(t["members"])) for t in data["tasks"]], data["entries"],
            data.get("aliases", []), data.get("refs", {}), data.get("selections", []), bool(data.get("skip_duplicates")),
            data.get("written_at", 0.0),
        )  # fmt: skip


def array_range(indices) -> str:
    """Task indices as Slurm's ``--array`` takes them: ``0-153``, ``1,4-6``; empty when there are none."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def group_tasks(names: Sequence[str], weights: dict[str, Weights], existing: Sequence[Task], entries: dict | None = None) -> list[Task]:
    """The tasks for ``names`` (training order): ``existing`` tasks first, less members whose weights are no longer the
    task's (a moved branch), then those and the new revisions, each joining the task whose first member has identical
    weights or starting one named by itself."""
    fp = {n: w.fingerprint for n, w in weights.items()}
    tasks = [Task(t.name, [m for m in t.members if m == t.members[0] or (fp.get(m) is not None and fp.get(m) == fp.get(t.members[0]))])
             for t in existing]  # fmt: skip
    placed = {m for t in tasks for m in t.members}
    names_taken = {t.name for t in tasks}
    by_fp = {fp[t.members[0]]: t for t in tasks if fp.get(t.members[0]) is not None}
    for n in names:
        if n in placed:
            continue
        placed.add(n)
        f = fp.get(n)
        if f is not None and f in by_fp:
            by_fp[f].members.append(n)
            continue
        name = n
        if name in names_taken:  # a revision that left its task (moved): a new task, named by its commit too
            commit = ((entries or {}).get(n) or {}).get("commit") or str(len(tasks))
            name = f"{n}@{commit[:8]}"
        task = Task(name, [n])
        names_taken.add(name)
        tasks.append(task)
        if f is not None:
            by_fp[f] = task
    return tasks


# ---- reading and writing -----------------------------------------------------------------------------------
def read_manifest(out_dir: str | os.PathLike) -> Manifest | None:
    path = Path(out_dir) / MANIFEST_FILE
    try:
        return Manifest.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"{path} is not a sinkwatch manifest ({exc}): move it away and write it again") from exc


def require_manifest(out_dir, model: str, key: dict) -> Manifest:
    """The store's manifest, made for this model and measurement; a clear error otherwise."""
    m = read_manifest(out_dir)
    if m is None:
        raise ValueError(
            f"no {MANIFEST_FILE} in {out_dir}: the per-task unit, finalize and --failed-tasks read the tasks, commits and "
            f"duplicate groups from it. Write it once before starting the tasks: `{manifest_command(model, out_dir)}` "
            "(same recipe and options), or sinkwatch.replay.write_manifest(...)"
        )
    _check_same(m, out_dir, model, key)
    return m


def _check_same(m: Manifest, out_dir, model: str, key: dict) -> None:
    if m.model != model:
        raise StoreMismatchError(f"{out_dir}/{MANIFEST_FILE} is for {m.model}, not {model}: replay into another --out")
    diff = key_difference(m.replay_key, key)
    if diff:
        raise StoreMismatchError(
            f"{out_dir}/{MANIFEST_FILE} was written for another measurement ({'; '.join(diff)}): pass the options it was written "
            "with, or replay into another --out"
        )


def write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _create(path: Path, data: dict) -> bool:
    """Publish ``data`` as ``path`` only if no file has that name (a hard link fails when it exists):
    of workers starting together into an empty store, one writes the manifest, the others read it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links (some FUSE mounts): exclusive create
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(tmp.read_text())
        return True
    finally:
        tmp.unlink(missing_ok=True)


def selection(names: Sequence[str] | None, log_spaced: int | None) -> dict:
    """What a replay asks for, as the manifest records it."""
    return {"revisions": sorted(names) if names is not None else None, "log_spaced": log_spaced}


def _describe(sel: dict) -> str:
    if sel.get("revisions") is not None:
        names = sel["revisions"]
        return f"revisions {', '.join(names[:6])}{', ...' if len(names) > 6 else ''}" + (
            f" (log-spaced {sel['log_spaced']})" if sel.get("log_spaced") else ""
        )
    return f"{sel['log_spaced']} log-spaced revisions" if sel.get("log_spaced") else "every listed revision"


# ---- resolving it ------------------------------------------------------------------------------------------
def resolve(recipe: Recipe, names: Sequence[str] | None, *, key: dict, out_dir, mode: str, log_spaced: int | None, cache_dir: str | None,
            tokens_per_step: int | None, local_source: RevisionSource | None = None, rewrite: bool = False,
            skip_duplicates: bool = False, running=(), policy=None) -> tuple[Manifest, list[Task]]:  # fmt: skip
    """The manifest and the tasks this call works on. ``mode``: ``require`` (read it: the unit, finalize), ``use`` (a
    worker or the driver: read it, its tasks holding ``names`` or all when this selection wrote it; written when there
    is none), ``peek`` (``--plan``: write nothing). ``rewrite``: update it (new revisions appended, moved commits
    fingerprinted), refused while ``running`` names tasks."""
    out = Path(out_dir) if out_dir is not None else None
    if mode == "require":
        m = require_manifest(out, recipe.model, key)
        m.seed_hub_cache()
        return m, list(m.task_list)
    sel = selection(names, log_spaced)
    existing = read_manifest(out) if out is not None else None
    busy = sorted(running)
    if rewrite and existing is not None and busy and mode != "peek":
        raise ValueError(
            f"{out}/{MANIFEST_FILE} is not rewritten while tasks run: {', '.join(busy[:8])}{' ...' if len(busy) > 8 else ''} "
            f"(their markers are in {out}/running/). Wait for them to end; a task killed without a word (SIGKILL, a lost "
            "node) keeps its marker until its next attempt or `--finalize` records it"
        )
    if existing is not None and not rewrite:
        _check_same(existing, out, recipe.model, key)  # a rewrite replaces the plan of another measurement (no records: the store check)
        chosen = _chosen(existing, names, sel)
        if chosen is None:
            raise ValueError(
                f"{out}/{MANIFEST_FILE} plans {len(existing.task_list)} task(s) for "
                f"{' / '.join(_describe(s) for s in existing.selections) or 'its revisions'}; this run asks for {_describe(sel)}. "
                "The manifest is the plan of every task of this store and never changes under a running job: add them with "
                f"--rewrite-manifest (python: rewrite_manifest=True; existing tasks keep their names and indices, new ones are "
                "appended), or replay into another --out"
            )
        existing.seed_hub_cache()
        return existing, chosen
    same = existing is not None and existing.model == recipe.model and not key_difference(existing.replay_key, key)
    previous = existing if same else None
    m = _compute(recipe, names, key=key, log_spaced=log_spaced, cache_dir=cache_dir, tokens_per_step=tokens_per_step,
                 previous=previous, local_source=local_source, skip_duplicates=skip_duplicates, policy=policy)  # fmt: skip
    m.selections = [*(previous.selections if previous is not None else []), sel]
    m.selections = [s for i, s in enumerate(m.selections) if s not in m.selections[:i]]
    if mode == "peek" or out is None:
        return m, _chosen(m, names, sel) or list(m.task_list)
    out.mkdir(parents=True, exist_ok=True)
    if existing is None:
        if not _create(out / MANIFEST_FILE, m.to_json()):  # another worker wrote it first: its plan is the plan
            return resolve(recipe, names, key=key, out_dir=out, mode=mode, log_spaced=log_spaced, cache_dir=cache_dir,
                           tokens_per_step=tokens_per_step, local_source=local_source, skip_duplicates=skip_duplicates)  # fmt: skip
    else:
        write_atomic(out / MANIFEST_FILE, m.to_json())
    return m, _chosen(m, names, sel) or list(m.task_list)


def _chosen(m: Manifest, names: Sequence[str] | None, sel: dict) -> list[Task] | None:
    """The tasks a run of ``sel`` works on: all when ``sel`` wrote the manifest, those holding ``names`` when every name is
    planned; None when the manifest does not plan this selection."""
    if sel in m.selections:
        return list(m.task_list) if names is None else _holding(m, names)
    if names is not None and set(names) <= {n for t in m.task_list for n in t.members}:
        return _holding(m, names)
    return None


def _holding(m: Manifest, names: Sequence[str]) -> list[Task]:
    wanted = set(names)
    return [t for t in m.task_list if wanted & set(t.members)]


def _entry(rev: Revision, weights: Weights | None, files: list[RemoteFile] | None, error: str | None = None) -> dict:
    return {
        "step": rev.step, "tokens": rev.tokens, "run": rev.run, "stage": rev.stage, "commit": rev.commit, "path": rev.path,
        "weights": dict(weights.files) if weights is not None else None,
        "fingerprint": weights.fingerprint if weights is not None else None,
        "files": [[f.path, f.size, f.sha256, f.blob_id] for f in files] if files is not None else None,
        **({"metadata_error": error} if error else {}),
    }  # fmt: skip


def _compute(recipe, names, *, key, log_spaced, cache_dir, tokens_per_step, previous: Manifest | None, local_source,
             skip_duplicates: bool, policy) -> Manifest:  # fmt: skip
    model = recipe.model
    aliases: list[Revision] = []
    refs: dict[str, str] = {}
    if local_source is not None:  # a local run: the whole folder is the listing, hashed through the store's hash cache
        check_local_names(local_source.local, names)
        sel = select_revisions(local_source.revisions, names, log_spaced=log_spaced)
        whole = sel.listed
        weights = dict(local_source.weights)
        entries = {r.name: _entry(r, weights.get(r.name), None) for r in whole}
    else:
        refs = list_refs(model, cache_dir=cache_dir)  # one request: every branch and tag with its commit
        sel = select_revisions(refs, names, pattern=recipe.revision_pattern, tokens_per_step=tokens_per_step, log_spaced=log_spaced)
        whole, aliases = sel.listed, sel.aliases
        entries, todo = {}, []
        for r in [*whole, *aliases]:
            old = previous.entries.get(r.name) if previous is not None else None
            if old is not None and old.get("commit") == r.commit and r.commit is not None and old.get("weights"):
                entries[r.name] = {**_entry(r, None, None), **{k: old[k] for k in ("weights", "fingerprint", "files")}}
            else:
                todo.append(r)
        if todo:  # one metadata request per new commit, here and never again (a commit never changes)
            errors: dict[str, str] = {}
            got = fingerprints(model, todo, cache_dir=cache_dir, errors=errors, policy=policy)
            for r in todo:
                files = remembered_files(model, r.commit) if r.commit else None
                entries[r.name] = _entry(r, got.get(r.name), files, errors.get(r.name))
    for t in previous.task_list if previous is not None else ():  # a planned revision gone from the listing keeps its entry
        for n in t.members:
            entries.setdefault(n, previous.entries[n])
    weights = {n: Weights(dict(e["weights"])) for n, e in entries.items() if e.get("weights")}
    chosen = sel.chosen
    m = Manifest(model, key, [], entries, aliases=[a.name for a in aliases], refs=dict(refs),
                 skip_duplicates=skip_duplicates or bool(previous and previous.skip_duplicates), written_at=time.time())  # fmt: skip
    planned = [r.name for r in chosen]
    if m.skip_duplicates:
        flags = m.groups()
        planned = [n for n in planned if n not in flags]  # --skip-duplicates: never a task, never downloaded
    old = previous.task_list if previous is not None else []
    m.task_list = group_tasks(planned, weights, old, entries)
    return m


def local_source(recipe, *, out_dir, tokens_per_step, lightning_module, live_store, write: bool) -> RevisionSource:
    """Every checkpoint of a local run, each hashed once per (path, size, mtime, inode) (``DIR/hashes.json``)."""
    path = Path(out_dir) / HASHES_FILE if out_dir is not None else None
    with hash_cache(path, write=write):
        return revision_source(recipe, tokens_per_step=tokens_per_step, lightning_module=lightning_module, live_store=live_store)
