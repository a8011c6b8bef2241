"""What each replay record measured (docs/design.md §8, §10): the commit its branch resolved to, a fingerprint of the
weights, the versions and the device; and the revisions whose weights are not their own.

- **Fingerprint.** sha256 over the sorted (path, sha256) of a revision's weight files. On the hub every weight file's
  sha256 is in its LFS metadata, known before any download (``hub.remote_files``); in a local Hugging Face cache a
  snapshot file links to ``blobs/<sha256>`` (the hub's ETag), else it is hashed; a user's checkpoint folder is hashed.
- **Wrong branches** (EleutherAI/pythia#205: step branches serving the final weights; #206: two branches whose first
  shard is the final one). Revisions and refs connected through shared weight files form a group, over the whole
  listing. A step branch in a group is flagged (``duplicate_of``, a warning, a row in the report, left out of the
  trajectory and the stages) unless it is its run's final step, which keeps the weights ``main`` or a later step serve.
  Two final steps in one group (parallel runs ending on the same weights) are both flagged. Expected aliases are no
  points: a name without a step (``main``, a tag) and a later stage's step 0 (OLMo-3's ``stage2-ingredient1-step0`` is
  stage 1's last weights).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..models.hub import RetryPolicy, cache_repo_dir, call_with_retries, is_weight_file, remote_files
from ..records import versions
from .revisions import Revision, order_key

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 22


# ---- weights --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Weights:
    """A revision's weight files: path -> content sha256 (``git:<blob id>`` for a plain git file)."""

    files: dict[str, str]

    @property
    def fingerprint(self) -> str:
        """sha256 over the sorted (path, sha256) lines: equal fingerprints, identical weight files."""
        text = "\n".join(f"{p}\t{h}" for p, h in sorted(self.files.items()))
        return hashlib.sha256(text.encode()).hexdigest()


class HashCache:
    """sha256 of local files keyed by (real path, size, mtime, inode): a checkpoint is read again only when one changes.
    Kept in the store's ``hashes.json``, written whole by rename."""

    def __init__(self, path: Path | None, write: bool = True):
        self.path, self.write = path, write
        self.table: dict[str, str] = {}
        if path is not None:
            try:
                self.table = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                self.table = {}
        self.dirty = False

    @staticmethod
    def key(p: Path) -> str:
        st = p.stat()
        return f"{os.path.realpath(p)}\t{st.st_size}\t{st.st_mtime_ns}\t{st.st_ino}"

    def save(self) -> None:
        if self.path is None or not self.dirty or not self.write:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.table))
        os.replace(tmp, self.path)


_HASHES: list[HashCache] = []


@contextlib.contextmanager
def hash_cache(path: str | os.PathLike | None, *, write: bool = True) -> Iterator[HashCache]:
    """Inside, ``file_sha256`` reads a file's bytes only when its (path, size, mtime, inode) is new."""
    cache = HashCache(Path(path) if path is not None else None, write=write)
    _HASHES.append(cache)
    try:
        yield cache
    finally:
        _HASHES.remove(cache)
        cache.save()


def file_sha256(path: str | os.PathLike) -> str:
    """The content sha256 of a file: a hub-cache link into ``blobs/<sha256>`` by its target's name (the LFS ETag), without
    reading it; inside ``hash_cache``, a file with a known (path, size, mtime, inode) is not read either."""
    p = Path(path)
    if p.is_symlink():
        target = p.resolve().name
        if _SHA256.fullmatch(target) and p.resolve().parent.name == "blobs":
            return target
    cache = _HASHES[-1] if _HASHES else None
    key = cache.key(p) if cache is not None else None
    if cache is not None and key in cache.table:
        return cache.table[key]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        cache.table[key] = digest
        cache.dirty = True
    return digest


def weights_of_files(root: str | os.PathLike, paths: Iterable[str | os.PathLike] | None = None) -> Weights:
    """The weight files under ``root`` (``hub.is_weight_file``), or the given ``paths``, hashed."""
    root = Path(root)
    if root.is_file():
        return Weights({root.name: file_sha256(root)})
    chosen = [Path(p) for p in paths] if paths is not None else [p for p in sorted(root.rglob("*")) if is_weight_file(p.name)]
    files = {p.relative_to(root).as_posix(): file_sha256(p) for p in chosen if p.is_file()}
    if not files:
        raise FileNotFoundError(f"no weight files under {root}")
    return Weights(files)


