"""The gate's two HTTP calls over an ``httpx.AsyncClient``, for a target that is an ASGI app in this process.

Why: ``httpx.ASGITransport`` serves an app with no socket, which is how the gate's in-process tests (and anyone
embedding the gate) reach a tiny server; the load generator's own client (``http_client.HttpClient``) speaks only
to a socket. This adapter answers the same ``post``/``get`` calls with the same ``Response`` and the same errors,
so the load, the application gate and the criteria run unchanged. Not for real load: httpx costs ~25x the CPU
per request (see ``http_client``).
"""

from __future__ import annotations

import httpx

from diag.gate.http_client import Chunk, RemoteProtocolError, Response


class HttpxClient:
    """``post``/``get`` over an ``httpx.AsyncClient`` (its ``base_url`` and transport); timeouts are the caller's."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def __aenter__(self) -> HttpxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def post(self, path: str, body: bytes, on_chunk: Chunk | None = None) -> Response:
        return await self._send("POST", path, body, on_chunk)

    async def get(self, path: str) -> Response:
        return await self._send("GET", path, None, None)

    async def _send(self, method: str, path: str, body: bytes | None, on_chunk: Chunk | None) -> Response:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            async with self.client.stream(method, path, content=body, headers=headers) as resp:
                if on_chunk is not None and resp.status_code == 200:
                    async for chunk in resp.aiter_raw():
                        on_chunk(chunk)
                    return Response(resp.status_code, b"")
                return Response(resp.status_code, await resp.aread())
        except httpx.HTTPError as exc:
            raise RemoteProtocolError(f"{type(exc).__name__}: {exc}") from None
