"""The load generator's HTTP/1.1 client: keep-alive connections to one origin, asyncio protocols, llhttp framing.

Why not httpx: a load generator's own cost per request decides the highest rate it can send on time. httpx spends
about 1.8 ms of CPU on a request (its transport layers, h11 in pure Python, the stream machinery); at a few hundred
requests per second the event loop is busy with that and every send leaves late. This client does only what a
load generator needs -- POST a JSON body, read a status and a body, hand a streamed body's bytes over as they
arrive -- on ``asyncio.Protocol`` connections with httptools' C parser (llhttp, already a dependency through the
triage receiver) doing the HTTP/1.1 framing: Content-Length, chunked transfer encoding, keep-alive or close.

A streamed body's bytes are handed to the caller's ``on_chunk`` from the protocol callback itself, the moment the
socket delivers them, so a time taken there is the time the client received them -- no task switch in between.

No proxy is ever consulted and nothing but the origin given is connected to: the load goes where it is aimed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

STALE_RETRIES = 2  # a request that met a just-closed keep-alive connection goes again at most this often
MAX_BODY = 16 * 1024 * 1024  # a non-streamed answer larger than this is an error, not a memory hog
Chunk = Callable[[bytes], None]


class HttpError(Exception):
    """A request that got no complete HTTP answer; the subclass names what went wrong (reported by its name)."""


class ConnectError(HttpError):
    """The connection could not be opened."""


class RemoteProtocolError(HttpError):
    """The server closed the connection mid-answer, or answered something that is not HTTP/1.1."""


class ClosedBeforeAnswer(RemoteProtocolError):
    """The server closed the connection before one byte of the answer came back."""


@dataclass(slots=True)
class Response:
    status: int
    body: bytes  # empty when the body went to ``on_chunk``


@dataclass(frozen=True, slots=True)
class Sent:
    """A request on its connection: the connection's ends, and the bytes of it the client has not handed over yet."""

    local: tuple[str, int]
    server: tuple[str, int]
    unsent: int


class _Exchange:
    """One request on one connection: the parser's callbacks fill it, ``done`` resolves it."""

    __slots__ = ("done", "framed", "headers_done", "keep_alive", "on_chunk", "parts", "received", "size", "status")

    def __init__(self, done: asyncio.Future[Response], on_chunk: Chunk | None) -> None:
        self.done = done
        self.on_chunk = on_chunk
        self.status = 0
        self.parts: list[bytes] = []
        self.size = 0
        self.framed = False  # a Content-Length or chunked body: its end is in the stream, not at the connection's close
        self.headers_done = False
        self.keep_alive = False
        self.received = False  # any byte of the answer arrived


