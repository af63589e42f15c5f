"""The receiver's HTTP server: ``POST /webhook`` for Alertmanager, a read-only page and JSON for people.

Why a small asyncio HTTP/1.1 server of our own rather than FastAPI/uvicorn (both pinned) or the standard
library's threading server: measured side by side (``bench/triage.py``, bench/RESULTS.md "Triage"), on
a busy 2-core host the threading server spent ~1 ms of CPU per delivery on thread hand-offs and header
parsing and FastAPI (h11 + a thread-pool hop) more, while one event loop handing parsed notifications to
the group-commit writer stays far below that. The protocol surface is tiny -- Content-Length bodies only,
keep-alive, no chunking, no upgrades -- and every limit is explicit: header block size, body size, a
read deadline per request (a client that stops sending loses its connection).

Status codes are the contract with Alertmanager, which retries 5xx and drops 4xx: every problem with the
request itself is a 4xx (400 malformed, 401 token, 411/413 length, 415 type, 422 cannot apply), and 503
(with Retry-After) only when the store could not record it *now*.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from alerts.receiver_routes import route_severity, served_paths
from diag.triage import lifecycle, payload, web
from diag.triage.diagnosis import DiagnosisWorker, Source
from diag.triage.ingest import Ingestor, Rejected, Unavailable
from diag.triage.outbox import Dispatcher
from diag.triage.sinks import Sink
from diag.triage.store import connect, get_incident, list_incidents

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0  # the whole request (headers + body) must arrive within this
IDLE_TIMEOUT_S = 120.0  # a keep-alive connection with no new request is closed after this
MAX_HEADER_BYTES = 16 * 1024
COMMIT_TIMEOUT_S = 10.0
OFFLOAD_PARSE_BYTES = 64 * 1024  # bigger bodies are validated on a thread, so one cannot stall the loop
DIGEST_CACHE = 8192  # recently committed bodies remembered by digest (16 bytes each)


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


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


@dataclass
class Request:
    method: str
    path: str
    version: str
    headers: dict[str, str]  # lower-case names
    body: bytes = b""

    @property
    def keep_alive(self) -> bool:
        conn = self.headers.get("connection", "").lower()
        return "close" not in conn if self.version == "HTTP/1.1" else "keep-alive" in conn


class Receiver:
    """Store writer, diagnosis worker, outbox dispatcher and the HTTP server, started and stopped together."""

    def __init__(self, config: ReceiverConfig) -> None:
        self.config = config
        self.diagnosis: DiagnosisWorker | None = None
        self.dispatcher: Dispatcher | None = None
        connect(config.db).close()  # schema first, so the threads below never race to create it
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((config.host, config.port))  # fails early (port taken) before any thread starts
        self._sock.listen(512)
        if config.source is not None:
            self.diagnosis = DiagnosisWorker(
                config.db, config.source, config.policy, lookback_s=config.lookback_s, bundle_on=config.bundle_on,
                bundle_dir=config.bundle_dir,
            )  # fmt: skip
        if config.sinks:
            self.dispatcher = Dispatcher(config.db, config.sinks, page_url=config.page_url)
        self.ingestor = Ingestor(config.db, config.policy, on_commit=self._committed)
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="triage-page")
        self._local = threading.local()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._stop_requested = False
        self._committed_bodies: dict[bytes, None] = {}  # insertion-ordered: a FIFO of recently committed bodies

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

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

    # ------------------------------------------------------------------ lifecycle

    def serve_forever(self) -> None:
        """Serve until ``shutdown()`` (from any thread or a signal handler)."""
        try:
            asyncio.run(self._serve())
        finally:
            self._stopped.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        if self._stop_requested:
            return
        server = await asyncio.start_server(self._connection, sock=self._sock, limit=MAX_HEADER_BYTES)
        async with server:
            await self._done.wait()
            server.close()

    def shutdown(self) -> None:
        """Stop accepting and return from ``serve_forever`` (thread-safe)."""
        self._stop_requested = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._done.set)

    def close(self) -> None:
        if self._loop is not None:
            self.shutdown()
            self._stopped.wait(timeout=30)
        self._sock.close()
        self.ingestor.close()
        self._readers.shutdown(wait=True, cancel_futures=True)
        if self.diagnosis is not None:
            self.diagnosis.close()
        if self.dispatcher is not None:
            self.dispatcher.close()

    # ------------------------------------------------------------------ HTTP

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request = await self._read_request(reader)
                except HttpError as exc:
                    await self._write(writer, exc.status, {"error": str(exc)}, exc.headers, close=True)
                    return
                if request is None:
                    return
                try:
                    status, doc, ctype, extra = await self._dispatch(request)
                except HttpError as exc:
                    await self._write(writer, exc.status, {"error": str(exc)}, exc.headers, close=True)
                    return
                keep = request.keep_alive and status < 400
                await self._write(writer, status, doc, extra, close=not keep, ctype=ctype, head=request.method == "HEAD")
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            return
        except Exception:  # never let one connection's surprise take the loop down
            log.exception("triage: request failed")
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _read_request(self, reader: asyncio.StreamReader) -> Request | None:
        try:
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            first, _, rest = head.partition(b"\r\n")
            request = self._parse_head(first, rest.split(b"\r\n"))
            if request.method == "POST":
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    request.body = await self._read_body(reader, request.headers)
            return request
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise HttpError(400, "connection closed in the middle of the headers") from None
            return None
        except (ValueError, asyncio.LimitOverrunError):
            raise HttpError(431, f"header block larger than {MAX_HEADER_BYTES} bytes") from None

    @staticmethod
    def _parse_head(first: bytes, lines: list[bytes]) -> Request:
        parts = first.decode("latin-1").strip().split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise HttpError(400, "malformed request line")
        headers: dict[str, str] = {}
        for raw in lines:
            if not raw:
                continue
            name, sep, value = raw.decode("latin-1").partition(":")
            if not sep or not name or name != name.strip():
                raise HttpError(400, "malformed header line")
            key = name.lower()
            if key in headers and key in ("content-length", "transfer-encoding", "authorization", "content-type"):
                raise HttpError(400, f"repeated {name} header")
            headers[key] = value.strip()
        return Request(parts[0], parts[1], parts[2], headers)

    async def _read_body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        if "transfer-encoding" in headers:
            raise HttpError(411, "chunked bodies are not accepted; send Content-Length")
        raw = headers.get("content-length")
        if raw is None:
            raise HttpError(411, "a Content-Length is required")
        if not raw.isdigit() or len(raw) > 12:
            raise HttpError(400, "a valid Content-Length is required")
        length = int(raw)
        if length > self.config.max_body_bytes:
            raise HttpError(413, f"body of {length} bytes exceeds the limit of {self.config.max_body_bytes}")
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise HttpError(400, f"truncated body: {len(exc.partial)} of {length} bytes") from None

    async def _write(
        self, writer: asyncio.StreamWriter, status: int, doc: Any, extra: dict[str, str] | None, *, close: bool,
        ctype: str = "application/json", head: bool = False,
    ) -> None:  # fmt: skip
        raw = doc if isinstance(doc, bytes) else json.dumps(doc, default=str).encode()
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        lines = [
            f"HTTP/1.1 {status} {reason}",
            f"Content-Type: {ctype}",
            f"Content-Length: {len(raw)}",
            "X-Content-Type-Options: nosniff",
            "Cache-Control: no-store",
            "Server: llm-diag-triage",
        ]
        if ctype.startswith("text/html"):
            lines += [f"Content-Security-Policy: {web.CSP}", "Referrer-Policy: no-referrer"]
        lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
        if close:
            lines.append("Connection: close")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else raw))
        await writer.drain()

    async def _dispatch(self, request: Request) -> tuple[int, Any, str, dict[str, str]]:
        path = request.path.split("?", 1)[0]
        if request.method == "POST":
            severity = route_severity(path)
            if severity is None:
                raise HttpError(404, f"not found; Alertmanager should POST to one of {', '.join(served_paths())}")
            status, doc, extra = await self._webhook(request, severity)
            return status, doc, "application/json", extra
        if request.method not in ("GET", "HEAD"):
            raise HttpError(405, f"{request.method} not allowed", {"Allow": "GET, HEAD, POST"})
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._page, path)

    async def _webhook(self, request: Request, route_severity: str = "") -> tuple[int, dict[str, Any], dict[str, str]]:
        token = self.config.token
        if token:
            given = request.headers.get("authorization", "")
            if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), token.encode())):
                raise HttpError(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            raise HttpError(415, f"Content-Type {ctype or '(none)'}: application/json expected")
        digest = hashlib.blake2b(route_severity.encode() + b"\0" + request.body, digest_size=16).digest()
        if digest in self._committed_bodies:
            # byte-identical to a body already committed (a retry, or the other HA peer): applying it again is a
            # no-op by construction (lifecycle idempotence), so it is answered without touching the store
            return 200, {"status": "recorded", "outcomes": ["duplicate"]}, {}
        try:
            if len(request.body) > OFFLOAD_PARSE_BYTES:
                note = await asyncio.get_running_loop().run_in_executor(
                    self._readers, payload.parse, request.body, route_severity
                )
            else:
                note = payload.parse(request.body, route_severity)
        except payload.PayloadError as exc:
            raise HttpError(400, str(exc)) from None
        try:
            async with asyncio.timeout(COMMIT_TIMEOUT_S):
                outcomes = await self.ingestor.submit_async(note)
        except (Unavailable, TimeoutError) as exc:
            return 503, {"error": str(exc) or "not recorded in time; retry"}, {"Retry-After": "5"}
        except Rejected as exc:
            raise HttpError(422, str(exc)) from None
        self._committed_bodies[digest] = None
        if len(self._committed_bodies) > DIGEST_CACHE:
            self._committed_bodies.pop(next(iter(self._committed_bodies)))
        return 200, {"status": "recorded", "outcomes": outcomes}, {}

    def webhook(self, headers: Any, body: bytes, route_severity: str = "") -> tuple[int, dict[str, Any], dict[str, str]]:
        """Synchronous form of the webhook core (length already checked): for embedding in another server."""
        try:
            note = payload.parse(body, route_severity)
        except payload.PayloadError as exc:
            return 400, {"error": str(exc)}, {}
        try:
            outcomes = self.ingestor.submit(note, COMMIT_TIMEOUT_S)
        except Unavailable as exc:
            return 503, {"error": str(exc)}, {"Retry-After": "5"}
        except Rejected as exc:
            return 422, {"error": str(exc)}, {}
        return 200, {"status": "recorded", "outcomes": outcomes}, {}

    def _page(self, path: str) -> tuple[int, Any, str, dict[str, str]]:
        """GET routes, on a reader thread (SQLite reads and template rendering stay off the event loop)."""
        db = self.reader()
        html = "text/html; charset=utf-8"
        if path in ("/", "/incidents"):
            return 200, web.render_list(db).encode(), html, {}
        if path == "/healthz":
            return 200, {"status": "ok"}, "application/json", {}
        if path == "/api/incidents":
            return 200, list_incidents(db), "application/json", {}
        m = re.fullmatch(r"/(api/)?incidents/(\d{1,12})", path)
        if m:
            incident_id = int(m.group(2))
            if m.group(1):
                view = get_incident(db, incident_id)
                if view is not None:
                    return 200, view.to_dict(), "application/json", {}
            else:
                page = web.render_incident(db, incident_id)
                if page is not None:
                    return 200, page.encode(), html, {}
        if path == "/favicon.ico":
            return 204, b"", "image/x-icon", {}
        return 404, b"not found\n", "text/plain; charset=utf-8", {}
