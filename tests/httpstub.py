"""A small HTTP server on 127.0.0.1 in a thread, for tests that check what a client sends and does at the wire.

Why not a mock transport: what is under test is the client's own request and its handling of real replies
(headers, status codes, bodies, several requests at once), which only a server sees.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    """A handler that answers JSON and logs nothing."""

    def reply_json(self, status: int, doc: Any, headers: dict[str, str] | None = None, body: bytes | None = None) -> None:
        """``doc`` as JSON (or ``body`` as it is), with ``headers``."""
        out = body if body is not None else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *_args: object) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on a free port of 127.0.0.1 until the block ends; yields the base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
