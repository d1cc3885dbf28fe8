"""A local stand-in for the Hugging Face Hub HTTP API, so Hub code is tested on 127.0.0.1.

``huggingface_hub`` runs unmodified against it (with ``HF_ENDPOINT=<server.url>`` and
``HF_HUB_DISABLE_XET=1``, see ``tests/hub/conftest.py``). Model repos only. It implements:

* ``POST /api/repos/create`` (``visibility`` / ``private``; 409 when the repo exists; the first
  commit holds ``.gitattributes`` as on the Hub) and ``POST /api/models/{repo}/branch/{name}``;
* ``POST /api/validate-yaml``: the card metadata must be a YAML mapping; a few keys the Hub knows
  (license, pipeline_tag, library_name, base_model, datasets, tags, ...) are type-checked;
* ``POST /api/models/{repo}/preupload/{rev}``: ``lfs`` for weight / binary suffixes and files over
  10 MB, ``regular`` otherwise, plus the remote oid so unchanged files are skipped;
* the LFS batch API ``POST /{repo}.git/info/lfs/objects/batch`` ("basic" transfer): objects already
  stored get no action, the others a one-use ``PUT /_lfs/{oid}?ticket=...`` URL (a stand-in for a
  presigned S3 URL: no Authorization) where the body's size and sha256 are verified;
* ``POST /api/models/{repo}/commit/{rev}`` (NDJSON: header, file (base64), lfsFile, deletedFile);
* ``GET /api/models/{repo}[/revision/{rev}]``, ``GET /api/models/{repo}/tree/{rev}[/{path}]``
  (files only, one page), and ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}`` with ETag,
  X-Repo-Commit, Content-Length and X-Linked-Etag / X-Linked-Size for LFS files (no redirects);
* ``Authorization: Bearer <token>``: a wrong token is a 401 everywhere; no token is a 401 for
  writes and for reads of private repos. Errors are the Hub's JSON ``{"error": ...}`` with the
  ``X-Error-Code`` / ``X-Error-Message`` headers huggingface_hub maps to its exceptions.

Not implemented: datasets and spaces, users and namespaces (the one token may write anywhere),
pull requests, tags, deletes of folders, copies, .gitignore, xet, multipart LFS uploads, range
requests, tree folders and pagination, paths-info, and persistence across restarts (blobs are on
disk, the commit graph is in memory).

Tests steer it with :meth:`HubServer.fail` (the next N requests matching a method and a path
regex get an HTTP status, a dropped connection, or are done with their answer lost) and read
:attr:`HubServer.requests`, the ``(method, path)`` of every request received (no query strings,
headers or bodies), and :attr:`HubServer.commits`, every commit that landed through the commit API
(repo, branch, summary, the paths it added, changed or deleted), in order;
:attr:`HubServer.unrouted` lists requests for an API it does not implement.

Usage::

    with HubServer(tmp_path / "hub", token="hf_test") as hub:      # hub.url: http://127.0.0.1:PORT
        hub.fail("POST", r"/commit/", action=500, times=1)
        ...
        assert ("PUT", f"/_lfs/{oid}") not in hub.requests
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".model",
                ".png", ".jpg", ".jpeg", ".gif", ".zip", ".gz", ".tar")
REGULAR_MAX_BYTES = 10 * 2**20
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES).encode()
PIPELINE_TAGS = {"text-generation", "text-classification", "token-classification", "fill-mask",
                 "question-answering", "summarization", "translation", "text2text-generation",
                 "feature-extraction", "zero-shot-classification", "sentence-similarity"}
LICENSES = {"apache-2.0", "mit", "bsd-3-clause", "gpl-3.0", "cc-by-4.0", "cc-by-sa-4.0", "cc-by-nc-4.0",
            "openrail", "llama2", "llama3", "llama3.1", "llama3.2", "gemma", "other", "unknown"}
KEY_TYPES = {"license": str, "library_name": str, "pipeline_tag": str, "base_model": (str, list),
             "datasets": (str, list), "language": (str, list), "tags": list, "metrics": list,
             "model_name": str, "model-index": list}
REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [  # (methods, path regex, handler method name)
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("GET", rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", "repo_info"),
    ("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
    ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ("POST", rf"/api/models/{REPO}/branch/(?P<rev>[^/]+)", "create_branch"),
    ("POST", rf"/{REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
    ("PUT", r"/_lfs/(?P<oid>[0-9a-f]{64})", "lfs_put"),
    ("GET HEAD", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]


class HttpError(Exception):
    """An error answer: status, message, and the X-Error-Code huggingface_hub dispatches on."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers, self.extra = headers or {}, extra or {}


