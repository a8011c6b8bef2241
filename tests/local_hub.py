"""A stand-in Hugging Face hub on 127.0.0.1, for the replay tests (docs/design.md §8).

The real ``huggingface_hub`` client (and ``transformers.from_pretrained`` through it) talks to this
server exactly as to huggingface.co: the refs listing, model info with file metadata, the tree and
paths-info listings, and ``resolve`` downloads (HEAD for metadata, GET with Range for the bytes).
What the real hub does and the tests need is served the same way:

- branches point at commits; a commit is an immutable set of files; ``move_branch`` re-points a
  branch (OLMoE's ``main`` was rewritten) and the old commit stays downloadable by its id;
- weight files (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) are LFS files: their
  ETag is the content's sha256, also listed as ``lfs.sha256`` in the file metadata, known before
  any download; other files' ETag is their git blob id;
- faults: ``fail(substring, times, status)`` answers the next ``times`` requests whose path holds
  ``substring`` with ``status`` (503...), or drops the connection (``status=None``);
- ``throttle(bytes_per_s)`` slows every download, for the prefetch benchmark;
- ``log`` lists every request as (method, path, status), so a test can count downloads;
  ``on_request(method, path)``, when set, runs before each request is answered (a test can look at
  the client's cache at the moment a download starts).

Use it in a subprocess (``env(endpoint)``: ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE=0``, read by
huggingface_hub at import) or in this process (``patched_endpoint``).

    with LocalHub() as hub:
        commit = hub.add_revision("org/tiny", "step100", folder_written_by_save_pretrained)
        subprocess.run([...], env=hub.env(os.environ))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")
_CHUNK = 64 * 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class _File:
    data: bytes
    sha256: str
    blob_id: str

    def entry(self, path: str, is_lfs: bool) -> dict:
        """As the tree / paths-info endpoints list it."""
        out = {"type": "file", "path": path, "size": len(self.data), "oid": self.blob_id}
        if is_lfs:
            out["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": 134}
        return out

    def sibling(self, path: str, is_lfs: bool) -> dict:
        """As model_info(files_metadata=True) lists it."""
        out = {"rfilename": path, "size": len(self.data), "blobId": self.blob_id}
        if is_lfs:
            out["lfs"] = {"sha256": self.sha256, "size": len(self.data), "pointerSize": 134}
        return out


def _is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


@dataclass
class _Repo:
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit
    commits: dict[str, dict[str, _File]] = field(default_factory=dict)  # commit -> {path: file}
    tags: dict[str, str] = field(default_factory=dict)  # tag -> commit (listed under "tags", as the hub lists them)


@dataclass
class _Fault:
    substring: str
    times: int
    status: int | None  # None: drop the connection without an answer
    method: str | None  # only requests of this verb (GET: the download itself, not its HEAD)


class LocalHub:
    """The server and its content; ``with LocalHub() as hub`` starts and stops it."""

    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.log: list[tuple[str, str, int | None]] = []
        self._faults: list[_Fault] = []
        self._bytes_per_s: float | None = None
        self.on_request = None
        self._lock = threading.Lock()
        self._pushes = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- content -------------------------------------------------------------------------------
    def add_revision(self, repo: str, branch: str, files: Path | dict[str, bytes]) -> str:
        """Push ``files`` (a folder, e.g. ``save_pretrained`` output, or {path: bytes}) as a new
        commit and point ``branch`` at it. Returns the commit id (40 hex digits)."""
        content = _read_files(files)
        with self._lock:
            r = self.repos.setdefault(repo, _Repo())
            self._pushes += 1
            listing = json.dumps(sorted((p, f.blob_id) for p, f in content.items()))
            commit = hashlib.sha1(f"{repo}\n{branch}\n{self._pushes}\n{listing}".encode()).hexdigest()
            r.commits[commit] = content
            r.branches[branch] = commit
        return commit

    move_branch = add_revision  # a branch re-pointed at new weights: a new commit, the old one kept

    def commit_of(self, repo: str, branch: str) -> str:
        return self.repos[repo].branches.get(branch) or self.repos[repo].tags[branch]

    def add_tag(self, repo: str, tag: str, files: Path | dict[str, bytes]) -> str:
        """Push ``files`` as a commit only the tag ``tag`` points at (a release tag); returns the commit."""
        self.add_revision(repo, tag, files)
        with self._lock:
            r = self.repos[repo]
            r.tags[tag] = r.branches.pop(tag)
        return r.tags[tag]

    # ---- faults and bandwidth ----------------------------------------------------------------------
    def fail(self, substring: str, times: int = 1, status: int | None = 503, method: str | None = None) -> None:
        """Answer the next ``times`` requests whose path holds ``substring`` (and whose verb is
        ``method``, when given) with ``status`` (None: close the connection without answering)."""
        with self._lock:
            self._faults.append(_Fault(substring, times, status, method))

    def clear_faults(self) -> None:
        """Forget every fault still pending."""
        with self._lock:
            self._faults.clear()

    def throttle(self, bytes_per_s: float | None) -> None:
        """Serve downloads at about ``bytes_per_s`` (None: as fast as the loopback goes)."""
        self._bytes_per_s = bytes_per_s

    def downloads(self, substring: str = "") -> list[str]:
        """Paths of completed GET downloads (``resolve``, status 200/206) holding ``substring``."""
        return [p for m, p, s in self.log if m == "GET" and "/resolve/" in p and s in (200, 206) and substring in p]

    # ---- server ---------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start the hub first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def env(self, base: dict | None = None) -> dict:
        """An environment for a subprocess that talks to this hub through huggingface_hub."""
        env = dict(os.environ if base is None else base)
        env.update({"HF_ENDPOINT": self.endpoint, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"})
        env.pop("TRANSFORMERS_OFFLINE", None)
        return env

    def start(self) -> LocalHub:
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- what the handler asks ------------------------------------------------------------------
    def _take_fault(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.times > 0 and f.substring in path and f.method in (None, method):
                    f.times -= 1
                    return f
        return None

    def _resolve(self, repo: str, revision: str) -> tuple[str, dict[str, _File]] | None:
        r = self.repos.get(repo)
        if r is None:
            return None
        commit = r.branches.get(revision) or r.tags.get(revision, revision)
        files = r.commits.get(commit)
        return (commit, files) if files is not None else None


def _read_files(files: Path | dict[str, bytes]) -> dict[str, _File]:
    if isinstance(files, dict):
        items = files.items()
    else:
        root = Path(files)
        items = ((p.relative_to(root).as_posix(), p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file())
    return {path: _File(data, hashlib.sha256(data).hexdigest(), git_blob_id(data)) for path, data in items}


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that went away mid-answer (a killed worker) is not the hub's error: say nothing."""
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(refs|revision|tree|paths-info)(?:/(.*))?)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _Handler(BaseHTTPRequestHandler):
    server_hub: LocalHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: the hub keeps its own log
        pass

    # ---- verbs -----------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        hub = self.server_hub
        split = urlsplit(self.path)
        path = split.path
        if hub.on_request is not None:
            hub.on_request(method, unquote(path))
        fault = hub._take_fault(method, unquote(path))
        self._logged = False
        try:
            self._dispatch(method, path, split.query, fault)
        finally:
            if not self._logged:  # a dropped connection: no status line
                hub.log.append((method, unquote(path), None))

    def send_response(self, code, message=None) -> None:
        # logged before the answer leaves: a client that has its answer always finds the request in the log
        self.server_hub.log.append((self.command, unquote(urlsplit(self.path).path), code))
        self._logged = True
        super().send_response(code, message)

    def _dispatch(self, method: str, path: str, query: str, fault: _Fault | None) -> None:
        if fault is not None:
            if fault.status is None:
                self.close_connection = True
                self.connection.shutdown(2)  # a dropped connection: no status line at all
                return
            self._json({"error": f"injected {fault.status}"}, status=fault.status)
            return
        m = _RESOLVE.match(path)
        if m:
            self._resolve_file(method, unquote(m.group(1)), unquote(m.group(2)), unquote(m.group(3)))
            return
        m = _API.match(path)
        if m:
            repo, kind, rest = unquote(m.group(1)), m.group(2), unquote(m.group(3) or "")
            self._api(method, repo, kind, rest, parse_qs(query))
            return
        self._json({"error": "not found"}, status=404, error_code="RepoNotFound")

    # ---- endpoints --------------------------------------------------------------------------------
    def _api(self, method: str, repo: str, kind: str | None, rest: str, query: dict) -> None:
        hub = self.server_hub
        r = hub.repos.get(repo)
        if r is None:
            self._json({"error": f"Repository {repo} not found"}, status=404, error_code="RepoNotFound")
            return
        if kind == "refs":
            branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": c} for b, c in r.branches.items()]
            tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": c} for t, c in r.tags.items()]
            self._json({"branches": branches, "tags": tags, "converts": [], "pullRequests": []})
            return
        revision = rest.split("/", 1)[0] if kind in ("revision", "tree", "paths-info") else "main"
        sub = rest.split("/", 1)[1] if kind == "tree" and "/" in rest else ""
        found = hub._resolve(repo, revision or "main")
        if found is None:
            self._json({"error": f"Invalid rev id: {revision}"}, status=404, error_code="RevisionNotFound")
            return
        commit, files = found
        if kind in (None, "revision"):
            siblings = [f.sibling(p, _is_lfs(p)) for p, f in sorted(files.items())]
            self._json({"id": repo, "modelId": repo, "sha": commit, "private": False, "siblings": siblings, "tags": []})
        elif kind == "tree":
            prefix = sub.rstrip("/") + "/" if sub else ""
            self._json([f.entry(p, _is_lfs(p)) for p, f in sorted(files.items()) if p.startswith(prefix)])
        else:  # paths-info: POST {"paths": [...]}
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode() if length else ""
            try:
                wanted = json.loads(body).get("paths", [])
            except json.JSONDecodeError:
                wanted = parse_qs(body).get("paths", [])
            self._json([files[p].entry(p, _is_lfs(p)) for p in wanted if p in files])

    def _resolve_file(self, method: str, repo: str, revision: str, filename: str) -> None:
        hub = self.server_hub
        found = hub._resolve(repo, revision)
        if found is None:
            code = "RepoNotFound" if repo not in hub.repos else "RevisionNotFound"
            self._json({"error": f"{repo}@{revision} not found"}, status=404, error_code=code)
            return
        commit, files = found
        f = files.get(filename)
        if f is None:
            self._json({"error": f"{filename} not found"}, status=404, error_code="EntryNotFound", commit=commit)
            return
        etag = f.sha256 if _is_lfs(filename) else f.blob_id
        start = 0
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if m:
                start = min(int(m.group(1)), len(f.data))
        body = f.data[start:]
        status = 206 if start else 200
        self.send_response(status)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{etag}"')
        if _is_lfs(filename):
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(len(f.data)))
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(f.data) - 1}/{len(f.data)}")
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if method == "GET":
            self._send_body(body)

    # ---- writing ----------------------------------------------------------------------------------
    def _send_body(self, body: bytes) -> None:
        rate = self.server_hub._bytes_per_s
        t0 = time.perf_counter()
        for i in range(0, len(body), _CHUNK):
            self.wfile.write(body[i : i + _CHUNK])
            if rate:
                ahead = (i + _CHUNK) / rate - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)

    def _json(self, data, status: int = 200, error_code: str | None = None, commit: str | None = None) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if error_code:
            self.send_header("X-Error-Code", error_code)
            self.send_header("X-Error-Message", str(data.get("error", "")) if isinstance(data, dict) else "")
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


