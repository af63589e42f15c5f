"""The webhook over real HTTP (an in-process receiver on a free loopback port): status codes, limits, token,
hostile bodies (hypothesis) -> a 4xx and nothing stored, never a crash or a 5xx; escaping on the page."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diag.triage.lifecycle import Policy
from diag.triage.server import Receiver, ReceiverConfig
from diag.triage.store import connect
from tests.triage.helpers import FIXTURE, alert, body

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("webhook") / "t.db"
    rx = Receiver(ReceiverConfig(host="127.0.0.1", port=0, db=db, policy=Policy(hold_down_s=1), max_body_bytes=64 * 1024))
    import threading

    t = threading.Thread(target=rx.serve_forever, daemon=True)
    t.start()
    yield rx
    rx.close()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10.0) as c:
        yield c


def stored(server) -> tuple[int, ...]:
    db = connect(server.config.db)
    try:
        return tuple(db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("incidents", "alerts", "events", "outbox"))
    finally:
        db.close()


def post(client, raw: bytes, ctype: str = "application/json", **headers: str) -> httpx.Response:
    return client.post("/webhook", content=raw, headers={"Content-Type": ctype, **headers})


def test_real_body_recorded_once_then_duplicate(server, client):
    r1 = post(client, FIXTURE.read_bytes())
    r2 = post(client, FIXTURE.read_bytes())
    assert (r1.status_code, r1.json()["outcomes"]) == (200, ["opened"])
    assert (r2.status_code, r2.json()["outcomes"]) == (200, ["duplicate"])
    incidents = client.get("/api/incidents").json()
    assert [i["title"] for i in incidents if "burning error budget" in i["title"]]


@pytest.mark.parametrize("severity", ["page", "ticket"])
def test_each_generated_route_is_served_and_keeps_its_severity(client, severity):
    """The generator's routes post to /webhook/<severity>: an alert with no severity label keeps the route's."""
    from alerts.receiver_routes import SEVERITY_PATHS

    raw = json.dumps(body(alert({"alertname": f"NoSeverity{severity}", "job": "j"}))).encode()
    r = client.post(SEVERITY_PATHS[severity], content=raw, headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()["outcomes"]) == (200, ["opened"])
    mine = [i for i in client.get("/api/incidents").json() if i["title"].startswith(f"alertname=NoSeverity{severity}")]
    assert [i["severity"] for i in mine] == [severity]


def test_unknown_fields_tolerated(client):
    doc = json.loads(FIXTURE.read_bytes())
    doc["notification_reason"] = "first notification"
    doc["routeLabels"] = {"team": "llm"}
    doc["alerts"][0]["somethingNew"] = {"nested": [1, 2]}
    assert post(client, json.dumps(doc).encode()).status_code == 200


@pytest.mark.parametrize(
    ("raw", "ctype", "status", "says"),
    [
        (b"{", "application/json", 400, "not JSON"),
        (b"[]", "application/json", 400, "JSON object"),
        (b'{"version": "3"}', "application/json", 400, "version"),
        (json.dumps({**body(alert({"a": "b"})), "alerts": []}).encode(), "application/json", 400, "non-empty"),
        (b"\xff\xfe", "application/json", 400, "UTF-8"),
        (b'{"version": "4", "version": "4"}', "application/json", 400, "duplicate key"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 413, "exceeds"),
        (b"{}", "text/plain", 415, "application/json"),
    ],
)
def test_bad_requests_are_4xx_with_a_reason_and_store_nothing(server, client, raw, ctype, status, says):
    before = stored(server)
    r = post(client, raw, ctype)
    assert r.status_code == status and says in r.json()["error"]
    assert stored(server) == before


def test_field_errors_name_the_field(client):
    doc = body(alert({"alertname": "X"}))
    doc["alerts"][0]["startsAt"] = "yesterday"
    assert "alerts[0].startsAt" in post(client, json.dumps(doc).encode()).json()["error"]
    doc = body(alert({"alertname": "X"}))
    doc["alerts"][0]["labels"]["bad-name"] = "x"
    assert "invalid label name" in post(client, json.dumps(doc).encode()).json()["error"]


def read_all(s: socket.socket) -> bytes:
    chunks = []
    while chunk := s.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def test_truncated_body_and_missing_length(server):
    before = stored(server)
    raw = FIXTURE.read_bytes()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw[: len(raw) // 2])  # fmt: skip
        s.shutdown(socket.SHUT_WR)
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 400") and b"truncated" in reply
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(
            b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        )
        assert read_all(s).startswith(b"HTTP/1.1 411")
    assert stored(server) == before


def test_bearer_token_from_environment(tmp_path):
    import threading

    rx = Receiver(ReceiverConfig(host="127.0.0.1", port=0, db=tmp_path / "t.db", token=TOKEN))
    threading.Thread(target=rx.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{rx.port}/webhook"
        raw = FIXTURE.read_bytes()
        h = {"Content-Type": "application/json"}
        assert httpx.post(url, content=raw, headers=h).status_code == 401
        assert httpx.post(url, content=raw, headers={**h, "Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(url, content=raw, headers={**h, "Authorization": f"Bearer {TOKEN}"}).status_code == 200
    finally:
        rx.close()


def test_other_methods_and_paths(client):
    assert client.put("/webhook").status_code == 405
    nope = client.post("/nope", json={})
    assert nope.status_code == 404 and "/webhook/page" in nope.json()["error"]
    assert client.post("/page", json={}).status_code == 404  # the old generator's path is not silently accepted
    assert client.get("/incidents/999999").status_code == 404


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=30))
json_value = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=20
)


def _labels_ok(v: object, *, names: bool = True, empty_ok: bool = True) -> bool:
    import re

    if not isinstance(v, dict) or (not v and not empty_ok):
        return False
    return all(isinstance(val, str) and (not names or re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", k)) for k, val in v.items())


# What a *valid* value of each field looks like (written out here, independently of the parser):
# a mutation that happens to produce one is replaced by a value that is certainly invalid.
VALID = {
    "version": lambda v: v == "4",
    "status": lambda v: v in ("firing", "resolved"),
    "alerts": lambda v: False,  # any replacement of the one valid alert list is wrong (empty, junk, not a list)
    "groupLabels": lambda v: v is None or _labels_ok(v),
    "truncatedAlerts": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "labels": lambda v: _labels_ok(v, empty_ok=False),
    "annotations": lambda v: v is None or _labels_ok(v, names=False),
    "startsAt": lambda v: False,  # replaced only by non-strings or strings with junk appended
    "endsAt": lambda v: False,
    "fingerprint": lambda v: False,  # replaced by non-strings only
}


def _mutations(draw) -> bytes:
    doc = body(alert({"alertname": draw(st.text(min_size=1, max_size=20)), "job": "fuzz"}))
    kind = draw(st.sampled_from(["drop", "retype", "truncate", "garbage", "alert_field"]))
    if kind == "drop":
        doc.pop(draw(st.sampled_from(["version", "status", "alerts", "groupKey"])))
    elif kind == "retype":
        field = draw(st.sampled_from(["version", "status", "alerts", "groupLabels", "truncatedAlerts"]))
        doc[field] = draw(json_value.filter(lambda v: not VALID[field](v)))
    elif kind == "alert_field":
        field = draw(st.sampled_from(["status", "labels", "startsAt", "endsAt", "fingerprint", "annotations"]))
        value = draw(json_value.filter(lambda v: not VALID[field](v)))
        if field in ("startsAt", "endsAt") and isinstance(value, str):
            value = doc["alerts"][0][field] + "x" + value
        if field == "fingerprint" and isinstance(value, str):
            value = value + "-not-hex"
        doc["alerts"][0][field] = value
    raw = json.dumps(doc).encode()
    if kind == "truncate":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif kind == "garbage":
        raw = draw(st.binary(max_size=200))
    return raw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_hostile_bodies_get_4xx_and_store_nothing(server, client, data):
    raw = data.draw(st.composite(lambda draw: _mutations(draw))())
    before = stored(server)
    r = post(client, raw)
    assert 400 <= r.status_code < 500, (r.status_code, r.text, raw[:200])
    assert "error" in r.json()
    assert stored(server) == before
    assert client.get("/healthz").status_code == 200


def test_label_values_with_html_are_escaped(server, client):
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)>\"'"
    doc = body(alert({"alertname": "XSS", "job": evil, "instance": "i"}, summary=f"sum {evil}"))
    doc["alerts"][0]["generatorURL"] = "javascript:alert(3)"
    assert post(client, json.dumps(doc).encode()).status_code == 200
    listing = client.get("/")
    incident_id = next(i["id"] for i in client.get("/api/incidents").json() if i["title"].startswith("sum"))
    page = client.get(f"/incidents/{incident_id}")
    for r in (listing, page):
        assert r.status_code == 200 and "script-src" not in r.headers["Content-Security-Policy"]
        assert "<script>" not in r.text and "<img" not in r.text and "javascript:" not in r.text.split("<h2>Diagnosis")[0]
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in r.text
    assert 'href="javascript:' not in page.text


def test_store_locked_is_a_503_with_retry_after_and_the_retry_records_it(tmp_path):
    """Transient failure (another process holds the store's write lock past the timeouts): 503, nothing lost."""
    import sqlite3
    import threading

    rx = Receiver(ReceiverConfig(host="127.0.0.1", port=0, db=tmp_path / "t.db"))
    threading.Thread(target=rx.serve_forever, daemon=True).start()
    locker = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    try:
        url = f"http://127.0.0.1:{rx.port}/webhook"
        locker.execute("BEGIN EXCLUSIVE")
        r = httpx.post(url, content=FIXTURE.read_bytes(), headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        locker.execute("ROLLBACK")
        r = httpx.post(url, content=FIXTURE.read_bytes(), headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 200
        db = connect(tmp_path / "t.db")
        assert db.execute("SELECT COUNT(*) FROM incidents").fetchone()[0] == 1
        db.close()
    finally:
        locker.close()
        rx.close()