@dataclass
class Entry:
    """One file of a commit: its size, sha256 (the blob store key), LFS flag and git blob id."""

    size: int
    sha256: str
    lfs: bool
    blob_id: str


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit id
    trees: dict[str, dict[str, Entry]] = field(default_factory=dict)  # commit id -> path -> file


@dataclass(frozen=True)
class Commit:
    """A commit that landed: what the client asked for, as the server applied it."""

    repo: str
    branch: str
    summary: str
    paths: tuple[str, ...]  # in the order the client sent them


@dataclass
class Rule:
    method: str
    pattern: str
    action: int | str  # an HTTP status, "drop" (close the connection unanswered) or "lose" (do it, then drop)
    times: int
    after: int  # matching requests to let through first


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


class HubServer:
    """The server: state, routes, failure rules and request log (see the module docstring)."""

    def __init__(self, root: Path, token: str):
        self.blobs = Path(root) / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.commits: list[Commit] = []  # landed through POST .../commit/{rev}
        self.unrouted: list[tuple[str, str]] = []  # requests for an API this server lacks
        self.rules: list[Rule] = []
        self.tickets: dict[str, tuple[str, int]] = {}  # LFS upload ticket -> (oid, size)
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # ---------------------------------------------------------------- test controls

    def fail(self, method: str, pattern: str, action: int | str = 500, times: int = 1, after: int = 0) -> None:
        """Answer ``times`` requests whose path matches ``pattern`` with ``action``, once ``after``
        of them have been served normally."""
        with self._lock:
            self.rules.append(Rule(method, pattern, action, times, after))

    def take_rule(self, method: str, path: str) -> Rule | None:
        with self._lock:
            self.requests.append((method, path))
            for rule in self.rules:
                if rule.times > 0 and rule.method == method and re.search(rule.pattern, path):
                    if rule.after > 0:
                        rule.after -= 1
                        continue
                    rule.times -= 1
                    return rule
        return None

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        """The content of every file of ``repo_id`` at ``rev``."""
        repo = self.repos[repo_id]
        tree = repo.trees[self.commit_of(repo, rev)]
        return {path: (self.blobs / e.sha256).read_bytes() for path, e in tree.items()}

    # ---------------------------------------------------------------- state helpers

    def check_auth(self, auth: str | None, write: bool, repo: Repo | None = None) -> None:
        if auth is not None and auth != f"Bearer {self.token}":
            raise HttpError(401, "Invalid credentials in Authorization header")
        if auth is None and (write or (repo is not None and repo.private)):
            raise HttpError(401, "Invalid username or password.")

    def repo(self, repo_id: str, auth: str | None, write: bool = False) -> Repo:
        self.check_auth(auth, write)
        repo = self.repos.get(repo_id)
        if repo is None:
            raise HttpError(404, "Repository not found", "RepoNotFound")
        self.check_auth(auth, write, repo)
        return repo

    def commit_of(self, repo: Repo, rev: str) -> str:
        if rev in repo.branches:
            return repo.branches[rev]
        if rev in repo.trees:
            return rev
        raise HttpError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def store(self, data: bytes) -> str:
        oid = hashlib.sha256(data).hexdigest()
        (self.blobs / oid).write_bytes(data)
        return oid

    def new_commit(self, repo: Repo, branch: str, changes: dict[str, Entry | None], summary: str) -> str:
        parent = repo.branches[branch]
        tree = dict(repo.trees[parent]) if parent else {}
        for path, entry in changes.items():
            if entry is None:
                tree.pop(path, None)
            else:
                tree[path] = entry
        oid = hashlib.sha1(f"{parent}{summary}{next(self._ids)}".encode()).hexdigest()
        repo.trees[oid], repo.branches[branch] = tree, oid
        return oid

    # ---------------------------------------------------------------- routes

    def create_repo(self, h: _Handler) -> tuple[int, dict]:
        self.check_auth(h.auth, write=True)
        body = h.json_body()
        repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
        url = f"{self.url}/{repo_id}"
        if repo_id in self.repos:
            raise HttpError(409, "You already created this model repo", extra={"url": url})
        private = body.get("visibility") == "private" or bool(body.get("private"))
        repo = self.repos[repo_id] = Repo(private=private, branches={"main": ""})
        entry = Entry(len(GITATTRIBUTES), self.store(GITATTRIBUTES), False, git_blob_id(GITATTRIBUTES))
        self.new_commit(repo, "main", {".gitattributes": entry}, "initial commit")
        return 200, {"url": url, "name": repo_id, "id": repo_id}

    def create_branch(self, h: _Handler, repo: str, rev: str) -> tuple[int, dict]:
        r = self.repo(repo, h.auth, write=True)
        if rev in r.branches:
            raise HttpError(409, f"Reference refs/heads/{rev} already exists")
        start = h.json_body().get("startingPoint") or "main"
        r.branches[rev] = self.commit_of(r, start)
        return 200, {}

    def validate_yaml(self, h: _Handler) -> tuple[int, dict]:
        content = h.json_body().get("content", "")
        match = re.match(r"---\n(.*?)\n---", content, re.DOTALL)
        errors = []
        try:
            meta = yaml.safe_load(match.group(1)) if match else {}
        except yaml.YAMLError as e:
            meta, errors = {}, [f"YAML is not valid: {e}"]
        if not isinstance(meta, dict):
            meta, errors = {}, ["metadata must be a YAML mapping"]
        for key, types in KEY_TYPES.items():
            if key in meta and not isinstance(meta[key], types):
                errors.append(f'"{key}" must be of type {types}, got {type(meta[key]).__name__}')
        if "pipeline_tag" in meta and meta["pipeline_tag"] not in PIPELINE_TAGS:
            errors.append(f'"pipeline_tag" must be a known task, got {meta["pipeline_tag"]!r}')
        if "license" in meta and meta["license"] not in LICENSES:
            errors.append(f'"license" must be a license id or "other", got {meta["license"]!r}')
        status = 400 if errors else 200
        return status, {"errors": [{"message": m} for m in errors], "warnings": []}

    def repo_info(self, h: _Handler, repo: str, rev: str | None) -> tuple[int, dict]:
        r = self.repo(repo, h.auth)
        sha = self.commit_of(r, rev or "main")
        siblings = [{"rfilename": p, "size": e.size, "blobId": e.blob_id} for p, e in r.trees[sha].items()]
        return 200, {"id": repo, "modelId": repo, "private": r.private, "sha": sha, "siblings": siblings}

    def tree(self, h: _Handler, repo: str, rev: str, path: str | None) -> tuple[int, list]:
        r = self.repo(repo, h.auth)
        prefix = f"{path.rstrip('/')}/" if path else ""
        return 200, [
            {"type": "file", "oid": e.blob_id, "size": e.size, "path": p,
             **({"lfs": {"oid": e.sha256, "size": e.size, "pointerSize": len(lfs_pointer(e.sha256, e.size))}}
                if e.lfs else {})}
            for p, e in sorted(r.trees[self.commit_of(r, rev)].items()) if p.startswith(prefix)
        ]

    def preupload(self, h: _Handler, repo: str, rev: str) -> tuple[int, dict]:
        r = self.repo(repo, h.auth, write=True)
        head = self.commit_of(r, rev)
        files = []
        for f in h.json_body()["files"]:
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] > REGULAR_MAX_BYTES
            old = r.trees[head].get(f["path"])
            oid = None if old is None or old.lfs != lfs else (old.sha256 if lfs else old.blob_id)
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                          "shouldIgnore": False, "oid": oid})
        return 200, {"files": files, "commitOid": head}

    def lfs_batch(self, h: _Handler, repo: str) -> tuple[int, dict]:
        self.repo(repo, h.auth, write=True)
        objects = []
        for obj in h.json_body()["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if not (self.blobs / obj["oid"]).exists():
                ticket = secrets.token_hex(8)
                self.tickets[ticket] = (obj["oid"], obj["size"])
                href = f"{self.url}/_lfs/{obj['oid']}?ticket={ticket}"
                answer["actions"] = {"upload": {"href": href}}
            objects.append(answer)
        return 200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}

    def lfs_put(self, h: _Handler, oid: str) -> tuple[int, dict]:
        ticket = parse_qs(h.query).get("ticket", [""])[0]
        data = h.body()
        if self.tickets.pop(ticket, None) != (oid, len(data)):
            raise HttpError(403, "Request has expired")
        if hashlib.sha256(data).hexdigest() != oid:
            raise HttpError(400, f"sha256 of the uploaded content is not {oid}")
        self.store(data)
        return 200, {}

    def commit(self, h: _Handler, repo: str, rev: str) -> tuple[int, dict]:
        r = self.repo(repo, h.auth, write=True)
        self.commit_of(r, rev)
        if rev not in r.branches:
            raise HttpError(400, f"Cannot commit to {rev}: not a branch")
        lines = [json.loads(line) for line in h.body().splitlines() if line.strip()]
        summary, changes = "", {}
        for item in lines:
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value["summary"]
            elif key == "file":
                data = base64.b64decode(value["content"])
                changes[value["path"]] = Entry(len(data), self.store(data), False, git_blob_id(data))
            elif key == "lfsFile":
                if not (self.blobs / value["oid"]).exists():
                    raise HttpError(422, f"LFS object {value['oid']} of {value['path']} was not uploaded")
                blob_id = git_blob_id(lfs_pointer(value["oid"], value["size"]))
                changes[value["path"]] = Entry(value["size"], value["oid"], True, blob_id)
            elif key == "deletedFile":
                changes[value["path"]] = None
            else:
                raise HttpError(400, f"unsupported commit operation {key!r}")
        oid = self.new_commit(r, rev, changes, summary)
        self.commits.append(Commit(repo, rev, summary, tuple(changes)))
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid,
                     "success": True, "pullRequestUrl": None}

    def resolve(self, h: _Handler, repo: str, rev: str, path: str) -> tuple[int, bytes]:
        r = self.repo(repo, h.auth)
        sha = self.commit_of(r, rev)
        entry = r.trees[sha].get(path)
        if entry is None:
            raise HttpError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": sha})
        h.extra_headers = {"X-Repo-Commit": sha, "ETag": f'"{entry.sha256 if entry.lfs else entry.blob_id}"'}
        if entry.lfs:
            h.extra_headers.update({"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)})
        return 200, (self.blobs / entry.sha256).read_bytes()


class _Handler(BaseHTTPRequestHandler):
    """One request: route it, apply a failure rule if one matches, answer JSON or bytes."""

    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def do_GET(self):
        self.dispatch("GET")

    def do_HEAD(self):
        self.dispatch("HEAD")

    def do_POST(self):
        self.dispatch("POST")

    def do_PUT(self):
        self.dispatch("PUT")

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    @property
    def auth(self) -> str | None:
        return self.headers.get("Authorization")

    def body(self) -> bytes:
        if getattr(self, "_body", None) is None:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                self._body = b"".join(chunks)
            else:
                self._body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return self._body

    def json_body(self) -> dict:
        return json.loads(self.body() or b"{}")

    def dispatch(self, method: str) -> None:
        hub: HubServer = self.server.hub
        split = urlsplit(self.path)
        self.query, self.extra_headers, self._body = split.query, {}, None
        rule = hub.take_rule(method, split.path)
        if rule is not None and rule.action == "drop":
            self.body()
            self.close_connection = True
            return
        try:
            if rule is not None and rule.action != "lose":
                message = "Invalid credentials in Authorization header" if rule.action == 401 else "injected"
                raise HttpError(int(rule.action), message)
            for methods, pattern, name in ROUTES:
                match = re.fullmatch(pattern, split.path)
                if method in methods.split() and match:
                    args = {k: unquote(v) if v else v for k, v in match.groupdict().items()}
                    with hub._lock:
                        status, payload = getattr(hub, name)(self, **args)
                    break
            else:
                hub.unrouted.append((method, split.path))
                raise HttpError(404, f"no route for {method} {split.path}")
        except HttpError as e:
            self.extra_headers.update(e.headers)
            if e.code:
                self.extra_headers["X-Error-Code"] = e.code
            self.extra_headers["X-Error-Message"] = e.message
            status, payload = e.status, {"error": e.message, **e.extra}
        self.body()  # drain what the route did not read, so the connection stays usable
        if rule is not None and rule.action == "lose":  # done, but the answer never arrives
            self.close_connection = True
            return
        self.answer(method, status, payload)

    def answer(self, method: str, status: int, payload) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if isinstance(payload, bytes)
                         else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in self.extra_headers.items():
            self.send_header(key, value)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)
