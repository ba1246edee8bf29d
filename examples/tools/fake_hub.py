"""
A fake Hugging Face Hub on 127.0.0.1, for offline tests of the real clients (huggingface_hub,
diffusers, transformers) behind `HF_ENDPOINT`. It serves the files of local folders as model
repositories and answers the way the Hub does: the same endpoints, headers, status codes,
`X-Error-Code` / `X-Error-Message` headers and messages, gated repositories and tokens, large
files redirected to a separate "CDN" origin, byte ranges for resumed downloads, and, on request,
a download that breaks off halfway.

    hub = FakeHub()
    hub.add_repo("owner/model", "/path/to/saved/pipeline", gated=True)
    hub.add_token("hf_good", accepted=["owner/model"])     # a valid token that accepted the licence
    hub.start()                     # then HF_ENDPOINT=hub.endpoint (and a fresh HF_HOME)
    ...
    hub.log                         # every request: (method, path, has_token, Range header)
    hub.stop()

Endpoints (as huggingface_hub 1.x–2.x calls them; file_download.py, _snapshot_download.py,
hf_api.py):
  GET  /api/models/{repo}[/revision/{rev}]     model info: sha, siblings, gated
  GET  /api/models/{repo}/tree/{rev}[/{path}]   the file listing (`?recursive=...`), one page
  GET  /api/models/{repo}/auth-check            200, or the gated / not-found answers below
  GET  /api/whoami-v2                           the token's user
  GET  /api/agent-harnesses                     an empty registry (read for the user agent)
  HEAD/GET /{repo}/resolve/{rev}/{filename}     small files: 200 with X-Repo-Commit, ETag (the
                                                git blob id), Content-Length; large ("LFS")
                                                files: 302 to the CDN with X-Linked-Etag (the
                                                sha256) and X-Linked-Size, as the Hub does
  GET  /blob/{sha256} on the CDN origin         the bytes, honouring `Range` (206)

How the Hub answers failures (checked against the real Hub; huggingface_hub turns them into
GatedRepoError, RepositoryNotFoundError, EntryNotFoundError, HfHubHTTPError):
  a token the Hub does not know, on any request   401, X-Error-Message: Invalid credentials in
                                                  Authorization header (even on public repos)
  an unknown repository                           401 without a token, 404 with one;
                                                  X-Error-Code: RepoNotFound
  a gated repository's files, no token            401, X-Error-Code: GatedRepo
  ... with a token that did not accept the licence  403, X-Error-Code: GatedRepo
  a file the repository does not have             404, X-Error-Code: EntryNotFound
A gated repository's info and file listing are public, as on the Hub; its files are not.

Used by test_vgrpo.py ("The Hub as a first run meets it"); only the standard library.
"""
from __future__ import annotations

import hashlib
import http.server
import json
import socket
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".onnx", ".gguf")   # the Hub's .gitattributes


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released): `HF_ENDPOINT` for "no network"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _File:
    """One file of a repository: its bytes and the ids the Hub derives from them."""

    def __init__(self, data: bytes, name: str):
        self.data, self.size = data, len(data)
        self.oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()   # git's blob id
        self.lfs = name.endswith(LFS_SUFFIXES)
        self.sha256 = hashlib.sha256(data).hexdigest() if self.lfs else None


