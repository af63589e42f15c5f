"""A fleet load stops sending at the first refused query and says why, instead of working through the rest.

The fleet's queries run on many threads with a few in flight (``load_fleet``'s ``concurrency``); without a stop,
one refusal -- a store's series limit on the host families, say -- would be raised only after every other
query had had its turn (60-odd of them, seconds each on a large fleet). Checked at the wire: a server on
127.0.0.1 answers the scrape-interval probe, refuses the query for the host families, and answers every other
query after 0.3 s; it counts the requests that reach it after the refusal went out.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs

import pytest

from diag.sources.fleet import load_fleet

pytestmark = pytest.mark.process
END = 1_733_000_000.0
REFUSAL = "the query hit the store's series limit (a test refusal)"


class _Store(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    lock = threading.Lock()
    refused_at: ClassVar[list[float]] = []
    received: ClassVar[list[tuple[float, str]]] = []

    def do_POST(self) -> None:
        form = parse_qs(self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode())
        query = form.get("query", [""])[0]
        with self.lock:
            self.received.append((time.monotonic(), query))
        if self.path.startswith("/api/v1/query_range") and "llmdiag_host_memory" in query:
            with self.lock:
                self.refused_at.append(time.monotonic())
            self._reply(422, {"status": "error", "errorType": "execution", "error": REFUSAL})
            return
        if self.path.startswith("/api/v1/query_range"):
            time.sleep(0.3)
            self._reply(200, {"status": "success", "data": {"resultType": "matrix", "result": []}})
            return
        # the probe of the scrape interval: one series sampled every 5 s
        series = {"metric": {"__name__": "up"}, "values": [[END - 60 + 5 * i, "1"] for i in range(12)]}
        self._reply(200, {"status": "success", "data": {"resultType": "matrix", "result": [series]}})

    def _reply(self, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def store() -> Iterator[str]:
    _Store.refused_at, _Store.received = [], []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_the_first_refusal_is_raised_and_nothing_more_is_sent(store: str, concurrency: int) -> None:
    with pytest.raises(ValueError, match="a test refusal"):
        load_fleet(store, selector='job="llm"', since_s=3600, until=END, step_s=5, concurrency=concurrency)
    (refused_at,) = _Store.refused_at
    after = [q for t, q in _Store.received if t > refused_at]
    # Only what was in flight when the refusal went out may still arrive (each other slot's request takes 0.3 s,
    # so a slot cannot be handed on twice before the refusal is read); without the stop, every query left would.
    assert len(after) <= concurrency, after
    assert len(_Store.received) < 20, len(_Store.received)  # the set is ~70 queries: most were never sent
