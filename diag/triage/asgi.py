"""The receiver's HTTP surface: a bare ASGI app on uvicorn's h11 protocol, plus the two deadlines uvicorn lacks.

Why uvicorn + h11 and no framework: request parsing is the part of a webhook receiver an attacker reaches
first, so it belongs to a maintained, fuzzed parser (h11, already installed with uvicorn) rather than to
code of our own. h11 rather than httptools (faster, but not installed with uvicorn): h11 stops buffering an
unfinished head at ``h11_max_incomplete_event_size`` (here ``MAX_HEADER_BYTES``), while uvicorn's httptools
protocol collects header lines without a bound -- fed one endless header block, it held 192 MiB of it
(+225 MiB RSS) before the app could refuse it. Measured side by side with the asyncio server this replaced
(``bench/triage.py``, bench/RESULTS.md "Triage"), h11 costs more CPU per delivery but stays within the
budget. A framework would add routing and a thread-pool hop for six routes.

What uvicorn does not do, and ``DeadlineH11Protocol`` adds: a deadline on the request head (uvicorn starts
no timer until a first response, so a client trickling header bytes held its connection for ever) and an
idle deadline from the moment a connection is accepted. The body has its own deadline in the app
(``TriageApp``): ``request_timeout_s`` from the end of the head, answered 408 and closed.

Chunked request bodies are accepted, up to the same ``max_body_bytes`` as a Content-Length body (counted as
they arrive, 413 and closed past it). Alertmanager itself always sends Content-Length, but a proxy or a
sidecar between it and the receiver may re-frame a body as chunked, and the decoding is h11's, not ours, so
refusing with 411 would only drop alerts a well-behaved hop forwarded. A POST with neither header is a 411.

Every answer of 400 or above closes the connection: what follows a request we refused (an unread body,
pipelined bytes) is not worth parsing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

from uvicorn.protocols.http.h11_impl import H11Protocol

from alerts.receiver_routes import route_severity, served_paths
from diag.triage import web

MAX_HEADER_BYTES = 16 * 1024  # request line + headers: a longer head is a 431
ALLOW = "GET, HEAD, POST"
# On every answer, including the ones the protocol writes itself (uvicorn adds these to the app's answers).
COMMON_HEADERS = [("x-content-type-options", "nosniff"), ("cache-control", "no-store"), ("server", "llm-diag-triage")]
SINGLE_HEADERS = (b"authorization", b"content-type")  # two of these is a malformed request, not a choice to make
WANTED_HEADERS = (*SINGLE_HEADERS, b"content-length", b"transfer-encoding")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class Reply:
    """An answer: a dict/list body is sent as JSON, bytes as they are."""

    status: int
    body: Any
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class Core(Protocol):
    """What the app needs from the receiver (``diag.triage.server.Receiver``)."""

    max_body_bytes: int
    page_threads: Executor

    def refusal(self, headers: Mapping[str, str]) -> Reply | None: ...

    async def record(self, body: bytes, route_severity: str) -> Reply: ...

    def page(self, path: str) -> Reply: ...


def raw_error(status: int, message: str) -> bytes:
    """A complete ``Connection: close`` error answer, for the protocol to write when there is no request to answer."""
    body = json.dumps({"error": message}).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json", f"content-length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in COMMON_HEADERS]
    head.append("connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with an idle deadline from accept and a deadline on each request head.

    uvicorn arms its keep-alive timer (``timeout_keep_alive``) only after a response and disarms it on any byte,
    so a client that connects and sends nothing, or sends a header byte now and then, is never timed out. Here
    the keep-alive timer also runs from accept, and the first byte of a request arms a head timer that the
    parsed request disarms; when it fires the client gets a 408 and the connection is closed. uvicorn's own
    answer to a request h11 cannot parse (a bare 400 without our headers) is replaced by ours.
    """

    def __init__(self, *args: Any, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._peer_closed = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        self._arm_head_timer()
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request head was parsed: its body has the app's deadline
            self._disarm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        """The client half-closed (``shutdown(SHUT_WR)``): answer what arrived whole, 400 what was cut short.

        uvicorn lets the transport close on EOF, which drops the answers to requests that arrived complete -- the
        one being processed and any pipelined behind it. Returning True keeps the write side open; after each
        answer ``on_response_complete`` looks again, and the connection closes once nothing is left to answer.
        """
        self._peer_closed = True
        return True if self._answers_pending_after_eof() else None  # None: asyncio closes the transport

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next pipelined request, if a whole one is buffered
        if self.transport.is_closing():
            return
        if self._peer_closed and not self._answers_pending_after_eof():
            self.transport.close()
        elif self.conn.trailing_data[0]:  # part of a pipelined head came early: its deadline runs from now
            self._arm_head_timer()

    def _answers_pending_after_eof(self) -> bool:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not cycle.more_body:
                return True
            self._refuse(400, "connection closed before the whole body arrived")
        elif self.conn.trailing_data[0]:  # no request under way, so what is buffered is an unfinished head
            self._refuse(400, "connection closed in the middle of the request head")
        return False

    def send_400_response(self, msg: str) -> None:
        """h11 refused the bytes: a head that outgrew ``MAX_HEADER_BYTES`` unfinished is a 431, anything else a 400."""
        if len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:
            self._refuse(431, f"request line and headers larger than {MAX_HEADER_BYTES} bytes")
        else:
            self._refuse(400, "malformed HTTP request")

    def _refuse(self, status: int, message: str) -> None:
        self._disarm_head_timer()
        if not self.transport.is_closing():
            self.transport.write(raw_error(status, message))
            self.transport.close()

    def _arm_head_timer(self) -> None:
        """From the first byte of a request head (no request under way), until that head is parsed."""
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self._refuse(408, f"request head not received within {self.head_timeout_s:g}s")


class HttpError(Exception):
    """A request refused before the receiver's core sees it (routing, framing, limits, deadline)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


class TriageApp:
    """ASGI 3 app: routes, request framing and limits, then the receiver's core (``Receiver.refusal``/``record``/``page``)."""

    def __init__(self, receiver: Core, *, request_timeout_s: float) -> None:
        self.receiver = receiver
        self.request_timeout_s = request_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan and websockets are off in the server's config
            return
        try:
            reply = await self._handle(scope, receive)
        except HttpError as exc:
            reply = Reply(exc.status, {"error": str(exc)}, headers=exc.headers)
        if reply is not None:
            await self._send(send, reply)

    async def _handle(self, scope: Scope, receive: Receive) -> Reply | None:
        if head_bytes(scope) > MAX_HEADER_BYTES:
            raise HttpError(431, f"request line and headers larger than {MAX_HEADER_BYTES} bytes")
        method = scope["method"]
        path = scope["raw_path"].decode("latin-1")  # as sent: a percent-escape does not make a route
        if method == "POST":
            severity = route_severity(path)
            if severity is None:
                raise HttpError(404, f"not found; Alertmanager should POST to one of {', '.join(served_paths())}")
            headers = request_headers(scope["headers"])
            refusal = self.receiver.refusal(headers)
            if refusal is not None:
                return refusal
            body = await self._read_body(headers, receive)
            if body is None:
                return None  # the client went away; nobody to answer
            return await self.receiver.record(body, severity)
        if method not in ("GET", "HEAD"):
            raise HttpError(405, f"{method} not allowed", {"Allow": ALLOW})
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.receiver.page_threads, self.receiver.page, path)

    async def _read_body(self, headers: Mapping[str, str], receive: Receive) -> bytes | None:
        limit = self.receiver.max_body_bytes
        declared = headers.get("content-length")
        if declared is None and "transfer-encoding" not in headers:
            raise HttpError(411, "a Content-Length (or a chunked body) is required")
        if declared is not None and "transfer-encoding" in headers:  # RFC 9112 6.1 lets a server refuse this
            raise HttpError(400, "both Content-Length and Transfer-Encoding: a request smuggling pattern")
        if declared is not None and int(declared) > limit:  # h11 has checked it is a number
            raise HttpError(413, f"body of {declared} bytes exceeds the limit of {limit}")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.request_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise HttpError(413, f"body exceeds the limit of {limit} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise HttpError(408, f"body not received within {self.request_timeout_s:g}s") from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @staticmethod
    async def _send(send: Send, reply: Reply) -> None:
        raw = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body, default=str).encode()
        headers = [(b"content-type", reply.content_type.encode("latin-1"))]
        if reply.status != 204:  # a 204 carries no body and so no length (RFC 9110 8.6)
            headers.append((b"content-length", str(len(raw)).encode()))
        if reply.content_type.startswith("text/html"):
            headers += [(b"content-security-policy", web.CSP.encode()), (b"referrer-policy", b"no-referrer")]
        headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in reply.headers.items()]
        if reply.status >= 400:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if reply.status == 204 else raw})


def head_bytes(scope: Scope) -> int:
    """The size of the request head as sent (give or take whitespace).

    h11 bounds only the part of a head still incomplete (``h11_max_incomplete_event_size``): a head that arrives
    in one read of up to 256 KiB is parsed whole. The memory stays bounded either way; this makes the limit exact.
    """
    size = len(scope["method"]) + len(scope["raw_path"]) + len(scope["query_string"]) + 12
    for name, value in scope["headers"]:
        size += len(name) + len(value) + 4
    return size


def request_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The headers the webhook reads, lower-case names (uvicorn lower-cases them); a repeated single header is a 400."""
    out: dict[str, str] = {}
    for name, value in raw:
        if name in WANTED_HEADERS:
            key = name.decode("latin-1")
            if key in out and name in SINGLE_HEADERS:
                raise HttpError(400, f"repeated {key} header")
            out[key] = value.decode("latin-1")
    return out
