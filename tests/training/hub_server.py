"""A test double for the Hugging Face Hub's HTTP API, so that `--push-to-hub` is tested with the real
`huggingface_hub` client while CI has no network.

`FakeHub` serves, on 127.0.0.1 and a free port, the few endpoints that `HfApi.create_repo`, `HfApi.upload_folder` /
`create_commit` (without Xet: `HF_HUB_DISABLE_XET=1`) and 🤗 Transformers' `push_to_hub` call:

- `POST /api/repos/create`: create a model repository; 409 with its URL when it exists (what `exist_ok` expects);
- `POST /api/validate-yaml`: parse the YAML front matter of a README.md (400 when it is not a mapping);
- `POST /api/models/{repo}/preupload/{revision}`: answer upload mode "regular" for every file (so no LFS or Xet
  upload), with the git blob id of the stored file when there is one (the client then skips unchanged files);
- `POST /api/models/{repo}/commit/{revision}`: the NDJSON commit (a header, then files as base64, or deletions);
- `GET /api/models/{repo}[/revision/{revision}]`: the repository's head commit and files (`create_commit` asks it when
  nothing changed);
- `HEAD` and `GET /{repo}/resolve/{revision}/{path}`: a stored file (how `ModelCard.load` reads README.md), with the
  headers `hf_hub_download` needs, or 404 with `X-Error-Code: EntryNotFound` / `RepoNotFound`.

Committed files are kept in memory (`FakeHub.files(repo_id)`). Writes need the bearer token given to the server.
Anything else (another endpoint, an LFS file, another revision, a pull request) is answered 501 and recorded in
`FakeHub.unhandled`, which a test asserts is empty: the double never fakes a success it does not implement.
"""

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

REPOSITORY = r"(?P<repo>[\w.-]+/[\w.-]+)"


