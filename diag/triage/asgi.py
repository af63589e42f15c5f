"""The receiver's HTTP surface: a bare ASGI app on uvicorn's httptools protocol, with the bounds uvicorn lacks.

Why a maintained parser and no framework: request parsing is the part of a webhook receiver an attacker
reaches first, so it belongs to a parser many servers run and fuzz -- httptools wraps llhttp, Node.js's
HTTP/1.1 parser -- rather than to code of our own. A framework would add routing and a thread-pool hop for
six routes; the app here is one ASGI callable.

Why httptools and not h11 (pure Python, installed with uvicorn already): measured side by side with the
asyncio server this replaced (``bench/triage.py``, bench/RESULTS.md "Triage"), h11 cost about twice that
server's CPU per delivery and half its deliveries/s, httptools within 1.5x of both. h11 had one thing
httptools lacks -- it stops buffering an unfinished head at a limit, where uvicorn's httptools protocol
collected one endless header block whole (192 MiB, +225 MiB RSS) -- so ``GuardedHttpToolsProtocol`` adds that
bound, the deadlines uvicorn does not have, and a correct end to a connection; its docstring says how.

Deadlines: a connection with no request under way is closed after ``idle_timeout_s``; a request head must
arrive within ``request_timeout_s`` of its first byte (408, closed), and its body within ``request_timeout_s``
of the head (``TriageApp``; 408, closed).

Chunked request bodies are accepted, up to the same ``max_body_bytes`` as a Content-Length body (counted as
they arrive, 413 and closed past it). Alertmanager itself always sends Content-Length, but a proxy or a
sidecar between it and the receiver may re-frame a body as chunked, and the decoding is llhttp's, not ours,
so refusing with 411 would only drop alerts a well-behaved hop forwarded. A POST with neither header is a 411;
with both, or with any coding but ``chunked``, a 400.

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

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from alerts.receiver_routes import route_severity, served_paths
from diag.triage import web

MAX_HEADER_BYTES = 16 * 1024  # request line + headers: a longer head is a 431
ALLOW = "GET, HEAD, POST"
# On every answer, the app's and the protocol's own. Not uvicorn's ``headers=`` config: it applies them from its
# first tick on, after the socket already accepts.
COMMON_HEADERS = [("x-content-type-options", "nosniff"), ("cache-control", "no-store"), ("server", "llm-diag-triage")]
_COMMON_RAW = [(name.encode(), value.encode()) for name, value in COMMON_HEADERS]
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


class _OneSendPerAnswer:
    """The transport as uvicorn's protocol sees it, with each answer's head and body leaving in one write.

    uvicorn writes an answer's head and its body separately, and a write to an idle socket is a ``send()`` of
    its own: on loopback the kernel hands the bytes to the reader inside that call, so two sends per answer
    cost a visible share of the receiver's CPU per delivery. The head of a final answer is held; the next write
    (its body) joins it, and ``GuardedHttpToolsProtocol.on_response_complete`` or ``close`` sends it when there
    is no body (HEAD, 204). An interim ``100 Continue`` passes at once: the client waits for it.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held = b""

    def write(self, data: bytes) -> None:
        if self._held:
            data, self._held = self._held + data, b""
        elif data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 1"):
            self._held = data
            return
        self._transport.write(data)

    def flush(self) -> None:
        if self._held:
            data, self._held = self._held, b""
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds and deadlines it lacks.

    - **Head size**: httptools gathers a header line's pieces, and uvicorn the finished lines, without a limit;
      here an unfinished head is refused (431) once ``MAX_HEADER_BYTES`` of it have arrived. Counted in whole
      reads: exact when the head starts a read (a client that waits for each answer, as Alertmanager does);
      when it starts in the middle of a read, after the end of a pipelined request, counting begins with the
      next read, so an unfinished head never holds more than the limit plus one read (256 KiB). The app
      checks the size of every finished head exactly.
    - **Deadlines**: uvicorn arms its keep-alive timer (``timeout_keep_alive``) only after an answer and disarms
      it on any byte, so a client that connects and sends nothing, or a header byte now and then, was never
      timed out. Here the keep-alive timer also runs from accept, and the first byte of a head arms a timer
      that the finished head disarms; when it fires the client gets a 408 and the connection is closed.
    - **The end of a connection** (EOF from a half-closing client, bytes httptools cannot parse, an oversized
      head): uvicorn closed at once, dropping the answers owed to requests that had arrived whole before it
      (a 400 even went out ahead of them). Here those are answered first, in order, then the error, then close.
      The error answers carry our headers and a JSON body.
    """

    def __init__(self, *args: Any, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_open = False  # a request head has begun and is not finished
        self._head_bytes = 0
        self._message_ended = False  # a request ended in the read being parsed
        self._ending: tuple[int, str] | None = None  # how the connection ends once the answers owed are sent

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_OneSendPerAnswer(transport))  # type: ignore[arg-type]
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        self._arm_head_timer()
        cycle = self.cycle
        head_was_open = self._head_open
        self._message_ended = False
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.cycle is not cycle:  # a head was finished: its body has the app's deadline
            self._disarm_head_timer()
        if self._head_open:
            if head_was_open or not self._message_ended:
                self._head_bytes += len(data)  # all of this read is the unfinished head (give or take leading CRLFs)
            if self._head_bytes > MAX_HEADER_BYTES:
                self._end_after_answers(431, f"request line and headers larger than {MAX_HEADER_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._head_open = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._message_ended = True
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        """The client half-closed (``shutdown(SHUT_WR)``): answer what arrived whole, then 400 what was cut short."""
        cycle = self.cycle
        if self._head_open:
            self._end_after_answers(400, "connection closed in the middle of the request head")
        elif cycle is not None and not cycle.response_complete and cycle.more_body:
            self._end_after_answers(400, "connection closed before the whole body arrived")
        else:
            self._end_after_answers(0, "")
        return None if self.transport.is_closing() else True  # True keeps the write side open for the answers

    def send_400_response(self, msg: str) -> None:
        """httptools refused the bytes; pipelined requests before them are still answered, in order."""
        self._end_after_answers(400, "malformed HTTP request")

    def on_response_complete(self) -> None:
        self.transport.flush()  # type: ignore[attr-defined]  # an answer without a body (HEAD, 204)
        super().on_response_complete()  # starts the next pipelined request, if one is queued
        if self.transport.is_closing():
            return
        self._end_if_nothing_owed()
        if not self.transport.is_closing() and self._head_open:  # part of a pipelined head came early
            self._arm_head_timer()

    def _answers_owed(self) -> bool:
        """Requests that arrived whole and are not answered yet (one under way, others queued behind it)."""
        cycle = self.cycle
        return bool(self.pipeline) or (cycle is not None and not cycle.response_complete and not cycle.more_body)

    def _end_after_answers(self, status: int, message: str) -> None:
        """No more requests will come (EOF, unparseable bytes, an oversized head): once the answers owed are sent,
        send this error (``status`` 0: none) and close. uvicorn's own way wrote its 400 at once, ahead of the
        answers still owed to earlier pipelined requests, and closed before they were sent."""
        if self._ending is None:
            self._ending = (status, message)
        self.flow.pause_reading()
        self._end_if_nothing_owed()

    def _end_if_nothing_owed(self) -> None:
        if self._ending is not None and not self._answers_owed() and not self.transport.is_closing():
            status, message = self._ending
            if status:
                self._refuse(status, message)
            else:
                self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        self._disarm_head_timer()
        if not self.transport.is_closing():
            self.transport.write(raw_error(status, message))
            self.transport.close()

    def _arm_head_timer(self) -> None:
        """From the first byte of a request head (no request under way), until that head is finished."""
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
        version = scope["http_version"]
        if version not in ("1.0", "1.1"):
            raise HttpError(400, f"HTTP/{version}: HTTP/1.1 or HTTP/1.0 expected")
        if version == "1.1" and not any(name == b"host" for name, _ in scope["headers"]):
            raise HttpError(400, "an HTTP/1.1 request needs a Host header (RFC 9112 3.2)")
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
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":  # a gzip'd body would not be JSON
            raise HttpError(400, f"Transfer-Encoding {coding!r}: only chunked is accepted")
        if declared is not None:
            if not declared.isdigit():  # llhttp has refused these already; not a thing to take on trust here
                raise HttpError(400, "a valid Content-Length is required")
            if int(declared) > limit:
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
        headers = [*_COMMON_RAW, (b"content-type", reply.content_type.encode("latin-1"))]
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

    The protocol bounds a head while it is unfinished, to the limit plus at most one read (a head that arrives in
    one read of up to 256 KiB is parsed whole); this makes the limit exact for every finished head.
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