@contextlib.contextmanager
def patched_endpoint(endpoint: str) -> Iterator[None]:
    """Point this process's huggingface_hub at ``endpoint`` (online), restoring everything after.

    huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE once, at import: its constants, the URL
    template and the module-level ``HfApi`` behind ``list_repo_refs``/``model_info`` are patched here."""
    from huggingface_hub import constants, hf_api

    saved = (constants.ENDPOINT, constants.HUGGINGFACE_CO_URL_TEMPLATE, constants.HF_HUB_OFFLINE, hf_api.api.endpoint)
    saved_env = {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_XET")}
    constants.ENDPOINT = endpoint
    constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    constants.HF_HUB_OFFLINE = False
    hf_api.api.endpoint = endpoint
    os.environ.update({"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"})
    try:
        yield
    finally:
        constants.ENDPOINT, constants.HUGGINGFACE_CO_URL_TEMPLATE, constants.HF_HUB_OFFLINE, hf_api.api.endpoint = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def tiny_revisions(folder: Path, repo: str, names, family: str = "llama", **build_kwargs) -> Iterator[LocalHub]:
    """A stand-in hub serving ``repo``'s revisions ``names``, each a tiny ``family`` model (seed: its index) saved
    under ``folder``, with this process's huggingface_hub pointed at it while it lives."""
    from tiny_models import build

    with LocalHub() as h:
        for i, name in enumerate(names):
            build(family, seed=i, **build_kwargs).save_pretrained(Path(folder) / name)
            h.add_revision(repo, name, Path(folder) / name)
        with patched_endpoint(h.endpoint):
            yield h
