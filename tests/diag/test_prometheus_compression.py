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
from collections.abc import Iterator
from typing import ClassVar

import pytest

from diag.sources.fleet import _LazyPrometheus
from diag.sources.prometheus import _Prometheus
from tests.httpstub import JsonHandler, serving

REPLY = {
    "status": "success",
    "data": {"resultType": "matrix", "result": [{"metric": {"instance": "a:9464"}, "values": [[100, "1.5"], [105, "2.5"]]}]},
}


class _Recording(JsonHandler):
    offered: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        offered = self.headers.get("Accept-Encoding", "")
        self.offered.append(offered)
        if "gzip" in offered:
            self.reply_json(200, None, {"Content-Encoding": "gzip"}, gzip.compress(json.dumps(REPLY).encode()))
        else:
            self.reply_json(200, REPLY)


@pytest.fixture
def server() -> Iterator[str]:
    _Recording.offered = []
    with serving(_Recording) as url:
        yield url


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
