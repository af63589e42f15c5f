"""Loader tracking: model loads and registry refreshes, and whether they sit on the request path.

Why: the ``blocking_loader_refresh`` incident is a service that re-reads its model or registry while
requests wait -- a refresh inside a handler, or holding a lock the handler needs, or blocking the
event loop. Its signature is a loader that runs *inside* a waiting request's arrival -> start window.
So a :class:`LoaderEvent` gets ``in_request_path=True`` when, at the loader's end, some in-flight
request of the same tracker had already arrived when the loader started and still had no inference
slot -- whether the loader ran in that request's handler or in another thread the request was
stuck behind. "In flight" starts at ``tracker.request()`` (with the arrival time of the ASGI
middleware when installed): open the request block first, around everything the request does.
(A background refresh that merely coincides with a queue backlog counts too: it ran while requests
were waiting, which is exactly what the rule weighs against the refresh rate.)

Usage (context manager, async context manager, or decorator of a sync or async function)::

    with tracker.track_loader("registry-refresh") as load:
        data = fetch()
        load.bytes_read = len(data)
        load.cache_hit = False

    @tracker.track_loader("load-weights", cache_hit=False)
    def load_weights(path): ...

``load.event`` holds the :class:`LoaderEvent` after the block. An exception inside the block is
recorded the same way (the duration until it was raised) and re-raised unchanged.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from collectors.records import LoaderEvent

F = TypeVar("F", bound=Callable[..., Any])


class RequestWindows(Protocol):
    """Who knows which requests are between arrival and their slot (the admission side)."""

    def waiting_since_before(self, mono: float) -> bool: ...


class LoaderSink(Protocol):
    """Where a finished loader run goes (the recording side); ``error`` counts our own failures."""

    def record_loader(self, event: LoaderEvent) -> None: ...

    def error(self, stage: str, n: int = 1) -> None: ...


class TrackedLoader:
    """One loader run. Set ``bytes_read`` / ``cache_hit`` inside the block when only then known.

    It needs two things and is given them, rather than a tracker: ``windows`` answers "was a request
    waiting for a slot when this loader started?", ``sink`` takes the event (``tracker.track_loader``
    wires both).
    """

    def __init__(
        self,
        windows: RequestWindows,
        sink: LoaderSink,
        name: str,
        bytes_read: int | None = None,
        cache_hit: bool | None = None,
    ) -> None:
        self.windows = windows
        self.sink = sink
        self.name = name
        self.bytes_read = bytes_read
        self.cache_hit = cache_hit
        self.event: LoaderEvent | None = None
        self._wall = 0.0
        self._mono = 0.0

    # -- context manager -------------------------------------------------------------------

    def __enter__(self) -> TrackedLoader:
        self._wall = time.time()
        self._mono = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish()

    async def __aenter__(self) -> TrackedLoader:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self._finish()

    # -- decorator -------------------------------------------------------------------------

    def __call__(self, func: F) -> F:
        """Decorate ``func``: every call is tracked as a fresh loader run with this name."""
        windows, sink, name, bytes_read, cache_hit = self.windows, self.sink, self.name, self.bytes_read, self.cache_hit
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                async with TrackedLoader(windows, sink, name, bytes_read, cache_hit):
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with TrackedLoader(windows, sink, name, bytes_read, cache_hit):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    # -- bookkeeping -----------------------------------------------------------------------

    def _finish(self) -> None:
        try:
            duration = max(0.0, time.perf_counter() - self._mono)
            in_path = self.windows.waiting_since_before(self._mono)
            bytes_read = int(self.bytes_read) if self.bytes_read is not None else None
            self.event = LoaderEvent(
                ts=self._wall,
                name=self.name,
                start=self._wall,
                duration_s=duration,
                bytes_read=bytes_read,
                cache_hit=None if self.cache_hit is None else bool(self.cache_hit),
                in_request_path=in_path,
                pid=os.getpid(),
            )
            self.sink.record_loader(self.event)
        except Exception:  # never into the app
            self.sink.error("loader")