def weights_from_hub(model: str, commit: str, policy=None) -> Weights:
    """From the hub's file metadata at ``commit``: nothing is downloaded (``policy``: its retries, a ``RetryPolicy``)."""
    listed = call_with_retries(lambda: remote_files(model, commit), policy or RetryPolicy(), f"file metadata of {model}@{commit[:12]}")
    files = {f.path: (f.sha256 or f"git:{f.blob_id}") for f in listed if f.is_weights}
    if not files:
        raise FileNotFoundError(f"{model}@{commit} lists no weight files")
    return Weights(files)


def weights_from_cache(model: str, commit: str, cache_dir: str | None) -> Weights:
    """From a local Hugging Face cache's snapshot of ``commit``."""
    snapshot = cache_repo_dir(model, cache_dir) / "snapshots" / commit
    if not snapshot.is_dir():
        raise FileNotFoundError(f"{model}@{commit} is not in the local cache")
    return weights_of_files(snapshot)


def fingerprints(model: str, revs: Sequence[Revision], *, cache_dir: str | None = None, offline: bool | None = None,
                 errors: dict | None = None, policy=None) -> dict[str, Weights]:  # fmt: skip
    """name -> Weights of every revision readable without a download: a local revision's files, the hub's metadata, or the
    local cache (``HF_HUB_OFFLINE=1``). An unreadable one gets no entry (one warning; ``errors`` gets name -> why): never
    called a duplicate on a guess, and every task asks again before it records."""
    from ..models.loading import hub_offline

    offline = hub_offline() if offline is None else offline
    out: dict[str, Weights] = {}
    missing: dict[str, str] = {}
    for rev in revs:
        try:
            out[rev.name] = weights_of(model, rev, cache_dir=cache_dir, offline=offline, policy=policy)
        except Exception as exc:  # noqa: BLE001 - provenance never stops a replay; the task asks again
            missing[rev.name] = f"{type(exc).__name__}: {exc}"
    if missing:
        if errors is not None:
            errors.update(missing)
        warnings.warn(
            f"sinkwatch replay: no weights fingerprint for {', '.join(f'{n} ({e})' for n, e in missing.items())}; each task asks "
            "again before it records (a step could be a copy of any of them); a record that could be a copy of one still unknown "
            "is drawn marked unverified", RuntimeWarning, stacklevel=2,
        )  # fmt: skip
    return out


def weights_of(model: str, rev: Revision, *, cache_dir: str | None = None, offline: bool = False, policy=None) -> Weights:
    """One revision's weights, read without downloading them (raises when they cannot be read)."""
    if rev.path is not None:
        return weights_of_files(rev.path, _local_weight_paths(rev.path))
    if rev.commit is None:
        raise FileNotFoundError(f"{model} has no branch or tag {rev.name!r}")
    if offline:
        return weights_from_cache(model, rev.commit, cache_dir)
    return weights_from_hub(model, rev.commit, policy)


def _local_weight_paths(path: str) -> list[Path] | None:
    """An OLMo-core checkpoint's weights are its ``model_and_optim`` shards (``*.distcp``)."""
    p = Path(path)
    shards = sorted((p / "model_and_optim").glob("*.distcp")) if p.is_dir() else []
    return shards or None


# ---- duplicates -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DuplicateGroup:
    """Revisions connected by shared weight files. ``identical``: every member's weight files are the same."""

    members: tuple[str, ...]  # training order
    duplicate_of: str
    identical: bool
    shared_files: tuple[str, ...]  # paths of the files two or more members share

    def describe(self) -> str:
        what = "serve identical weights" if self.identical else f"share weight files ({', '.join(self.shared_files)})"
        return f"{', '.join(self.members)} {what}"


def _is_point(rev: Revision) -> bool:
    """A trajectory point: a step, and not a later stage's step 0 (that stage starting from the last one)."""
    return rev.step is not None and not ((rev.stage or 0) >= 2 and rev.step == 0)


def could_be_a_copy(rev: Revision, listing: Sequence[Revision]) -> bool:
    """Whether ``rev`` would be flagged were it serving another ref's weights: a point that is not its run's final step
    (the final step keeps the weights it shares; ``main``, tags and a later stage's step 0 are expected aliases)."""
    return _is_point(rev) and rev.step != max((r.step for r in listing if _is_point(r) and r.run == rev.run), default=rev.step)


