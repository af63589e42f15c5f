"""The receiver's HTTP server: ``POST /webhook`` for Alertmanager, a read-only page and JSON for people.

Why the standard library's threading server rather than FastAPI/uvicorn (both pinned already):
measured side by side on this workload (``bench/triage.py``), see bench/RESULTS.md "Triage". The
handler is synchronous anyway -- each request waits for its group commit -- so an event loop adds
a thread-pool hop per request and buys nothing.

Status codes are the contract with Alertmanager, which retries 5xx and drops 4xx: every problem
with the request itself is a 4xx (400 malformed, 401 token, 411/413 length, 415 type, 422 cannot
apply), and 503 (with Retry-After) only when the store could not record it *now*.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from diag.triage import lifecycle, payload, web
from diag.triage.diagnosis import DiagnosisWorker, Source
from diag.triage.ingest import Ingestor, Rejected, Unavailable
from diag.triage.outbox import Dispatcher
from diag.triage.sinks import Sink
from diag.triage.store import connect, get_incident, list_incidents

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0  # a client that stops sending mid-body (slowloris) loses its thread after this


@dataclass
class ReceiverConfig:
    host: str = "127.0.0.1"
    port: int = 9095
    db: Path = Path("triage.db")
    policy: lifecycle.Policy = field(default_factory=lifecycle.Policy)
    source: Source | None = None
    token: str = ""
    max_body_bytes: int = payload.MAX_BODY_BYTES
    sinks: dict[str, Sink] = field(default_factory=dict)
    bundle_on: str | None = None
    bundle_dir: Path | None = None
    page_url: str = ""
    lookback_s: float = 1800.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Receiver:
    """Store writer, diagnosis worker, outbox dispatcher and the HTTP server, started and stopped together."""

    def __init__(self, config: ReceiverConfig) -> None:
        self.config = config
        self.diagnosis: DiagnosisWorker | None = None
        self.dispatcher: Dispatcher | None = None
        connect(config.db).close()  # schema first, so the threads below never race to create it
        if config.source is not None:
            self.diagnosis = DiagnosisWorker(
                config.db, config.source, config.policy, lookback_s=config.lookback_s, bundle_on=config.bundle_on,
                bundle_dir=config.bundle_dir,
            )  # fmt: skip
        if config.sinks:
            self.dispatcher = Dispatcher(config.db, config.sinks, page_url=config.page_url)
        self.ingestor = Ingestor(config.db, config.policy, on_commit=self._committed)
        self._local = threading.local()
        self.httpd = _Server((config.host, config.port), _Handler)
        self.httpd.receiver = self

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def _committed(self) -> None:
        if self.diagnosis is not None:
            self.diagnosis.wake()
        if self.dispatcher is not None:
            self.dispatcher.wake()

    def reader(self) -> Any:
        """A per-thread connection for the read-only pages (SQLite connections are not shared across threads)."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = connect(self.config.db)
        return db

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.ingestor.close()
        if self.diagnosis is not None:
            self.diagnosis.close()
        if self.dispatcher is not None:
            self.dispatcher.close()

    def webhook(self, headers: Any, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
        """(status, JSON answer, extra headers) for one delivery whose length was already checked."""
        try:
            note = payload.parse(body)
        except payload.PayloadError as exc:
            return 400, {"error": str(exc)}, {}
        try:
            outcomes = self.ingestor.submit(note)
        except Unavailable as exc:
            return 503, {"error": str(exc)}, {"Retry-After": "5"}
        except Rejected as exc:
            return 422, {"error": str(exc)}, {}
        return 200, {"status": "recorded", "outcomes": outcomes}, {}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    receiver: Receiver


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "llm-diag-triage"
    sys_version = ""
    timeout = REQUEST_TIMEOUT_S
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        if ctype.startswith("text/html"):
            self.send_header("Content-Security-Policy", web.CSP)
            self.send_header("Referrer-Policy", "no-referrer")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, doc: Any, extra: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(doc, default=str).encode(), "application/json", extra)

    def _authorised(self) -> bool:
        token = self.server.receiver.config.token
        if not token:
            return True
        given = self.headers.get("Authorization", "")
        return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), token.encode())

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/webhook":
            self.close_connection = True
            self._json(404, {"error": "not found; Alertmanager should POST to /webhook"})
            return
        if not self._authorised():
            self.close_connection = True
            self._json(401, {"error": "missing or wrong bearer token"}, {"WWW-Authenticate": "Bearer"})
            return
        ctype = self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            self.close_connection = True
            self._json(415, {"error": f"Content-Type {ctype or '(none)'}: application/json expected"})
            return
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._json(411, {"error": "chunked bodies are not accepted; send Content-Length"})
            return
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.strip().isdigit():
            self.close_connection = True
            self._json(411 if raw is None else 400, {"error": "a valid Content-Length is required"})
            return
        length = int(raw)
        limit = self.server.receiver.config.max_body_bytes
        if length > limit:
            self.close_connection = True  # the unread body must not be parsed as the next request
            self._json(413, {"error": f"body of {length} bytes exceeds the limit of {limit}"})
            return
        body = self.rfile.read(length)
        if len(body) < length:
            self.close_connection = True
            self._json(400, {"error": f"truncated body: {len(body)} of {length} bytes"})
            return
        status, doc, extra = self.server.receiver.webhook(self.headers, body)
        self._json(status, doc, extra)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        receiver = self.server.receiver
        db = receiver.reader()
        if path in ("/", "/incidents"):
            self._send(200, web.render_list(db).encode(), "text/html; charset=utf-8")
            return
        if path == "/healthz":
            self._json(200, {"status": "ok"})
            return
        if path == "/favicon.ico":
            self._send(204, b"", "image/x-icon")
            return
        if path == "/api/incidents":
            self._json(200, list_incidents(db))
            return
        m = re.fullmatch(r"/(api/)?incidents/(\d{1,12})", path)
        if m:
            incident_id = int(m.group(2))
            if m.group(1):
                view = get_incident(db, incident_id)
                self._json(*(200, view.to_dict()) if view else (404, {"error": f"no incident {incident_id}"}))
                return
            html = web.render_incident(db, incident_id)
            if html is not None:
                self._send(200, html.encode(), "text/html; charset=utf-8")
                return
        self._send(404, b"not found\n", "text/plain; charset=utf-8")

    do_HEAD = do_GET

    def _refuse(self) -> None:
        self.close_connection = True
        self._json(405, {"error": f"{self.command} not allowed"}, {"Allow": "GET, HEAD, POST"})

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse
