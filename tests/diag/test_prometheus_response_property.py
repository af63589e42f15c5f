"""Prometheus API replies in shapes a real server never sends (a proxy's error page, a truncated body, another
service on the port, a hostile endpoint): ``load_prometheus`` gives a Timeline or one ``ValueError`` naming the
server, never another exception or a hang.

The hostile replies come from a local HTTP server started by the test on 127.0.0.1 (a real Prometheus cannot be
made to send them: this is the one place the wire is played by the test). Well-formed replies are covered against
a real Prometheus in test_prometheus_loader.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diag.sources.prometheus import _parse_matrix, load_prometheus

_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e400", "12.5", "0x10", "", "\x00"]),
)  # fmt: skip
_json = st.recursive(
    _scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=25
)
_pair = st.one_of(st.tuples(st.floats(0, 2e9) | _scalar, _scalar).map(list), _json)
_item = st.one_of(
    st.fixed_dictionaries({"metric": st.dictionaries(st.text(max_size=8), _scalar, max_size=3) | _json,
                           "values": st.lists(_pair, max_size=6) | _json}),
    _json,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {"resultType": st.sampled_from(["matrix", "vector", 3, None]), "result": st.lists(_item, max_size=5) | _json}
    )
)
def test_parse_matrix_keeps_only_well_formed_series(data: dict) -> None:
    for res in _parse_matrix(data):
        assert res.ts.dtype == np.float64 and res.values.dtype == np.float64
        assert res.ts.size == res.values.size > 0
        assert np.isfinite(res.ts).all() and not np.isnan(res.values).any()
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in res.labels.items())


def test_parse_matrix_round_trip() -> None:
    data = {"resultType": "matrix", "result": [
        {"metric": {"__name__": "up", "job": "x"}, "values": [[1.5, "1"], [2.5, "NaN"], [3.5, "+Inf"]]},
        {"metric": {}, "values": [[1, "not a number"]]},  # a bad series is left out, the good one stays
    ]}  # fmt: skip
    (res,) = _parse_matrix(data)
    assert res.labels == {"__name__": "up", "job": "x"}
    assert res.ts.tolist() == [1.5, 3.5] and res.values.tolist() == [1.0, float("inf")]


HOSTILE = {
    "deeply nested": b"[" * 200_000 + b"]" * 200_000,
    "nested object": b'{"status":"success","data":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}",
    "truncated": b'{"status":"success","data":{"resultType":"matrix","result":[{"metric":{},"values":[[1,"',
    "invalid utf-8": b'{"status":"success","data":{"resultType":"matrix","result":[\xff\xfe]}}',
    "NUL bytes": b'{"status":"success",\x00"data":{}}',
    "not JSON": b"<html><body>502 Bad Gateway</body></html>",
    "wrong shapes": json.dumps(
        {
            "status": "success",
            "data": {
                "resultType": "matrix",
                "result": [
                    {"metric": [1, 2], "values": {"a": 1}},
                    7,
                    None,
                    {"values": [[None, None], ["x"], [1e400, "1"]]},
                    {"metric": {"a": "b"}, "values": [[1, "1"], [2, "2"]]},
                ],
            },
        }
    ).encode(),
    "data not an object": b'{"status":"success","data":[1,2,3]}',
    "error without fields": b'{"status":"error"}',
    "huge numbers": b'{"status":"success","data":{"resultType":"matrix","result":[{"metric":{},"values":[[1'
    + b"0" * 5000
    + b',"1'
    + b"9" * 5000
    + b'"]]}]}}',
}


@pytest.fixture(scope="module")
def hostile_server() -> Iterator[tuple[str, dict]]:
    state: dict = {"body": b"", "status": 200}

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            self.send_response(state["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(state["body"])))
            self.end_headers()
            self.wfile.write(state["body"])

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.process
@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.parametrize("status", [200, 500])
def test_hostile_replies_give_a_timeline_or_one_clear_error(hostile_server: tuple[str, dict], name: str, status: int) -> None:
    url, state = hostile_server
    state["body"], state["status"] = HOSTILE[name], status
    try:
        tl = load_prometheus(url, since_s=600, timeout_s=10)
    except ValueError as exc:
        message = str(exc)
        assert url in message and "\n" not in message, message
    else:
        assert status == 200
        assert tl.source.endswith(url) or url in tl.source