def find_duplicates(revs: Sequence[Revision], weights: dict[str, Weights], aliases: Sequence[Revision] = ()) -> dict[str, DuplicateGroup]:
    """name -> its group, for every flagged revision (the module doc). ``revs``: the whole listing (each run's final step
    is read from it); ``aliases``: refs (``main``, tags) whose weights connect a group without being measured."""
    nodes = {r.name: r for r in [*aliases, *revs] if r.name in weights}
    parent = {n: n for n in nodes}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    owner: dict[str, str] = {}  # file sha256 -> first node holding it
    for n in nodes:
        for sha in set(weights[n].files.values()):
            if sha in owner:
                parent[find(n)] = find(owner[sha])
            else:
                owner[sha] = n
    groups: dict[str, list[str]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    final: dict[str | None, int] = {}  # run -> its last step in the listing
    for r in revs:
        if _is_point(r):
            final[r.run] = max(final.get(r.run, r.step), r.step)
    out: dict[str, DuplicateGroup] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        members = sorted(members, key=lambda m: order_key(nodes[m]))
        points = [m for m in members if _is_point(nodes[m])]
        finals = [m for m in points if nodes[m].step == final[nodes[m].run]]
        keeper = finals[0] if len(finals) == 1 else None  # the weights are the final step's: it keeps them
        flagged = [m for m in points if m != keeper]
        if not flagged:
            continue
        counts: dict[str, int] = {}
        for m in members:
            for sha in weights[m].files.values():
                counts[sha] = counts.get(sha, 0) + 1
        shared = sorted({p for m in members for p, sha in weights[m].files.items() if counts[sha] > 1})
        others = [m for m in members if not _is_point(nodes[m])]  # main, tags, a later stage's step 0
        anchor = "main" if "main" in members else keeper or (others[0] if others else flagged[0])
        identical = len({weights[m].fingerprint for m in members}) == 1
        group = DuplicateGroup(members=tuple(members), duplicate_of=anchor, identical=identical, shared_files=tuple(shared))
        for m in flagged:
            out[m] = group
    return out


def warn_duplicates(model: str, flags: dict[str, DuplicateGroup]) -> None:
    for group in {g.members: g for g in flags.values()}.values():
        warnings.warn(
            f"sinkwatch replay: {model}: {group.describe()} — {', '.join(n for n, g in flags.items() if g is group)} flagged "
            f"(duplicate_of={group.duplicate_of}) and left out of the trajectory and the stages: a published branch whose "
            "weights are not its own (see EleutherAI/pythia#205, #206). Their records are kept and listed in the report; "
            "--skip-duplicates does not measure them", RuntimeWarning, stacklevel=2,
        )  # fmt: skip


# ---- what a record says about itself ------------------------------------------------------------------
def provenance(rev: Revision, weights: Weights | None, group: DuplicateGroup | None) -> dict:
    """The record keys of docs/design.md §10 that say what was measured (``device`` is added once loaded)."""
    out = {
        "commit": rev.commit,
        "weights_fingerprint": weights.fingerprint if weights is not None else None,
        "weight_files": dict(weights.files) if weights is not None else None,
        "duplicate_of": group.duplicate_of if group is not None else None,
        "versions": versions(),
    }
    if group is not None:
        out["duplicate_group"] = list(group.members)
        out["duplicate_kind"] = "identical" if group.identical else "shared files: " + ", ".join(group.shared_files)
    if rev.run is not None:
        out["run"] = rev.run
    if rev.stage is not None:
        out["stage"] = rev.stage
    if rev.path is not None:
        out["path"] = rev.path
    return out


# ---- reading a store back ----------------------------------------------------------------------------
def moved_branches(records: Sequence[dict]) -> dict[str, list[str]]:
    """revision -> its records' commits in write order, for revisions measured at several commits (a moved branch: the
    latest record is drawn)."""
    seen: dict[str, list[str]] = {}
    for r in records:
        c = r.get("commit")
        if c is not None and c not in seen.setdefault(r["revision"], []):
            seen[r["revision"]].append(c)
    return {rev: commits for rev, commits in seen.items() if len(commits) > 1}