class _Connection(asyncio.Protocol):
    """One keep-alive connection; ``pool`` gets it back after each complete answer that allows reuse."""

    def __init__(self, pool: HttpClient) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.closed = False
        self.uses = 0  # requests started on it: a reused connection may have been closed by the server meanwhile

    # transport side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.exchange is not None:
            self.exchange.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(RemoteProtocolError("the server switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(RemoteProtocolError(f"not an HTTP/1.1 answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
        ex = self.exchange
        if ex is None or ex.done.done():
            return
        if ex.headers_done and not ex.framed:  # a body delimited by the connection's close: it is complete now
            self.exchange = None
            ex.done.set_result(Response(ex.status, b"".join(ex.parts)))
        elif not ex.received:
            self.exchange = None
            ex.done.set_exception(ClosedBeforeAnswer("the server closed the connection before answering"))
        else:
            self.exchange = None
            ex.done.set_exception(RemoteProtocolError("the server closed the connection before the answer was complete"))

    # parser side (httptools calls these from feed_data)
    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        framing = lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower())
        if framing and self.exchange is not None:
            self.exchange.framed = True

    def on_headers_complete(self) -> None:
        ex = self.exchange
        if ex is None:
            return
        ex.status = self.parser.get_status_code()
        ex.keep_alive = self.parser.should_keep_alive()
        ex.headers_done = True
        if ex.status != 200:
            ex.on_chunk = None  # an error's body is collected for the caller, not streamed

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        if ex is None:
            return
        if ex.on_chunk is not None:
            ex.on_chunk(body)
            return
        ex.size += len(body)
        if ex.size > MAX_BODY:
            self._fail(RemoteProtocolError(f"an answer larger than {MAX_BODY} bytes"))
            return
        ex.parts.append(body)

    def on_message_complete(self) -> None:
        ex = self.exchange
        if ex is None:
            return
        self.exchange = None
        if not ex.done.done():
            ex.done.set_result(Response(ex.status, b"".join(ex.parts)))
        if ex.keep_alive and not self.closed:
            self.pool._release(self)
        else:
            self.close()

    # client side
    def start(self, request: bytes, done: asyncio.Future[Response], on_chunk: Chunk | None) -> None:
        assert self.transport is not None and self.exchange is None
        self.exchange = _Exchange(done, on_chunk)
        self.transport.write(request)

    def _fail(self, exc: HttpError) -> None:
        ex, self.exchange = self.exchange, None
        if ex is not None and not ex.done.done():
            ex.done.set_exception(exc)
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.abort()  # never half a request left on a connection someone could reuse


class HttpClient:
    """Keep-alive HTTP/1.1 connections to the origin of ``base_url`` (http or https), at most ``max_connections``.

    ``await client.post(path, body)`` sends one JSON POST and returns its ``Response``; with ``on_chunk`` a 200
    answer's body goes to it piece by piece as it arrives (an error's body is still returned whole). A request
    that is cancelled (a timeout around it) closes its connection: it never goes back to the pool half-read.
    """

    def __init__(self, base_url: str, *, max_connections: int = 100) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r}: an http:// or https:// URL with a host")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        default = 443 if self.ssl else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.authority = host if self.port == default else f"{host}:{self.port}"
        self.max_connections = max(1, max_connections)
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self._opening = 0
        self._waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()
        self._heads: dict[str, bytes] = {}
        self._closed = False

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _head(self, path: str) -> bytes:
        head = self._heads.get(path)
        if head is None:
            head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.authority}\r\nAccept: */*\r\n"
                    "Content-Type: application/json\r\nContent-Length: ").encode()  # fmt: skip
            self._heads[path] = head
        return head

    async def post(self, path: str, body: bytes, on_chunk: Chunk | None = None) -> Response:
        """POST ``body`` (JSON) to ``path`` under the base URL; raises ``HttpError`` for a failed exchange."""
        return await self._send(b"%s%d\r\n\r\n%s" % (self._head(path), len(body), body), on_chunk)

    def post_now(self, path: str, body: bytes, on_chunk: Chunk | None = None) -> Coroutine[None, None, Response]:
        """``post``, with the request written *now*, before this returns, when a kept-alive connection is idle; the
        coroutine returned waits for the answer (else it opens or waits for a connection first, as ``post`` does).

        Why: a coroutine's body runs only when the loop next gets to its task -- after whatever else is ready then
        (other answers being read) -- so a load generator that calls ``post`` in a new task at an arrival's time
        sends a little later than it says. Written from the caller's own step, the request leaves at its time.
        """
        request = b"%s%d\r\n\r\n%s" % (self._head(path), len(body), body)
        conn = self._idle_connection()
        started = None if conn is None else (conn, self._start(conn, request, on_chunk))
        return self._send(request, on_chunk, started)

    async def get(self, path: str) -> Response:
        """GET ``path`` under the base URL (a readiness probe); raises ``HttpError`` for a failed exchange."""
        head = f"GET {self.prefix}{path} HTTP/1.1\r\nHost: {self.authority}\r\nAccept: */*\r\n\r\n"
        return await self._send(head.encode(), None)

    async def _send(self, request: bytes, on_chunk: Chunk | None,
                    started: tuple[_Connection, asyncio.Future[Response]] | None = None) -> Response:  # fmt: skip
        """One exchange; a request that met a kept-alive connection the server had just closed goes again.

        Why the second try: a server closes a connection that stayed idle past its keep-alive timeout (uvicorn 5 s,
        gunicorn 2 s), and a request written at that moment meets the close with no answer at all. That is the
        connection's age, not the server's failure, so a step that paused would count a false error. Only a
        *reused* connection closed before one byte of the answer is retried, at most twice: a fresh connection
        closed unanswered, or any answer cut short, stays the server's error. ``started``: the first attempt's
        request is already written (``post_now``).
        """
        for attempt in range(STALE_RETRIES + 1):
            if started is None:
                conn = await self._acquire()
                done = self._start(conn, request, on_chunk)
            else:
                (conn, done), started = started, None
            try:
                return await self._answer(conn, done)
            except ClosedBeforeAnswer:
                if conn.uses == 1 or attempt == STALE_RETRIES:  # a fresh connection: the server's refusal
                    raise
        raise AssertionError("unreachable")

    def _start(self, conn: _Connection, request: bytes, on_chunk: Chunk | None) -> asyncio.Future[Response]:
        conn.uses += 1
        done: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        conn.start(request, done, on_chunk)
        return done

    @staticmethod
    async def _answer(conn: _Connection, done: asyncio.Future[Response]) -> Response:
        try:
            return await done
        except asyncio.CancelledError:
            conn.close()
            raise

    def in_progress(self) -> list[Sent]:
        """Every connection with a request on it now: its two ends and what of the request is still unsent (a
        request waiting for a connection is not on one yet, and not listed)."""
        out = []
        for conn in self._all:
            transport = conn.transport
            if conn.exchange is None or transport is None or conn.closed:
                continue
            local, peer = transport.get_extra_info("sockname"), transport.get_extra_info("peername")
            if local and peer:
                out.append(Sent((local[0], local[1]), (peer[0], peer[1]), transport.get_write_buffer_size()))
        return out

    def _idle_connection(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _acquire(self) -> _Connection:
        conn = self._idle_connection()
        if conn is not None:
            return conn
        if self._closed:
            raise HttpError("the client is closed")
        if len(self._all) + self._opening < self.max_connections:
            return await self._open()
        waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            conn = await waiter
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self._release(waiter.result())  # type: ignore[arg-type]
            raise
        return conn if conn is not None else await self._acquire()

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        self._opening += 1
        try:
            _, proto = await loop.create_connection(
                lambda: _Connection(self), self.host, self.port, ssl=self.ssl,
                server_hostname=self.host if self.ssl else None,
            )  # fmt: skip
        except OSError as exc:
            raise ConnectError(f"{self.host}:{self.port}: {exc.strerror or exc}") from None
        finally:
            self._opening -= 1
        self._all.add(proto)
        return proto

    def _release(self, conn: _Connection) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        """A connection is gone: a waiter may now open one of its own."""
        self._all.discard(conn)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def aclose(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        self._all.clear()
