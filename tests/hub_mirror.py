"""A hub mirror on loopback for the tests: the few routes of the Hugging Face hub's HTTP API that
huggingface_hub's snapshot_download uses (repo info, the file tree, HEAD and GET of a file), served
from a folder laid out as <root>/<org>/<name>/<files> (one revision per repository). Pointed at
with HF_ENDPOINT, as a company mirror would be; these machines reach no real hub."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def commit_of(repo: Path) -> str:
    digest = hashlib.sha1()
    for file in sorted(repo.iterdir()):
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


class _Handler(BaseHTTPRequestHandler):
    root: Path

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, value) -> None:
        self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def _not_found(self, head: bool = False) -> None:
        self._send(404, b'{"error": "Repository not found"}',
                   {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"}, head)

    def _route(self, head: bool) -> None:
        parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo = self.root / parts[2] / parts[3]
            if not repo.is_dir():
                return self._not_found()
            files = sorted(f for f in repo.iterdir() if f.is_file())
            if parts[4] == "revision":
                return self._json({"id": f"{parts[2]}/{parts[3]}", "sha": commit_of(repo),
                                   "siblings": [{"rfilename": f.name} for f in files]})
            if parts[4] == "tree":
                return self._json([{"type": "file", "path": f.name, "size": f.stat().st_size,
                                    "oid": hashlib.sha1(f.read_bytes()).hexdigest()} for f in files])
        if len(parts) == 5 and parts[2] == "resolve":
            repo = self.root / parts[0] / parts[1]
            file = repo / parts[4]
            if not file.is_file():
                return self._not_found(head)
            body = file.read_bytes()
            return self._send(200, body, {"X-Repo-Commit": commit_of(repo),
                                          "ETag": f'"{hashlib.sha1(body).hexdigest()}"'}, head)
        self._not_found(head)

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)


class HubMirror:
    """with HubMirror(root) as url: ... (url for HF_ENDPOINT)."""

    def __init__(self, root: Path) -> None:
        handler = type("Handler", (_Handler,), {"root": Path(root)})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
