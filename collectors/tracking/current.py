"""The request a ``diag wrap``-ped server's current task serves: where the ASGI layer and the engine adapters meet.

Why a module of its own: the ASGI layer (``wrapped``) sets it and the engine adapters (``engine_locks``) read it,
and neither should import the other for it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Protocol


class RequestInApp(Protocol):
    """What the ASGI layer keeps per request for the adapters: one call, at the start of inference."""

    def mark_start(self) -> None: ...


CURRENT_REQUEST: contextvars.ContextVar[RequestInApp | None] = contextvars.ContextVar("llmdiag_wrapped", default=None)


def mark_current_start() -> None:
    """The request this task serves has got the model: inference starts now (called by the engine adapters)."""
    req = CURRENT_REQUEST.get()
    if req is not None:
        with contextlib.suppress(Exception):  # never let tracking fail the server's own request
            req.mark_start()
