"""A test double for the Hugging Face Hub's HTTP API, so that `--push-to-hub` and `memlm kernels push` are tested with
the real `huggingface_hub` client (and the real `kernels` package) while CI has no network.

`FakeHub` serves, on 127.0.0.1 and a free port, the few endpoints that `HfApi.create_repo`, `HfApi.upload_folder` /
`create_commit` (without Xet: `HF_HUB_DISABLE_XET=1`) and 🤗 Transformers' `push_to_hub` call, for model repositories
and for kernel repositories (repository type "kernel", URLs under `/api/kernels/` and `/kernels/`):

- `POST /api/repos/create`: create a model or kernel repository; 409 with its URL when it exists (what `exist_ok`
  expects);
- `POST /api/validate-yaml`: parse the YAML front matter of a README.md (400 when it is not a mapping);
- `POST /api/{models,kernels}/{repo}/preupload/main`: answer upload mode "regular" for every file (so no LFS or Xet
  upload), with the git blob id of the stored file when there is one (the client then skips unchanged files);
- `POST /api/{models,kernels}/{repo}/commit/main`: the NDJSON commit (a header, then files as base64, or deletions);
- `GET /api/models/{repo}[/revision/main]`: the repository's head commit and files (`create_commit` asks it when
  nothing changed);
- `HEAD` and `GET /{repo}/resolve/main/{path}`: a stored file (how `ModelCard.load` reads README.md), with the
  headers `hf_hub_download` needs, or 404 with `X-Error-Code: EntryNotFound` / `RepoNotFound`.

For kernel repositories also what pushing a version branch and the `kernels` package's download call (`get_kernel`,
`LayerRepository(..., version=N)`: list the refs, list `build/`, `hf_hub_download` / `snapshot_download` at a commit):

- `GET /api/kernels/{repo}[/revision/{revision}]`: the commit a revision (main, a branch, a commit id) points at;
- `GET /api/kernels/{repo}/refs`: the branches (main and those created), no tags;
- `POST` and `DELETE /api/kernels/{repo}/branch/{branch}`: create a branch at a revision (409 when it exists), delete
  one (not main);
- `GET /api/kernels/{repo}/tree/{revision}[/{path}]`: the files and folders under a path, recursive or not;
- `HEAD` and `GET /kernels/{repo}/resolve/{revision}/{path}`: a file as committed at that revision;
- `GET /api/organizations/{name}/overview`: a namespace, a trusted kernel publisher only when the test names it
  (`trusted_publishers`), as the `kernels` package checks before downloading.

Committed files are kept in memory (`FakeHub.files(repo_id)`, `FakeHub.files(repo_id, "kernel", revision)`), each
commit with the files it left. Writes need the bearer token given to the server; private repositories are hidden
(404) from requests without it. Anything else (another endpoint or option, an LFS file, a commit to another branch, a
pull request) is answered 501 and recorded in `FakeHub.unhandled`, which a test asserts is empty: the double never
fakes a success it does not implement.
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
REVISION = r"(?P<revision>[^/]+)"
# The repository types served, by the word their API URLs use, and the prefix of their file URLs (as the Hub's).
REPOSITORY_TYPES = {"models": "model", "kernels": "kernel"}
URL_PREFIXES = {"model": "", "kernel": "kernels/"}
EMPTY_COMMIT = "0" * 40


def git_blob_id(content: bytes) -> str:
    """The id git gives a file's content (what the Hub calls a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def repository_key(repo_id: str, repo_type: str = "model") -> str:
    """How the double stores a repository: its id, after "kernels/" for a kernel repository (as the Hub's URLs)."""
    return URL_PREFIXES[repo_type] + repo_id


