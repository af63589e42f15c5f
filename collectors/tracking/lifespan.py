"""The tracker's last rows at an ASGI server's shutdown: flushed before the server says it has shut down.

Why at the lifespan and not (only) at exit: the tracker forwards rows to the flight recorder once a second,
and uvicorn re-raises the SIGTERM it caught once it has shut down -- a process ended by a signal runs no
``atexit`` handler, so the rows of its last second would be lost. The lifespan's ``shutdown.complete`` is the
last moment the server waits for the app.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]


def flushing_at_shutdown(send: Send, flush: Callable[[], Any]) -> Send:
    """``send`` for a lifespan scope that runs ``flush`` (in a thread: it waits on the disk) before the shutdown
    is reported, whether the app's own shutdown succeeded or failed."""

    async def send_after_flush(message: dict[str, Any]) -> None:
        if message.get("type") in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            import anyio

            await anyio.to_thread.run_sync(flush)
        await send(message)

    return send_after_flush
