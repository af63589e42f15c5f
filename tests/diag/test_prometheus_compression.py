"""Replies from a Prometheus on this machine are asked uncompressed; from anywhere else, gzip-compressed.

Why it matters: over loopback gzip only moves CPU time from the wire to the two processes sharing the cores (the
server compressing, this process inflating) -- at 200 fleet targets 398 MiB of JSON a run. Checked at the wire: a
small server on 127.0.0.1 records the ``Accept-Encoding`` of each query and compresses when it is offered gzip, so
the same answer must come back either way. A server elsewhere cannot be started here (loopback only): for it the
client's own headers are checked.
"""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from diag.sources.fleet import _LazyPrometheus
from diag.sources.prometheus import _Prometheus

REPLY = {
    "status": "success",
    "data": {"resultType": "matrix", "result": [{"metric": {"instance": "a:9464"}, "values": [[100, "1.5"], [105, "2.5"]]}]},
}


class _Recording(BaseHTTPRequestHandler):
    offered: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        offered = self.headers.get("Accept-Encoding", "")
        self.offered.append(offered)
        body = json.dumps(REPLY).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if "gzip" in offered:
            body = gzip.compress(body)
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Recording.offered = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recording)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.mark.process
@pytest.mark.parametrize("client", [_Prometheus, _LazyPrometheus])
def test_a_server_on_loopback_is_asked_for_identity_and_answers_the_same(server: str, client: type) -> None:
    prom = client(server, "", 5.0)
    try:
        got = prom.range("up", 100, 105, 5)
    finally:
        prom.close()
    assert _Recording.offered == ["identity"]
    assert [list(r.values) for r in got] == [[1.5, 2.5]] and [list(r.ts) for r in got] == [[100.0, 105.0]]


@pytest.mark.process
def test_a_users_own_accept_encoding_is_kept(server: str) -> None:
    """A header the user gave wins over the default (here gzip, which the server then uses: decoded all the same)."""
    prom = _Prometheus(server, "", 5.0, {"Accept-Encoding": "gzip"})
    try:
        got = prom.range("up", 100, 105, 5)
    finally:
        prom.close()
    assert _Recording.offered == ["gzip"]
    assert [list(r.values) for r in got] == [[1.5, 2.5]]


@pytest.mark.parametrize("url", ["http://localhost:9090", "http://[::1]:9090", "http://127.8.0.1:9090"])
def test_every_loopback_spelling_counts(url: str) -> None:
    prom = _Prometheus(url, "", 5.0)
    try:
        assert prom.http.headers["accept-encoding"] == "identity"
    finally:
        prom.close()


@pytest.mark.parametrize("url", ["http://10.0.0.5:9090", "https://prometheus.example.com", "http://[2001:db8::1]:9090"])
def test_a_server_elsewhere_is_offered_gzip(url: str) -> None:
    prom = _Prometheus(url, "", 5.0)
    try:
        assert "gzip" in prom.http.headers["accept-encoding"]
    finally:
        prom.close()
