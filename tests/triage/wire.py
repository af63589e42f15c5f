"""The base of the tracker stand-ins: a small HTTP/1.1 server on 127.0.0.1 that records every request and can be
told to answer the next ones with an error (an outage, a rate limit), before its subclass speaks the tracker's
documented API. Trackers cannot run on this machine; each subclass names the API and the version it follows.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    method: str
    raw_path: str  # as sent, percent-encoding kept (GitLab project paths must arrive encoded)
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: Any
    at: float = field(default_factory=time.monotonic)


@dataclass
class Answer:
    status: int
    doc: Any = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Fault:
    answer: Answer
    times: int
    when: Callable[[Request], bool]


class WireServer:
    """Subclasses implement ``route(request) -> Answer``; ``requests`` is everything received, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                parts = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
                headers = {k.lower(): v for k, v in self.headers.items()}
                req = Request(self.command, parts.path, parts.path, query, headers, body)
                with server.lock:
                    server.requests.append(req)
                    answer = server._fault(req) or server.route(req)
                raw_out = b"" if answer.status == 204 or answer.doc is None else json.dumps(answer.doc).encode()
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("Content-Length", str(len(raw_out)))
                for k, v in answer.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw_out)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that went away mid-request is not the server's problem

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail(
        self, status: int, *, times: int = 1, headers: dict[str, str] | None = None, doc: Any = None,
        when: Callable[[Request], bool] = lambda r: True,
    ) -> None:  # fmt: skip
        """Answer the next ``times`` matching requests with ``status`` instead of the API's answer."""
        with self.lock:
            self.faults.append(Fault(Answer(status, doc if doc is not None else {"message": "injected"}, headers or {}),
                                     times, when))  # fmt: skip

    def _fault(self, req: Request) -> Answer | None:
        for fault in self.faults:
            if fault.times > 0 and fault.when(req):
                fault.times -= 1
                return fault.answer
        return None

    def route(self, req: Request) -> Answer:
        raise NotImplementedError

    def seen(self, method: str | None = None, path_prefix: str = "") -> list[Request]:
        with self.lock:
            return [r for r in self.requests if (method is None or r.method == method) and r.path.startswith(path_prefix)]

    @staticmethod
    def json_body_required(req: Request) -> Answer | None:
        """What the trackers answer to a write without a JSON body: 415 (Jira, GitHub) or 400."""
        if not req.headers.get("content-type", "").startswith("application/json"):
            return Answer(415, {"message": "Unsupported Media Type"})
        if not isinstance(req.body, dict):
            return Answer(400, {"message": "Problems parsing JSON"})
        return None
