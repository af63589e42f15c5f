"""The request a ``diag wrap``-ped server's current task serves: where the ASGI layer and the engine adapters meet.

Why a module of its own: the ASGI layer (``wrapped``) sets it and the engine adapters (``engine_locks``) read it,
and neither should import the other for it.
"""

from __future__ import annotations

import contextlib
import contextvars

from collectors.tracking.request import TrackedRequest

CURRENT_REQUEST: contextvars.ContextVar[TrackedRequest | None] = contextvars.ContextVar("llmdiag_wrapped", default=None)


def mark_current_start() -> None:
    """The request this task serves has got the model: inference starts now (called by the engine adapters)."""
    req = CURRENT_REQUEST.get()
    if req is not None:
        with contextlib.suppress(Exception):  # never let tracking fail the server's own request
            req.acquire_sync()  # no admission limits here: takes a free slot at once, marks the start