class FakeHub:
    """The in-memory Hub; use as a context manager (`with FakeHub(token) as hub:` … `hub.endpoint`)."""

    def __init__(self, token: str, trusted_publishers: tuple[str, ...] = ()):
        self.token = token
        self.trusted_publishers = set(trusted_publishers)
        # Per repository (`repository_key`): the files on main, its commits ({"summary", "oid", "paths", "files"}),
        # its branches other than main (name → commit id), and whether it is private.
        self.repositories: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, list[dict]] = {}
        self.branches: dict[str, dict[str, str]] = {}
        self.private: dict[str, bool] = {}
        self.requests: list[str] = []
        self.unhandled: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> dict[str, bytes]:
        """Path → content of the files of `repo_id` at `revision` (main, a branch or a commit id; a copy)."""
        with self.lock:
            commit = self.resolve(repository_key(repo_id, repo_type), revision)
            if commit is None:
                raise KeyError(f"{repo_type} repository {repo_id} has no revision {revision!r}")
            return dict(commit[1])

    def head_commit(self, key: str) -> str:
        commits = self.commits.get(key)
        return commits[-1]["oid"] if commits else EMPTY_COMMIT

    def resolve(self, key: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """The commit id `revision` names in the repository stored as `key`, and the files of that commit."""
        commits = self.commits[key]
        if revision == "main":
            return (commits[-1]["oid"], commits[-1]["files"]) if commits else (EMPTY_COMMIT, {})
        oid = self.branches[key].get(revision, revision)
        return next(((commit["oid"], commit["files"]) for commit in commits if commit["oid"] == oid), None)

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

        # Routing: method, path pattern, handler name. A handler gets the repository as `repository_key` names it
        # (`kind`, "models" or "kernels", is the type in the URL; none for the model-only routes).
        ROUTES = [
            ("POST", r"/api/repos/create", "create_repository"),
            ("POST", r"/api/validate-yaml", "validate_yaml"),
            ("POST", rf"/api/(?P<kind>models|kernels)/{REPOSITORY}/preupload/(?P<revision>[^/]+)", "preupload"),
            ("POST", rf"/api/(?P<kind>models|kernels)/{REPOSITORY}/commit/(?P<revision>[^/]+)", "commit"),
            ("GET", rf"/api/models/{REPOSITORY}(?:/revision/(?P<revision>[^/]+))?", "model_info"),
            ("HEAD", rf"/{REPOSITORY}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", "resolve"),
            ("GET", rf"/{REPOSITORY}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", "resolve"),
            ("GET", rf"/api/(?P<kind>kernels)/{REPOSITORY}(?:/revision/(?P<revision>[^/]+))?", "kernel_info"),
            ("GET", rf"/api/(?P<kind>kernels)/{REPOSITORY}/refs", "refs"),
            ("POST", rf"/api/(?P<kind>kernels)/{REPOSITORY}/branch/(?P<branch>[^/]+)", "create_branch"),
            ("DELETE", rf"/api/(?P<kind>kernels)/{REPOSITORY}/branch/(?P<branch>[^/]+)", "delete_branch"),
            ("GET", rf"/api/(?P<kind>kernels)/{REPOSITORY}/tree/(?P<revision>[^/]+)(?:/(?P<path>.+))?", "tree"),
            ("HEAD", rf"/(?P<kind>kernels)/{REPOSITORY}/resolve/{REVISION}/(?P<path>.+)", "resolve_kernel_file"),
            ("GET", rf"/(?P<kind>kernels)/{REPOSITORY}/resolve/{REVISION}/(?P<path>.+)", "resolve_kernel_file"),
            ("GET", r"/api/organizations/(?P<name>[\w.-]+)/overview", "organization_overview"),
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
                    arguments = match.groupdict()
                    if "kind" in arguments:
                        arguments["repo"] = repository_key(arguments["repo"], REPOSITORY_TYPES[arguments.pop("kind")])
                    try:
                        getattr(self, name)(method, **arguments)
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

        def authenticated(self) -> bool:
            return self.headers.get("Authorization") == f"Bearer {hub.token}"

        def authorized(self) -> bool:
            if self.authenticated():
                return True
            self.error(401, "Invalid credentials in Authorization header")
            return False

        def known_repository(self, repo: str) -> bool:
            """Whether the repository (`repository_key`) exists and the request may see it (a private one needs the
            token); 404 as the Hub answers otherwise."""
            if repo in hub.repositories and (not hub.private[repo] or self.authenticated()):
                return True
            self.error(404, f"Repository {repo} not found", code="RepoNotFound")
            return False

        def main_revision(self, method: str, revision: str) -> bool:
            if revision == "main" and "create_pr" not in self.query:
                return True
            self.unhandled(method, f"revision {revision!r} / pull requests are not implemented")
            return False

        def revision(self, repo: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
            """The commit a revision of a kernel repository names, and its files; 404 RevisionNotFound if none."""
            with hub.lock:
                commit = hub.resolve(repo, revision)
            if commit is None:
                self.error(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
            return commit

        def no_options(self, method: str, allowed: dict[str, set[str]] | None = None) -> bool:
            """Whether the query holds only the `allowed` parameters with allowed values; 501 otherwise."""
            allowed = allowed or {}
            unknown = {
                name: values
                for name, values in self.query.items()
                if name not in allowed or not {value.lower() for value in values} <= allowed[name]
            }
            if unknown:
                self.unhandled(method, f"query options {unknown} are not implemented")
            return not unknown

        # Endpoints.

        def create_repository(self, method):
            if not self.authorized():
                return
            request = json.loads(self.body)
            repo_type = request.get("type", "model")
            known = {"name", "organization", "type", "visibility"}
            if (
                repo_type not in URL_PREFIXES
                or not request.get("organization")
                or not set(request) <= known
                or request.get("visibility", "public") not in ("public", "private")
            ):
                self.unhandled(method, f"only public or private model and kernel repositories under a namespace: "
                                       f"{request}")  # fmt: skip
                return
            repo_id = f"{request['organization']}/{request['name']}"
            key = repository_key(repo_id, repo_type)
            url = f"{hub.endpoint}/{key}"
            with hub.lock:
                exists = key in hub.repositories
                if not exists:
                    hub.repositories[key], hub.commits[key], hub.branches[key] = {}, [], {}
                    hub.private[key] = request.get("visibility") == "private"
            if exists:
                self.answer(409, {"error": f"You already created this {repo_type} repo", "url": url})
            else:
                self.answer(200, {"url": url, "name": repo_id, "id": repo_id})

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
            with hub.lock:
                stored = dict(hub.repositories[repo])
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
                                          "paths": sorted(added) + sorted(deleted), "files": dict(files)})  # fmt: skip
            self.answer(200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{oid}", "commitOid": oid,
                              "success": True})  # fmt: skip

        def model_info(self, method, repo, revision=None):
            if not (self.known_repository(repo) and self.main_revision(method, revision or "main")):
                return
            if self.query:
                self.unhandled(method, f"model info options {sorted(self.query)} are not implemented")
                return
            with hub.lock:
                siblings = [{"rfilename": path} for path in sorted(hub.repositories[repo])]
            self.answer(200, {"id": repo, "modelId": repo, "sha": hub.head_commit(repo), "private": hub.private[repo],
                              "siblings": siblings})  # fmt: skip

        def resolve(self, method, repo, revision, path):
            if not (self.known_repository(repo) and self.main_revision(method, revision)):
                return
            with hub.lock:
                commit = hub.resolve(repo, "main")
            self.file_at(commit, path)

        def file_at(self, commit: tuple[str, dict[str, bytes]], path: str):
            """A file of a commit, with the headers `hf_hub_download` reads (no redirect, no LFS, no Xet)."""
            oid, files = commit
            headers = {"X-Repo-Commit": oid}
            if path not in files:
                self.error(404, f"Entry not found: {path}", code="EntryNotFound", headers=headers)
                return
            content = files[path]
            headers.update({"ETag": f'"{git_blob_id(content)}"', "Content-Type": "application/octet-stream"})
            self.answer(200, headers=headers, body=content)

        # Kernel repositories: revisions, branches, trees.

        def kernel_info(self, method, repo, revision=None):
            if not (self.known_repository(repo) and self.no_options(method)):
                return
            if commit := self.revision(repo, revision or "main"):
                repo_id = repo.removeprefix(URL_PREFIXES["kernel"])
                self.answer(200, {"id": repo_id, "author": repo_id.split("/")[0], "sha": commit[0],
                                  "private": hub.private[repo]})  # fmt: skip

        def refs(self, method, repo):
            if not (self.known_repository(repo) and self.no_options(method)):
                return
            with hub.lock:
                branches = {"main": hub.head_commit(repo), **hub.branches[repo]}
            self.answer(200, {"branches": [{"name": name, "ref": f"refs/heads/{name}", "targetCommit": oid}
                                           for name, oid in sorted(branches.items())],
                              "converts": [], "tags": []})  # fmt: skip

        def create_branch(self, method, repo, branch):
            if not (self.authorized() and self.known_repository(repo)):
                return
            request = json.loads(self.body or b"{}")
            if not set(request) <= {"startingPoint"}:
                self.unhandled(method, f"branch options {sorted(request)} are not implemented")
                return
            if not (commit := self.revision(repo, request.get("startingPoint", "main"))):
                return
            with hub.lock:
                exists = branch == "main" or branch in hub.branches[repo]
                if not exists:
                    hub.branches[repo][branch] = commit[0]
            if exists:
                self.error(409, f"Reference refs/heads/{branch} already exists")
            else:
                self.answer(200, {})

        def delete_branch(self, method, repo, branch):
            if not (self.authorized() and self.known_repository(repo)):
                return
            if branch == "main":
                self.unhandled(method, "deleting main is not implemented")
                return
            with hub.lock:
                deleted = hub.branches[repo].pop(branch, None)
            if deleted is None:
                self.error(404, f"Invalid rev id: {branch}", code="RevisionNotFound")
            else:
                self.answer(200, {})

        def tree(self, method, repo, revision, path=None):
            options = {"recursive": {"true", "false"}, "expand": {"false"}}
            if not (self.known_repository(repo) and self.no_options(method, options)):
                return
            if not (commit := self.revision(repo, revision)):
                return
            recursive = self.query.get("recursive", ["false"])[0].lower() == "true"
            prefix = f"{path.strip('/')}/" if path else ""
            entries: dict[str, dict] = {}
            for file, content in sorted(commit[1].items()):
                if not file.startswith(prefix):
                    continue
                parts = file[len(prefix) :].split("/")
                # The folders on the way to the file (only the first without `recursive`), then the file itself.
                for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                    folder = prefix + "/".join(parts[:depth])
                    entries.setdefault(folder, {"type": "directory", "path": folder})
                if recursive or len(parts) == 1:
                    entries[file] = {"type": "file", "oid": git_blob_id(content), "size": len(content), "path": file}
            if prefix and not entries:
                self.error(404, f"{path} does not exist on {revision}", code="EntryNotFound")
                return
            for entry in entries.values():
                if entry["type"] == "directory":  # a folder's oid: its files' ids, as a tree's id names its contents
                    inside = sorted(f"{name}:{git_blob_id(content)}" for name, content in commit[1].items()
                                    if name.startswith(entry["path"] + "/"))  # fmt: skip
                    entry["oid"] = hashlib.sha1("\n".join(inside).encode()).hexdigest()
            self.answer(200, sorted(entries.values(), key=lambda entry: entry["path"]))

        def resolve_kernel_file(self, method, repo, revision, path):
            if not (self.known_repository(repo) and self.no_options(method)):
                return
            if commit := self.revision(repo, revision):
                self.file_at(commit, path)

        def organization_overview(self, method, name):
            with hub.lock:
                known = name in hub.trusted_publishers or any(
                    key.removeprefix(URL_PREFIXES["kernel"]).split("/")[0] == name for key in hub.repositories
                )
            if not known:
                self.error(404, f"Organization {name} not found")
                return
            self.answer(200, {"name": name, "fullname": name, "avatarUrl": "",
                              "trustedKernelPublisher": name in hub.trusted_publishers})  # fmt: skip

    return Handler
