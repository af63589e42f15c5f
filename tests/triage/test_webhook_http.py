"""The webhook over real HTTP (an in-process receiver on a free loopback port): status codes, limits, token,
hostile bodies (hypothesis) -> a 4xx and nothing stored, never a crash or a 5xx; escaping on the page; the
``Receiver`` lifecycle (bind early, shutdown from another thread, SIGTERM through the CLI).
The HTTP layer itself under hostile bytes is ``test_http_fuzz.py``."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diag.triage.lifecycle import Policy
from diag.triage.server import Receiver, ReceiverConfig
from diag.triage.store import connect
from tests.triage.helpers import FIXTURE, ReceiverProcess, alert, body

pytestmark = pytest.mark.process

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("webhook") / "t.db"
    rx = Receiver(ReceiverConfig(host="127.0.0.1", port=0, db=db, policy=Policy(hold_down_s=1), max_body_bytes=64 * 1024))
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


def exchange(server, raw: bytes) -> bytes:
    """Send raw bytes, half-close, read the answer until the receiver closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        return read_all(s)


def head(length: int | None = None, *extra: str) -> bytes:
    lines = ["POST /webhook HTTP/1.1", "Host: x", "Content-Type: application/json", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(raw: bytes, size: int = 100) -> bytes:
    parts = [raw[i : i + size] for i in range(0, len(raw), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def test_truncated_body_and_missing_length(server):
    before = stored(server)
    raw = FIXTURE.read_bytes()
    reply = exchange(server, head(len(raw)) + raw[: len(raw) // 2])
    assert reply.startswith(b"HTTP/1.1 400") and b"before the whole body" in reply
    reply = exchange(server, head(None))
    assert reply.startswith(b"HTTP/1.1 411") and b"Content-Length" in reply
    assert stored(server) == before


def test_chunked_body_is_recorded_up_to_the_limit(server):
    """A hop that re-frames the body as chunked loses nothing; past max_body_bytes it is a 413, as with a length."""
    doc = body(alert({"alertname": "ChunkedDelivery", "job": "j"}))
    reply = exchange(server, head(None, "Transfer-Encoding: chunked") + chunked(json.dumps(doc).encode()))
    assert reply.startswith(b"HTTP/1.1 200") and b'"opened"' in reply
    before = stored(server)
    oversized = json.dumps({**doc, "padding": "x" * server.config.max_body_bytes}).encode()
    reply = exchange(server, head(None, "Transfer-Encoding: chunked") + chunked(oversized, 4096))
    assert reply.startswith(b"HTTP/1.1 413") and b"exceeds the limit" in reply
    assert stored(server) == before


def test_bearer_token_from_environment(tmp_path):
    rx = Receiver(ReceiverConfig(host="127.0.0.1", port=0, db=tmp_path / "t.db", token=TOKEN))
    threading.Thread(target=rx.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{rx.port}/webhook"
        raw = FIXTURE.read_bytes()
        h = {"Content-Type": "application/json"}
        missing = httpx.post(url, content=raw, headers=h)
        assert (missing.status_code, missing.headers["WWW-Authenticate"]) == (401, "Bearer")
        assert httpx.post(url, content=raw, headers={**h, "Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(url, content=raw, headers={**h, "Authorization": TOKEN}).status_code == 401  # no scheme
        assert httpx.post(url, content=raw, headers={**h, "Authorization": f"Bearer {TOKEN}"}).status_code == 200
    finally:
        rx.close()


def test_other_methods_and_paths(client):
    put = client.put("/webhook")
    assert (put.status_code, put.headers["Allow"], put.headers["Connection"]) == (405, "GET, HEAD, POST", "close")
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


def deliveries_stored(server) -> int:
    db = connect(server.config.db)
    try:
        row = db.execute("SELECT value FROM stats WHERE name = 'deliveries'").fetchone()
        return int(row[0]) if row else 0
    finally:
        db.close()


def test_the_duplicate_cache_is_keyed_by_route_and_body(server, client):
    """A byte-identical retry on the same route is answered without the store; on another route it is not (the
    route's severity is part of what the store records)."""
    raw = json.dumps(body(alert({"alertname": "CacheKey", "job": "j"}))).encode()
    h = {"Content-Type": "application/json"}
    assert client.post("/webhook", content=raw, headers=h).json()["outcomes"] == ["opened"]
    stored_before = deliveries_stored(server)
    assert client.post("/webhook", content=raw, headers=h).json()["outcomes"] == ["duplicate"]
    assert deliveries_stored(server) == stored_before  # answered from the cache
    assert client.post("/webhook/page", content=raw, headers=h).status_code == 200
    assert deliveries_stored(server) == stored_before + 1  # went to the store


def test_synchronous_webhook_core_for_embedding(server):
    doc = body(alert({"alertname": "SyncCore", "job": "j"}))
    status, reply, extra = server.webhook({}, json.dumps(doc).encode(), "ticket")
    assert (status, reply["outcomes"], extra) == (200, ["opened"], {})
    status, reply, _ = server.webhook({}, b"{", "")
    assert status == 400 and "not JSON" in reply["error"]


def test_every_answer_carries_the_security_headers(client):
    for r in (client.get("/"), client.get("/api/incidents"), client.get("/healthz"), client.post("/nope", json={})):
        assert r.headers["X-Content-Type-Options"] == "nosniff" and r.headers["Cache-Control"] == "no-store"
        assert r.headers["Server"] == "llm-diag-triage"
        assert ("Content-Security-Policy" in r.headers) == r.headers["Content-Type"].startswith("text/html")
    head = client.head("/")
    assert head.status_code == 200 and head.content == b"" and int(head.headers["Content-Length"]) > 0
    icon = client.get("/favicon.ico")
    assert icon.status_code == 204 and "Content-Length" not in icon.headers


def test_port_taken_fails_before_any_thread_starts(server, tmp_path):
    threads = threading.active_count()
    with pytest.raises(OSError):
        Receiver(ReceiverConfig(host="127.0.0.1", port=server.port, db=tmp_path / "t.db"))
    assert threading.active_count() == threads


def wait_until_up(url: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.02)
    raise AssertionError(f"{url} did not come up")


def test_shutdown_from_another_thread_answers_the_request_in_flight_then_returns(tmp_path):
    """A delivery waiting for its commit when shutdown() comes is still answered 200 (Alertmanager need not retry);
    an idle keep-alive connection does not hold the shutdown up; serve_forever returns and the port stops answering."""
    import sqlite3

    rx = Receiver(ReceiverConfig(host="127.0.0.1", port=0, db=tmp_path / "t.db"))
    serving = threading.Thread(target=rx.serve_forever)
    serving.start()
    locker = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    answers: list[int] = []
    try:
        url = f"http://127.0.0.1:{rx.port}"
        wait_until_up(url)
        idle = httpx.Client(timeout=10)
        assert idle.get(f"{url}/healthz").status_code == 200
        locker.execute("BEGIN EXCLUSIVE")  # the delivery below waits for the store
        # Shut down only once the delivery waits for its commit. Not "uvicorn has a task": the /healthz just
        # answered can still be one (its coroutine not yet returned), and a shutdown then refused the POST's connect.
        submitted = threading.Event()
        submit = rx.ingestor.submit_async

        def submit_and_tell(note):
            pending = submit(note)  # queued for the writer, which is held by the lock above
            submitted.set()
            return pending

        rx.ingestor.submit_async = submit_and_tell
        doc = body(alert({"alertname": "InFlightAtShutdown", "job": "j"}))
        poster = threading.Thread(target=lambda: answers.append(httpx.post(f"{url}/webhook", json=doc, timeout=30).status_code))
        poster.start()
        assert submitted.wait(timeout=20), "the delivery never reached the store"
        rx.shutdown()
        serving.join(timeout=0.5)
        assert serving.is_alive() and not answers  # still waiting for that commit
        locker.execute("ROLLBACK")
        released = time.monotonic()
        poster.join(timeout=15)
        serving.join(timeout=15)
        assert answers == [200] and not serving.is_alive() and time.monotonic() - released < 3
        with pytest.raises(httpx.TransportError):
            idle.get(f"{url}/healthz")
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/healthz", timeout=2)
        idle.close()
    finally:
        locker.close()
        rx.close()
        serving.join(timeout=10)


def test_sigterm_stops_diag_triage_serve_cleanly(tmp_path):
    """uvicorn's own signal handlers are not installed: the CLI's SIGTERM handler stops it, exit status 0."""
    proc = ReceiverProcess(tmp_path / "t.db", "--no-diagnosis").start()
    assert proc.post(body(alert({"alertname": "BeforeStop", "job": "j"}))).status_code == 200
    assert proc.proc is not None
    started = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=15) == 0 and time.monotonic() - started < 5
    assert "diag triage: stopped" in proc.log.read_text() and "Traceback" not in proc.log.read_text()


@pytest.mark.slow
def test_store_locked_is_a_503_with_retry_after_and_the_retry_records_it(tmp_path):
    """Transient failure (another process holds the store's write lock past the timeouts): 503, nothing lost."""
    import sqlite3

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


def test_a_receiver_without_a_diagnosis_source_says_so_on_its_incidents(server, client):
    """Built directly (not through the CLI) with no source: incidents read 'not diagnosed', never 'pending' forever."""
    raw = json.dumps(body(alert({"alertname": "NoSourceHere", "job": "j"}))).encode()
    assert post(client, raw).status_code == 200
    (mine,) = [i for i in client.get("/api/incidents").json() if i["title"].startswith("alertname=NoSourceHere")]
    assert mine["diag_state"] == "off"