class _Repo:
    def __init__(self, repo_id: str, folder: str | Path, gated: bool):
        root = Path(folder)
        self.id, self.gated = repo_id, gated
        self.files = {p.relative_to(root).as_posix(): _File(p.read_bytes(), p.name)
                      for p in sorted(root.rglob("*")) if p.is_file()}
        # the commit: a 40-hex id that changes with the content, as a git commit does
        self.sha = hashlib.sha1("".join(f"{k}{f.oid}" for k, f in self.files.items()).encode()).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[str, _Repo] = {}
        self.tokens: dict[str, set] = {}          # a valid token → the gated repos it accepted
        self.log: list[tuple] = []                # (method, path, has_token, Range) per request
        self._break_off: str | None = None        # a filename whose next download breaks off
        self.down = False                         # the network is down: every connection dropped
        self._servers: list[http.server.ThreadingHTTPServer] = []

    # -- setting it up ----------------------------------------------------------------------------
    def add_repo(self, repo_id: str, folder, gated: bool = False):
        """Serve every file under `folder` as the model repository `repo_id` (revision main)."""
        self.repos[repo_id] = _Repo(repo_id, folder, gated)

    def add_token(self, token: str, accepted=()):
        """A token the Hub knows, and the gated repositories whose licence its user accepted."""
        self.tokens[token] = set(accepted)

    def break_off(self, filename: str):
        """The next download of `filename` (a path inside a repository) sends its full
        Content-Length, then half the bytes, then closes the connection; the network then stays
        down (every request dropped, the client's retries included) until `restore()`."""
        self._break_off = filename

    def restore(self):
        self.down, self._break_off = False, None

    def requests(self, method: str = None, contains: str = "") -> list:
        """The logged requests, optionally of one method and whose path contains `contains`."""
        return [r for r in self.log if (method is None or r[0] == method) and contains in r[1]]

    # -- the servers ------------------------------------------------------------------------------
    def start(self) -> "FakeHub":
        """Two threaded servers on 127.0.0.1: the Hub and its CDN (another origin, so that the
        client drops the Authorization header on the redirect, as it does for the real CDN)."""
        for role in ("hub", "cdn"):
            handler = type(f"_{role}", (_Handler,), {"hub": self, "role": role})
            srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                             daemon=True).start()
            self._servers.append(srv)
        return self

    def stop(self):
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
        self._servers = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"                 # keep-alive, as the clients' connection pools expect
    timeout = 30                                  # an idle kept-alive connection ends its thread
    hub: FakeHub
    role: str

    def log_message(self, *args):                 # quiet: the requests are in hub.log
        pass

    # -- answers ----------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict = None, length: int = None):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, headers: dict = None):
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, message: str, code: str = None, headers: dict = None):
        """An error as the Hub sends it: the message in X-Error-Message and in the JSON body."""
        h = {"Content-Type": "application/json", "X-Error-Message": message, **(headers or {})}
        if code:
            h["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), h)

    def _drop(self):
        """The network is down: close the connection without an answer."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- routing ----------------------------------------------------------------------------------
    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def _route(self):
        hub = self.hub
        path = unquote(urlsplit(self.path).path)
        auth = self.headers.get("Authorization", "")
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
        hub.log.append((self.command, path, token is not None, self.headers.get("Range")))
        if hub.down:
            return self._drop()
        if self.role == "cdn":
            return self._cdn(path)
        if token is not None and token not in hub.tokens:
            return self._error(401, "Invalid credentials in Authorization header")
        parts = path.strip("/").split("/")
        if path == "/api/agent-harnesses":      # huggingface_hub ≥ 2 reads it for its user agent
            return self._json({"standardEnvVars": [], "harnesses": {}})
        if path == "/api/whoami-v2":
            if token is None:
                return self._error(401, "Invalid credentials in Authorization header")
            return self._json({"type": "user", "name": "tester", "auth": {"type": "access_token"}})
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = self._repo("/".join(parts[2:4]), token)
            if repo is None:
                return
            rest = parts[4:]
            if rest == ["auth-check"]:
                return self._gate(repo, token) and self._json({})
            if rest[:1] == ["revision"] and len(rest) == 2 and self._revision(repo, rest[1]):
                return self._json(self._info(repo))
            if not rest:
                return self._json(self._info(repo))
            if rest[:1] == ["tree"] and len(rest) >= 2 and self._revision(repo, rest[1]):
                recursive = "recursive=true" in urlsplit(self.path).query.lower()
                return self._tree(repo, "/".join(rest[2:]), recursive)
            return self._error(404, "Sorry, we can't find the page you are looking for.")
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo("/".join(parts[:2]), token)
            if repo is None or not self._revision(repo, parts[3]) or not self._gate(repo, token):
                return
            return self._resolve(repo, "/".join(parts[4:]))
        return self._error(404, "Sorry, we can't find the page you are looking for.")

    def _repo(self, repo_id: str, token):
        repo = self.hub.repos.get(repo_id)
        if repo is None:      # the Hub hides whether a private repo exists: 401 without a token
            self._error(404 if token else 401, "Repository not found", "RepoNotFound")
        return repo

    def _revision(self, repo: _Repo, rev: str) -> bool:
        if rev in ("main", repo.sha):
            return True
        self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return False

    def _gate(self, repo: _Repo, token) -> bool:
        """A gated repository's files: the token must belong to a user who accepted the licence."""
        if not repo.gated or repo.id in self.hub.tokens.get(token, ()):
            return True
        if token is None:
            self._error(401, f"Access to model {repo.id} is restricted. You must have access to it "
                             f"and be authenticated to access it. Please log in.", "GatedRepo")
        else:
            self._error(403, f"Access to model {repo.id} is restricted and you are not in the "
                             f"authorized list. Visit https://huggingface.co/{repo.id} to ask for "
                             f"access.", "GatedRepo")
        return False

    # -- the answers that succeed -----------------------------------------------------------------
    def _info(self, repo: _Repo) -> dict:
        return {"id": repo.id, "modelId": repo.id, "author": repo.id.split("/")[0], "sha": repo.sha,
                "private": False, "gated": "manual" if repo.gated else False, "disabled": False,
                "tags": [], "siblings": [{"rfilename": k} for k in repo.files]}

    def _tree(self, repo: _Repo, under: str, recursive: bool):
        """The listing under a folder (all of it with `recursive`): one page, so no `Link`
        header; a folder the repository does not have is 404 EntryNotFound."""
        prefix = under + "/" if under else ""
        files = {k: f for k, f in repo.files.items() if k.startswith(prefix)}
        if under and not files:
            return self._error(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": repo.sha})
        folders = {p for k in files for p in map(str, Path(k).parents) if p.startswith(prefix) and p != "."}
        if not recursive:      # direct children only
            files = {k: f for k, f in files.items() if "/" not in k[len(prefix):]}
            folders = {d for d in folders if "/" not in d[len(prefix):]}
        out = [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
               for d in sorted(folders)]
        for k, f in files.items():
            entry = {"type": "file", "oid": f.oid, "size": f.size, "path": k}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            out.append(entry)
        self._json(out)

    def _resolve(self, repo: _Repo, filename: str):
        f = repo.files.get(filename)
        head = {"X-Repo-Commit": repo.sha}
        if f is None:
            return self._error(404, "Entry not found", "EntryNotFound", head)
        if f.lfs:         # large files live on the CDN: a redirect that carries their metadata
            return self._send(302, b"", {**head, "Location": f"{self.hub.cdn}/blob/{f.sha256}",
                                         "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": f.size,
                                         "ETag": f'"{f.oid}"'})
        self._bytes(f, filename, {**head, "ETag": f'"{f.oid}"'})

    def _cdn(self, path: str):
        name, f = next(((k, f) for r in self.hub.repos.values() for k, f in r.files.items()
                        if f.lfs and path == f"/blob/{f.sha256}"), (None, None))
        if f is None:
            return self._send(404, b"NoSuchKey")
        self._bytes(f, name, {"ETag": f'"{f.sha256}"'})

    def _bytes(self, f: _File, name: str, headers: dict):
        """The file's bytes, from the `Range` start if one is asked (206), or cut off halfway."""
        start, status = 0, 200
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
            start, status = int(rng[6:].split("-")[0]), 206
            headers = {**headers, "Content-Range": f"bytes {start}-{f.size - 1}/{f.size}"}
        body = f.data[start:]
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", **headers}
        if self.command == "GET" and self.hub._break_off == name:
            self.hub._break_off, self.hub.down = None, True
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            return self._drop()
        self._send(status, body, headers)
