"""A Hugging Face hub on localhost for tests (``HF_ENDPOINT=hub.url``): the few routes ``huggingface_hub``'s
``snapshot_download`` uses (a revision's commit, a commit's file listing, each file's metadata and bytes),
served from folders the test registers as commits of a repository, with branches it can move.

No network is needed; the client is the real ``huggingface_hub`` over real HTTP."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class LocalHub:
    """``add(repo_id, commit, folder, branch)`` publishes ``folder``'s files as ``commit`` of ``repo_id`` and
    points ``branch`` at it; ``requests`` lists the paths asked for."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], dict] = {}  # (type, repo id) -> {"refs": {}, "commits": {commit: files}}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo_id: str, commit: str, folder: Path, branch: str = "main", repo_type: str = "model") -> None:
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        repo = self.repos.setdefault((repo_type, repo_id), {"refs": {}, "commits": {}})
        repo["commits"][commit] = files
        repo["refs"][branch] = commit

    def _commit(self, repo: dict, revision: str) -> str | None:
        return repo["refs"].get(revision) or (revision if revision in repo["commits"] else None)

    def _serve(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append(path)
        api = re.fullmatch(r"/api/(models|datasets)/([^/]+/[^/]+)/(revision|tree)/([^/]+)(?:/.*)?", path)
        resolve = re.fullmatch(r"/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if api:
            repo_type, repo_id, what, revision = api.group(1)[:-1], api.group(2), api.group(3), api.group(4)
        elif resolve:
            repo_type = "dataset" if resolve.group(1) else "model"
            repo_id, revision, filename = resolve.group(2), resolve.group(3), resolve.group(4)
        else:
            return self._reply(handler, 404, {"error": "not found"}, body)
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            return self._reply(handler, 404, {"error": "Repository not found"}, body, {"X-Error-Code": "RepoNotFound"})
        commit = self._commit(repo, revision)
        if commit is None:
            return self._reply(handler, 404, {"error": "Invalid rev id"}, body, {"X-Error-Code": "RevisionNotFound"})
        files = repo["commits"][commit]
        if api and what == "revision":
            siblings = [{"rfilename": name} for name in files]
            return self._reply(handler, 200, {"id": repo_id, "sha": commit, "siblings": siblings}, body)
        if api:
            listing = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in files.items()
            ]
            return self._reply(handler, 200, listing, body)
        if filename not in files:
            return self._reply(handler, 404, {"error": "Entry not found"}, body, {"X-Error-Code": "EntryNotFound"})
        data = files[filename]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
        return self._reply(handler, 200, data, body, headers)

    def _reply(self, handler, status: int, payload, body: bool, headers: dict[str, str] | None = None) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        handler.send_response(status)
        for key, value in {**(headers or {}), "Content-Length": str(len(data))}.items():
            handler.send_header(key, value)
        if not isinstance(payload, bytes):
            handler.send_header("Content-Type", "application/json")
        handler.end_headers()
        if body:
            handler.wfile.write(data)