def git_blob_id(content: bytes) -> str:
    """The id git gives a file's content (what the Hub calls a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class FakeHub:
    """The in-memory Hub; use as a context manager (`with FakeHub(token) as hub:` … `hub.endpoint`)."""

    def __init__(self, token: str):
        self.token = token
        self.repositories: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, list[dict]] = {}  # per repository: {"summary", "oid", "paths"}
        self.requests: list[str] = []
        self.unhandled: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def files(self, repo_id: str) -> dict[str, bytes]:
        """Path → content of the files committed to `repo_id` (a copy)."""
        with self.lock:
            return dict(self.repositories[repo_id])

    def head_commit(self, repo_id: str) -> str:
        commits = self.commits.get(repo_id)
        return commits[-1]["oid"] if commits else "0" * 40

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exception):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *arguments):  # the test's output stays quiet
            pass

        # Routing: method, path pattern, handler name.
        ROUTES = [
            ("POST", r"/api/repos/create", "create_repository"),
            ("POST", r"/api/validate-yaml", "validate_yaml"),
            ("POST", rf"/api/models/{REPOSITORY}/preupload/(?P<revision>[^/]+)", "preupload"),
            ("POST", rf"/api/models/{REPOSITORY}/commit/(?P<revision>[^/]+)", "commit"),
            ("GET", rf"/api/models/{REPOSITORY}(?:/revision/(?P<revision>[^/]+))?", "model_info"),
            ("HEAD", rf"/{REPOSITORY}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", "resolve"),
            ("GET", rf"/{REPOSITORY}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", "resolve"),
        ]

        def do_GET(self):
            self.route("GET")

        def do_HEAD(self):
            self.route("HEAD")

        def do_POST(self):
            self.route("POST")

        def do_PUT(self):
            self.route("PUT")

        def do_DELETE(self):
            self.route("DELETE")

        def route(self, method: str):
            url = urlsplit(self.path)
            self.query = parse_qs(url.query)
            self.body = self.read_body()
            path = unquote(url.path)
            with hub.lock:
                hub.requests.append(f"{method} {self.path}")
            for route_method, pattern, name in self.ROUTES:
                match = re.fullmatch(pattern, path)
                if route_method == method and match:
                    try:
                        getattr(self, name)(method, **match.groupdict())
                    except Exception as error:  # a bug in the double or a malformed request: loud, never a success
                        self.unhandled(method, f"{type(error).__name__}: {error}", status=500)
                    return
            self.unhandled(method, "no such endpoint in the fake Hub")

        def read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        # Answers.

        def answer(self, status: int, payload=None, headers: dict | None = None, body: bytes | None = None):
            if body is None:
                body = json.dumps(payload).encode() if payload is not None else b""
            self.send_response(status)
            for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def error(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
            extra = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(headers or {})}
            self.answer(status, {"error": message}, headers=extra)

        def unhandled(self, method: str, reason: str, status: int = 501):
            with hub.lock:
                hub.unhandled.append(f"{method} {self.path}: {reason}")
            self.error(status, f"fake Hub: {reason}")

        def authorized(self) -> bool:
            if self.headers.get("Authorization") == f"Bearer {hub.token}":
                return True
            self.error(401, "Invalid credentials in Authorization header")
            return False

        def known_repository(self, repo: str) -> bool:
            if repo in hub.repositories:
                return True
            self.error(404, f"Repository {repo} not found", code="RepoNotFound")
            return False

        def main_revision(self, method: str, revision: str) -> bool:
            if revision == "main" and "create_pr" not in self.query:
                return True
            self.unhandled(method, f"revision {revision!r} / pull requests are not implemented")
            return False

        # Endpoints.

        def create_repository(self, method):
            if not self.authorized():
                return
            request = json.loads(self.body)
            if request.get("type", "model") != "model" or not request.get("organization"):
                self.unhandled(method, f"only model repositories under a namespace are implemented: {request}")
                return
            repo = f"{request['organization']}/{request['name']}"
            url = f"{hub.endpoint}/{repo}"
            with hub.lock:
                exists = repo in hub.repositories
                hub.repositories.setdefault(repo, {})
                hub.commits.setdefault(repo, [])
            if exists:
                self.answer(409, {"error": "You already created this model repo", "url": url})
            else:
                self.answer(200, {"url": url, "name": repo, "id": repo})

        def validate_yaml(self, method):
            content = json.loads(self.body)["content"]
            match = re.match(r"^---\n(.*?)\n---\n", content, flags=re.DOTALL)
            metadata = yaml.safe_load(match.group(1)) if match else {}
            if not isinstance(metadata, dict):
                self.answer(400, {"errors": [{"message": "the metadata is not a YAML mapping"}], "warnings": []})
            else:
                self.answer(200, {"errors": [], "warnings": []})

        def preupload(self, method, repo, revision):
            if not (self.authorized() and self.known_repository(repo) and self.main_revision(method, revision)):
                return
            stored = hub.files(repo)
            files = [
                {"path": file["path"], "uploadMode": "regular", "shouldIgnore": False,
                 "oid": git_blob_id(stored[file["path"]]) if file["path"] in stored else None}
                for file in json.loads(self.body)["files"]
            ]  # fmt: skip
            self.answer(200, {"files": files, "commitOid": hub.head_commit(repo)})

        def commit(self, method, repo, revision):
            if not (self.authorized() and self.known_repository(repo) and self.main_revision(method, revision)):
                return
            if self.headers.get("Content-Type") != "application/x-ndjson":
                self.unhandled(method, f"a commit must be NDJSON, not {self.headers.get('Content-Type')}")
                return
            lines = [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]
            if not lines or lines[0]["key"] != "header":
                self.unhandled(method, "a commit starts with its header")
                return
            added, deleted = {}, []
            for line in lines[1:]:
                key, value = line["key"], line["value"]
                if key == "file" and value.get("encoding") == "base64":
                    added[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    deleted.append(value["path"])
                else:  # lfsFile, deletedFolder, …: never asked for, so never accepted
                    self.unhandled(method, f"commit operation {key!r} is not implemented")
                    return
            with hub.lock:
                files = hub.repositories[repo]
                missing = [path for path in deleted if path not in files]
                if missing:
                    self.error(404, f"A file with this name doesn't exist: {missing}", code="EntryNotFound")
                    return
                files.update(added)
                for path in deleted:
                    del files[path]
                parent = hub.head_commit(repo)
                oid = hashlib.sha1(f"{parent}\n{repo}\n{len(hub.commits[repo])}".encode() + self.body).hexdigest()
                hub.commits[repo].append({"summary": lines[0]["value"]["summary"], "oid": oid,
                                          "paths": sorted(added) + sorted(deleted)})  # fmt: skip
            self.answer(200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{oid}", "commitOid": oid,
                              "success": True})  # fmt: skip

        def model_info(self, method, repo, revision=None):
            if not (self.known_repository(repo) and self.main_revision(method, revision or "main")):
                return
            if self.query:
                self.unhandled(method, f"model info options {sorted(self.query)} are not implemented")
                return
            siblings = [{"rfilename": path} for path in sorted(hub.files(repo))]
            self.answer(200, {"id": repo, "modelId": repo, "sha": hub.head_commit(repo), "private": False,
                              "siblings": siblings})  # fmt: skip

        def resolve(self, method, repo, revision, path):
            if not (self.known_repository(repo) and self.main_revision(method, revision)):
                return
            headers = {"X-Repo-Commit": hub.head_commit(repo)}
            stored = hub.files(repo)
            if path not in stored:
                self.error(404, f"Entry not found: {path}", code="EntryNotFound", headers=headers)
                return
            content = stored[path]
            headers.update({"ETag": f'"{git_blob_id(content)}"', "Content-Type": "application/octet-stream"})
            self.answer(200, headers=headers, body=content)

    return Handler
