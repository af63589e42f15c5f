"""The load generator's HTTP/1.1 client against a raw asyncio server on loopback that writes its answers byte by byte
as each test needs them: every framing a server may choose (Content-Length, chunked, a body ended by the close),
keep-alive reuse, a streamed body handed over as it arrives, and what a broken or refused exchange becomes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from diag.gate.http_client import ClosedBeforeAnswer, ConnectError, HttpClient, RemoteProtocolError

pytestmark = pytest.mark.process

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """Reads each request (head and Content-Length body) and lets ``handler`` write the answer; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lengths = (int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
                length = next(lengths, 0)
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                await self.handler(request, reader, writer)
                if writer.is_closing():
                    return
        writer.close()


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    server = Server(handler)
    srv = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield server


def _json_answer(body: bytes, status: str = "200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (status.encode(), len(body), body)


async def _echo(request: bytes, _r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(_json_answer(request.split(b"\r\n\r\n", 1)[1]))
    await writer.drain()


def test_a_content_length_answer_and_keep_alive_reuse() -> None:
    async def go() -> None:
        async with serving(_echo) as server, HttpClient(f"http://127.0.0.1:{server.port}/base/", max_connections=4) as client:
            first = await client.post("/v1/completions", b'{"a": 1}')
            second = await client.post("/v1/completions", b'{"b": 22}')
            assert (first.status, first.body, second.body) == (200, b'{"a": 1}', b'{"b": 22}')
            assert server.connections == 1  # the second request went on the first one's connection
            head = server.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
            assert head[0] == b"POST /base/v1/completions HTTP/1.1"
            assert f"Host: 127.0.0.1:{server.port}".encode() in head and b"Content-Length: 8" in head

    asyncio.run(go())


def test_a_readiness_get_has_no_body_and_leaves_its_connection_for_the_next_post() -> None:
    async def go() -> None:
        async with serving(_echo) as server, HttpClient(f"http://127.0.0.1:{server.port}/base", max_connections=4) as client:
            ready = await client.get("/health")
            posted = await client.post("/v1/completions", b'{"a": 1}')
            assert (ready.status, ready.body, posted.body) == (200, b"", b'{"a": 1}')
            assert server.connections == 1
            head = server.requests[0].split(b"\r\n")
            assert head[0] == b"GET /base/health HTTP/1.1" and not any(h.lower().startswith(b"content-") for h in head[1:] if h)

    asyncio.run(go())


def test_a_chunked_stream_is_handed_over_as_it_arrives_and_an_error_body_is_returned_whole() -> None:
    async def go() -> None:
        seen: list[bytes] = []
        first_seen = asyncio.Event()

        async def stream(request: bytes, _r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if b"fail" in request:
                writer.write(_json_answer(b'{"error": "busy"}', "429 Too Many Requests"))
                return
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await writer.drain()
            await asyncio.wait_for(first_seen.wait(), 10)  # the client must have it before the rest is even written
            writer.write(b"6\r\nsecond\r\n0\r\n\r\n")

        def on_chunk(data: bytes) -> None:
            seen.append(data)
            first_seen.set()

        async with serving(stream) as server, HttpClient(f"http://127.0.0.1:{server.port}") as client:
            resp = await client.post("/s", b"{}", on_chunk)
            assert (resp.status, resp.body, b"".join(seen)) == (200, b"", b"firstsecond")
            seen.clear()
            busy = await client.post("/s", b'"fail"', on_chunk)
            assert (busy.status, busy.body, seen) == (429, b'{"error": "busy"}', [])
            assert server.connections == 1

    asyncio.run(go())


def test_a_body_ended_by_the_close_is_complete_and_its_connection_not_reused() -> None:
    async def close_delimited(_q: bytes, _r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async def go() -> None:
        async with serving(close_delimited) as server, HttpClient(f"http://127.0.0.1:{server.port}") as client:
            assert (await client.post("/x", b"{}")).body == b"all of it"
            assert (await client.post("/x", b"{}")).body == b"all of it"
            assert server.connections == 2

    asyncio.run(go())


def test_broken_answers_and_a_refused_connection_are_named_errors() -> None:
    async def cut(_q: bytes, _r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()
        writer.close()

    async def garbage(_q: bytes, _r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()

    async def go() -> None:
        for handler, words in ((cut, "before the answer was complete"), (garbage, "not an HTTP/1.1 answer")):
            async with serving(handler) as server, HttpClient(f"http://127.0.0.1:{server.port}") as client:
                with pytest.raises(RemoteProtocolError, match=words):
                    await client.post("/x", b"{}")
        with socket.socket() as s:  # a port nothing listens on: bound, never listening
            s.bind(("127.0.0.1", 0))
            async with HttpClient(f"http://127.0.0.1:{s.getsockname()[1]}") as client:
                with pytest.raises(ConnectError):
                    await client.post("/x", b"{}")

    asyncio.run(go())


def test_a_keep_alive_connection_closed_under_a_request_sends_it_again_but_a_fresh_one_does_not() -> None:
    """A server that closes each connection at its second request, unanswered (a keep-alive timeout racing the
    reuse): the request goes again on a new connection. One that closes at the first request is an error."""
    seen: dict[int, int] = {}

    async def idle_timeout(_q: bytes, _r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = seen[id(writer)] = seen.get(id(writer), 0) + 1
        if n == 2:
            writer.close()
            return
        await _echo(_q, _r, writer)

    async def hang_up(_q: bytes, _r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def go() -> None:
        async with serving(idle_timeout) as server, HttpClient(f"http://127.0.0.1:{server.port}") as client:
            first = await client.post("/x", b'{"n": 1}')
            second = await client.post("/x", b'{"n": 2}')
            assert (first.body, second.body) == (b'{"n": 1}', b'{"n": 2}')
            assert server.connections == 2 and len(server.requests) == 3  # the second request was sent twice
        async with serving(hang_up) as server, HttpClient(f"http://127.0.0.1:{server.port}") as client:
            with pytest.raises(ClosedBeforeAnswer):
                await client.post("/x", b"{}")
            assert server.connections == 1  # a fresh connection closed unanswered: not sent again

    asyncio.run(go())


def test_post_now_writes_the_request_before_it_returns_and_its_coroutine_reads_the_answer() -> None:
    """The load generator's send: on an idle kept-alive connection the request is on the wire before ``post_now``
    returns -- the server gets it though the coroutine returned has not run yet (``post``'s would not have sent it);
    with no idle connection the coroutine opens one; a reused connection closed under it still goes again."""
    closed: list[bytes] = []

    async def idle_timeout(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if b"stale" in request and not closed:  # the first time only: a keep-alive timeout racing the reuse
            closed.append(request)
            writer.close()
            return
        await _echo(request, reader, writer)

    async def until(cond: Callable[[], bool]) -> None:
        async with asyncio.timeout(30):
            while not cond():
                await asyncio.sleep(0.01)

    async def go() -> None:
        async with serving(idle_timeout) as server, HttpClient(f"http://127.0.0.1:{server.port}") as client:
            fresh = client.post_now("/x", b'"fresh"')  # no connection yet: opened when awaited
            await asyncio.sleep(0.05)
            assert server.requests == []
            assert (await fresh).body == b'"fresh"'
            early = client.post_now("/x", b'"early"')  # the connection is idle now: written at once
            later = client.post("/x", b'"later"')  # not sent until its coroutine runs
            await until(lambda: len(server.requests) == 2)
            assert server.requests[1].endswith(b'"early"')
            assert [(await early).body, (await later).body] == [b'"early"', b'"later"']
            assert server.connections == 1
            stale = client.post_now("/x", b'"stale"')  # the server closes that connection unanswered
            await until(lambda: len(server.requests) == 4)
            assert (await stale).body == b'"stale"'
            assert server.connections == 2 and len(server.requests) == 5  # sent again, on a new connection

    asyncio.run(go())


def test_a_cancelled_request_closes_its_connection_so_no_late_answer_is_read_as_the_next_one() -> None:
    async def go() -> None:
        release = asyncio.Event()

        async def slow_then_echo(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if b"slow" in request:
                await release.wait()
                writer.write(_json_answer(b'"late"'))
                return
            await _echo(request, reader, writer)

        async with serving(slow_then_echo) as server, HttpClient(f"http://127.0.0.1:{server.port}", max_connections=1) as client:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await client.post("/x", b'"slow"')
            release.set()
            assert (await client.post("/x", b'"next"')).body == b'"next"'
            assert server.connections == 2

    asyncio.run(go())


def test_max_connections_holds_requests_until_a_connection_is_free() -> None:
    async def go() -> None:
        in_flight = 0
        most = 0

        async def counted(request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            await asyncio.sleep(0)  # let the others' requests arrive if they could
            in_flight -= 1
            await _echo(request, reader, writer)

        async with serving(counted) as server, HttpClient(f"http://127.0.0.1:{server.port}", max_connections=2) as client:
            bodies = [b'{"i": %d}' % i for i in range(8)]
            got = await asyncio.gather(*(client.post("/x", b) for b in bodies))
            assert [r.body for r in got] == bodies
            assert server.connections == 2 and most <= 2

    asyncio.run(go())


def test_a_url_that_is_not_http_is_refused_clearly() -> None:
    for bad in ("ftp://127.0.0.1", "127.0.0.1:8000", "http://"):
        with pytest.raises(ValueError, match="http:// or https://"):
            HttpClient(bad)
