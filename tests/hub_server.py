"""A Hugging Face Hub on loopback: the part of its HTTP API that `huggingface_hub` uses to list a
repository and download its files (the tree API, `resolve` with a redirect to a content server,
ETag and checksum headers, ranged GETs), serving files the tests make. Repositories are
{"owner/name": {"path": bytes}}; `gated` ones refuse downloads without `token`; faults a test can pick: `corrupt`
(bytes that do not match the checksum), `stall_at` (stop sending after that many bytes of a file
until `release` is set; `stalled` is set when it happens), `sizes` (a size to advertise for a file
instead of its own), `commit` and `etag` (the version and checksum to name), `listing` (the bytes to
answer any listing with, or a function of the page's address giving (bytes, the next page's
address)), `move` ((after how many files served, the repositories then, the new commit): a
repository that moves to a new version in the middle of a pull). Every GET's Range is kept in `ranges`, and the
file of every HEAD in `heads`. The search (`/api/models?search=`) finds the repositories with a GGUF
file whose name holds the text, most `downloads` (a count a repository) first, as the Hub orders them,
and answers `found` instead when a test sets it."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import json
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        import socket

        # (headers and body go in two writes: without this, each answer on a kept connection waits
        # for the client's delayed acknowledgement, 40 ms)
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_HEAD(self) -> None:
        self.route(head=True)

    def do_GET(self) -> None:
        self.route(head=False)

    def route(self, head: bool) -> None:
        server = self.server
        path = unquote(urlsplit(self.path).path)
        parts = path.strip("/").split("/")
        if parts == ["api", "models"]:
            return self.search(parse_qs(urlsplit(self.path).query))
        if parts[:2] == ["api", "models"] and "revision" in parts:
            repo = "/".join(parts[2:parts.index("revision")])
            if repo not in server.repos:
                return self.send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            return self.send(200, json.dumps({"id": repo, "sha": server.commit}).encode(),
                             {"Content-Type": "application/json"})
        if parts[:2] == ["api", "models"] and "tree" in parts and callable(server.listing):
            body, following = server.listing(self.path)
            return self.send(200, body, {"Content-Type": "application/json",
                                         **({"Link": f'<{server.url}{following}>; rel="next"'} if following else {})})
        if parts[:2] == ["api", "models"] and "tree" in parts and server.listing is not None:
            return self.send(200, server.listing, {"Content-Type": "application/json"})
        if parts[:2] == ["api", "models"] and "tree" in parts:
            repo = "/".join(parts[2:parts.index("tree")])
            files = server.repos.get(repo)
            if files is None:
                return self.send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            listing = [{"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": server.sizes.get(name, len(data)),
                        "path": name,
                        **({"lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}}
                           if name.endswith(".gguf") else {})}
                       for name, data in files.items()]
            return self.send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"})
        if parts[:1] == ["cdn"]:
            return self.content(parts[1], head)
        if "resolve" in parts:
            at = parts.index("resolve")
            repo, name = "/".join(parts[:at]), "/".join(parts[at + 2:])
            files = server.repos.get(repo)
            if files is None:
                return self.send(404, b"{}", {"X-Error-Code": "RepoNotFound"})
            if repo in server.gated and self.headers.get("Authorization") != f"Bearer {server.token}":
                return self.send(401, b'{"error": "Access to model is restricted"}', {"X-Error-Code": "GatedRepo"})
            if name not in files:
                return self.send(404, b"{}", {"X-Error-Code": "EntryNotFound"})
            data = files[name]
            if head:
                server.heads.append(name)
            if server.move is not None and head and len(server.heads) > server.move[0]:
                server.repos, server.commit = server.move[1], server.move[2]
                files = server.repos[repo]
                data = files.get(name, data)
            digest = hashlib.sha256(data).hexdigest()
            server.blobs[digest] = data
            headers = {"X-Repo-Commit": server.commit, "X-Linked-Etag": server.etag or f'"{digest}"',
                       "X-Linked-Size": str(server.sizes.get(name, len(data))),
                       "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                       "Location": f"http://localhost:{server.server_address[1]}/cdn/{digest}"}  # another host: a CDN
            return self.send(302, b"", headers, head=head)
        self.send(404, b"{}")

    def content(self, digest: str, head: bool) -> None:
        server = self.server
        data = server.blobs.get(digest)
        if data is None:
            return self.send(404, b"{}")
        if server.corrupt:
            data = bytes([data[0] ^ 1]) + data[1:] if len(data) < 8 else data[:-1] + bytes([data[-1] ^ 1])
        start = 0
        given = self.headers.get("Range")
        if not head:
            server.ranges.append(given)
        if given and given.startswith("bytes="):
            start = int(given[6:].split("-")[0] or 0)
        body = data[start:]
        headers = {"Accept-Ranges": "bytes", "ETag": f'"{digest}"'}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self.send_response(206 if start else 200)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        stall = server.stall_at
        if stall is not None and start < stall < len(data):
            self.wfile.write(body[: stall - start])
            self.wfile.flush()
            server.stalled.set()
            server.release.wait(60)
            self.close_connection = True
            return
        self.wfile.write(body)

    def search(self, query: dict[str, list[str]]) -> None:
        server = self.server
        server.searches.append(query)
        if server.found is not None:
            return self.send(200, server.found, {"Content-Type": "application/json"})
        text = query.get("search", [""])[0].lower()
        hits = [repo for repo, files in server.repos.items()
                if text in repo.lower() and any(name.endswith(".gguf") for name in files)]
        hits.sort(key=lambda repo: -server.downloads.get(repo, 0))
        hits = hits[:int(query.get("limit", ["1000"])[0])]
        body = [{"id": repo, "downloads": server.downloads.get(repo, 0),
                 "siblings": [{"rfilename": name} for name in server.repos[repo]]} for repo in hits]
        self.send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def send(self, status: int, body: bytes, headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and self.command != "HEAD":  # (a HEAD's answer has no body, whatever it says)
            self.wfile.write(body)


def start_hub(repos: dict[str, dict[str, bytes]]):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    server.daemon_threads = True
    server.repos, server.gated, server.blobs, server.token = repos, set(), {}, "hf_a-good-token"
    server.corrupt, server.stall_at, server.ranges, server.heads = False, None, [], []
    server.sizes, server.commit, server.etag, server.listing, server.move = {}, COMMIT, None, None, None
    server.stalled, server.release = threading.Event(), threading.Event()
    server.downloads, server.searches, server.found = {}, [], None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server
