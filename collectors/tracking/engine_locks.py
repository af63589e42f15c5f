"""Where an engine we did not write takes its model: the start of inference for ``diag wrap``.

An ASGI layer sees a request arrive and its response leave, not the moment the server's model becomes
free for it; for a server with one model behind a lock, that moment is the whole difference between
queue wait and inference time. An adapter here wraps such a lock so that acquiring it marks the current
request's start (``current.mark_current_start``). The lock's own behaviour (blocking, fairness,
``locked()``) is untouched: the proxy forwards every call.

Adapters:
- llama-cpp-python's server (``llama_cpp.server.app``): every completion and chat request takes
  ``llama_outer_lock`` then ``llama_inner_lock`` before it gets the model and holds the inner one while it
  generates (streaming included); the outer one is released once the inner one is held, so a streaming
  request can see that another waits. Taking the inner lock is the start. Older releases use a
  ``threading.Lock`` taken in a worker thread, newer ones an ``anyio.Lock`` taken on the event loop: the
  proxy handles both.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from collectors.tracking.current import mark_current_start


class StartMarkingLock:
    """A lock whose successful acquire marks the current request's start; everything else is the lock's own."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def acquire(self, *args: Any, **kwargs: Any) -> Any:
        got = self._lock.acquire(*args, **kwargs)
        if inspect.isawaitable(got):
            return self._acquired_async(got)
        if got is not False:
            mark_current_start()
        return got

    async def _acquired_async(self, pending: Any) -> Any:
        got = await pending
        if got is not False:
            mark_current_start()
        return got

    def release(self) -> Any:
        return self._lock.release()

    def __enter__(self) -> Any:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Any:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lock, name)


def _llama_cpp_server() -> bool:
    module = sys.modules.get("llama_cpp.server.app")
    lock = getattr(module, "llama_inner_lock", None) if module else None
    if lock is None:
        return False
    if not isinstance(lock, StartMarkingLock):
        module.llama_inner_lock = StartMarkingLock(lock)  # type: ignore[union-attr]
    return True


ADAPTERS = {"llama-cpp-python server": _llama_cpp_server}


def instrument_loaded_engines() -> list[str]:
    """Wrap the model locks of every known engine this process has imported; the names of those wrapped."""
    return [name for name, adapt in ADAPTERS.items() if adapt()]
