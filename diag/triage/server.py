"""The receiver: ``POST /webhook[/page|/ticket]`` for Alertmanager, a read-only page and JSON for people.

``Receiver`` owns the parts that start and stop together -- the listening socket (bound in the constructor,
so a taken port fails before any thread starts), the group-commit writer, the diagnosis worker, the outbox
dispatcher and the HTTP server -- and the webhook's core: token, content type, the duplicate-body cache,
validation, the commit. HTTP itself (parsing, framing, limits, deadlines) is uvicorn's httptools protocol under
the bare ASGI app in ``diag.triage.asgi``; why that and not a server of our own is argued there, with the figures
in bench/RESULTS.md "Triage".

Status codes are the contract with Alertmanager, which retries 5xx and drops 4xx: every problem with the
request itself is a 4xx (400 malformed, 401 token, 408 too slow, 411/413 length, 415 type, 422 cannot apply),
and 503 (with Retry-After) only when the store could not record it *now*. A 2xx is sent only after the group
commit (``Ingestor.submit_async``) has the delivery on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import re
import socket
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from diag.triage import asgi, lifecycle, payload, web
from diag.triage.asgi import Reply
from diag.triage.diagnosis import DiagnosisWorker, Source
from diag.triage.ingest import Ingestor, Rejected, Unavailable
from diag.triage.outbox import Dispatcher
from diag.triage.sinks import Sink
from diag.triage.store import CLAIM_LEASE_S, connect, get_incident, list_incidents, set_diagnosis

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0  # the request head must arrive within this of its first byte, and the body within this after
IDLE_TIMEOUT_S = 120.0  # a connection with no request under way is closed after this
COMMIT_TIMEOUT_S = 10.0
GRACEFUL_SHUTDOWN_S = COMMIT_TIMEOUT_S + 1  # requests in flight (waiting for their commit) may finish, no longer
OFFLOAD_PARSE_BYTES = 64 * 1024  # bigger bodies are validated on a thread, so one cannot stall the loop
DIGEST_CACHE = 8192  # recently committed bodies remembered by digest (16 bytes each)
HTML = "text/html; charset=utf-8"


@dataclass
class ReceiverConfig:
    host: str = "127.0.0.1"
    port: int = 9095
    db: Path | str = Path("triage.db")  # a SQLite file, or a postgresql:// URL (diag.triage.pg)
    policy: lifecycle.Policy = field(default_factory=lifecycle.Policy)
    source: Source | None = None
    token: str = ""
    max_body_bytes: int = payload.MAX_BODY_BYTES
    sinks: dict[str, Sink] = field(default_factory=dict)
    bundle_on: str | None = None
    bundle_dir: Path | None = None
    page_url: str = ""
    lookback_s: float = 1800.0
    claim_lease_s: float = CLAIM_LEASE_S  # a shared store only: how long a claim on a ticket action holds
    request_timeout_s: float = REQUEST_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the CLI's SIGTERM handler calls ``Receiver.shutdown``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Receiver:
    """Store writer, diagnosis worker, outbox dispatcher and the HTTP server, started and stopped together."""

    def __init__(self, config: ReceiverConfig) -> None:
        self.config = config
        self.diagnosis: DiagnosisWorker | None = None
        self.dispatcher: Dispatcher | None = None
        db = connect(config.db)  # schema first, so the threads below never race to create it
        try:  # whether incidents get a diagnosis: a receiver without a source marks them "not diagnosed", not pending
            set_diagnosis(db, config.source is not None)
        finally:
            db.close()
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        # proto named: asyncio sets TCP_NODELAY only on sockets whose proto is TCP, and with Nagle on, an answer's
        # second write (uvicorn writes head and body apart) waited for the client's delayed ACK: 40 ms per request
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((config.host, config.port))  # fails early (port taken) before any thread starts
        self._sock.listen(512)
        if config.source is not None:
            self.diagnosis = DiagnosisWorker(
                config.db, config.source, config.policy, lookback_s=config.lookback_s, bundle_on=config.bundle_on,
                bundle_dir=config.bundle_dir,
            )  # fmt: skip
        if config.sinks:
            self.dispatcher = Dispatcher(config.db, config.sinks, page_url=config.page_url, claim_lease_s=config.claim_lease_s)
        self.ingestor = Ingestor(config.db, config.policy, on_commit=self._committed)
        self.page_threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="triage-page")
        self._local = threading.local()
        self._serving = False
        self._stopped = threading.Event()
        self._committed_bodies: dict[bytes, None] = {}  # insertion-ordered: a FIFO of recently committed bodies
        self._server = _Server(
            uvicorn.Config(
                asgi.TriageApp(self, request_timeout_s=config.request_timeout_s),
                http=functools.partial(asgi.GuardedHttpToolsProtocol, head_timeout_s=config.request_timeout_s),  # type: ignore[arg-type]
                timeout_keep_alive=config.idle_timeout_s,  # type: ignore[arg-type]
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,  # type: ignore[arg-type]
                backlog=512,
                server_header=False,
                loop="asyncio",
                interface="asgi3",
                lifespan="off",
                ws="none",
                proxy_headers=False,
                access_log=False,
                log_config=None,
                log_level="error",  # uvicorn warns once per malformed request: a log flood anyone could cause
            )
        )

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def max_body_bytes(self) -> int:
        return self.config.max_body_bytes

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
        self._serving = True
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop accepting and return from ``serve_forever`` once requests in flight are answered (thread-safe).

        uvicorn's main loop looks at this flag every 0.1 s; setting it is safe from a signal handler.
        """
        self._server.should_exit = True

    def close(self) -> None:
        if self._serving:
            self.shutdown()
            self._stopped.wait(timeout=30)
        self._sock.close()
        self.ingestor.close()
        self.page_threads.shutdown(wait=True, cancel_futures=True)
        if self.diagnosis is not None:
            self.diagnosis.close()
        if self.dispatcher is not None:
            self.dispatcher.close()

    # ------------------------------------------------------------------ webhook core

    def refusal(self, headers: Mapping[str, str]) -> Reply | None:
        """401 or 415 from the headers alone, before the body is read (``headers``: lower-case names)."""
        token = self.config.token
        if token:
            given = headers.get("authorization", "")
            if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), token.encode())):
                return Reply(401, {"error": "missing or wrong bearer token"}, headers={"WWW-Authenticate": "Bearer"})
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            return Reply(415, {"error": f"Content-Type {ctype or '(none)'}: application/json expected"})
        return None

    async def record(self, body: bytes, route_severity: str = "") -> Reply:
        """Validate and commit one delivery; 200 only once it is on disk."""
        digest = hashlib.blake2b(route_severity.encode() + b"\0" + body, digest_size=16).digest()
        if digest in self._committed_bodies:
            # byte-identical to a body already committed (a retry, or the other HA peer): applying it again is a
            # no-op by construction (lifecycle idempotence), so it is answered without touching the store
            return Reply(200, {"status": "recorded", "outcomes": ["duplicate"]})
        try:
            if len(body) > OFFLOAD_PARSE_BYTES:
                loop = asyncio.get_running_loop()
                note = await loop.run_in_executor(self.page_threads, payload.parse, body, route_severity)
            else:
                note = payload.parse(body, route_severity)
        except payload.PayloadError as exc:
            return Reply(400, {"error": str(exc)})
        try:
            async with asyncio.timeout(COMMIT_TIMEOUT_S):
                outcomes = await self.ingestor.submit_async(note)
        except (Unavailable, TimeoutError) as exc:
            return Reply(503, {"error": str(exc) or "not recorded in time; retry"}, headers={"Retry-After": "5"})
        except Rejected as exc:
            return Reply(422, {"error": str(exc)})
        self._committed_bodies[digest] = None
        if len(self._committed_bodies) > DIGEST_CACHE:
            self._committed_bodies.pop(next(iter(self._committed_bodies)))
        return Reply(200, {"status": "recorded", "outcomes": outcomes})

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

    # ------------------------------------------------------------------ pages

    def page(self, path: str) -> Reply:
        """GET routes, on a page thread (SQLite reads and template rendering stay off the event loop)."""
        db = self.reader()
        if path in ("/", "/incidents"):
            return Reply(200, web.render_list(db).encode(), HTML)
        if path == "/healthz":
            return Reply(200, {"status": "ok"})
        if path == "/api/incidents":
            return Reply(200, list_incidents(db))
        m = re.fullmatch(r"/(api/)?incidents/(\d{1,12})", path)
        if m:
            incident_id = int(m.group(2))
            if m.group(1):
                view = get_incident(db, incident_id)
                if view is not None:
                    return Reply(200, view.to_dict())
            else:
                page = web.render_incident(db, incident_id)
                if page is not None:
                    return Reply(200, page.encode(), HTML)
        if path == "/favicon.ico":
            return Reply(204, b"", "image/x-icon")
        return Reply(404, b"not found\n", "text/plain; charset=utf-8")
