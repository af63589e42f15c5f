"""Tracking applied from outside to an ASGI app someone else wrote (``diag wrap -- COMMAND``).

Why from outside: most inference servers (llama-cpp-python's, a team's own FastAPI service they may not
edit mid-incident) build their app themselves; asking their owners to call ``instrument_fastapi`` first
means no data when it is needed. ``diag wrap`` starts the command with this module installed (the
``boot`` directory's ``sitecustomize`` calls :func:`install_from_env`), and the first Starlette app the
process serves answers through :class:`WrappedApp`, its outermost layer:

- each HTTP request is a :class:`TrackedRequest` from arrival (before the app's own middleware) to the
  last byte sent; its outcome comes from the status the app answered (5xx error, 429 rejected);
- the start of inference is marked where the server takes its model (an engine adapter in
  ``engine_locks``, e.g. llama-cpp-python's model lock), so the queue wait in front of that lock is
  measured; without an adapter the start is unknown and the rows say so (no start) rather than guess;
- the first body chunk of a streamed response is the time to first token;
- ``GET <metrics_path>`` is answered here with the tracker's Prometheus exposition (no route is added
  to the app, so its own routing and responses stay exactly as they were);
- spans follow ``span_sample_ratio`` end to end. FastAPI (0.16x and later) traces every request on its own,
  four spans each (server, dependencies, endpoint, serialization), as soon as a global TracerProvider
  exists -- and the tracker installs one when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set. Left alone, a 10 %
  ratio would export 100 % of requests' framework spans (measured on llama-cpp-python's server: 1.7 ms of
  exporter CPU per request, over 1 % of a 64-token completion). So when the provider is the tracker's,
  the app's ``exclude`` hook draws the decision at FastAPI's edge (a sampled ``traceparent`` is always
  traced): a sampled-out request gets no framework span, a sampled one gets them with the ``llm.*``
  spans as children of its server span. A provider the application or operator set up is theirs: its
  sampling is left as it is.

Nothing of a request's body is read or kept: prompts never reach the recorder.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from collectors.tracking import engine_locks
from collectors.tracking import spans as sp
from collectors.tracking.current import CURRENT_REQUEST
from collectors.tracking.lifespan import flushing_at_shutdown
from collectors.tracking.request import TrackedRequest

ENV_CONFIG = "LLMDIAG_WRAP"
# Where FastAPI's exclude hook leaves the edge's sampling decision for :class:`WrappedApp` (True: traced).
TRACED_KEY = "llmdiag.traced"

Scope = dict[str, Any]


@dataclass(frozen=True)
class WrapConfig:
    """What ``diag wrap`` passes to the wrapped process (as JSON in ``$LLMDIAG_WRAP``)."""

    model: str = "wrapped"
    recorder: str | None = None  # None: no flight recorder (metrics only)
    span_sample_ratio: float = 0.1
    metrics_path: str | None = "/metrics"

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, text: str) -> WrapConfig:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        known = {k: raw[k] for k in ("model", "recorder", "span_sample_ratio", "metrics_path") if k in raw}
        return cls(**known)


def outcome_of(status: int) -> str:
    """The request outcome an HTTP status says: the server's errors, its refusals, or served."""
    if status == 429:
        return "rejected"
    if status >= 500:
        return "error"
    return "ok"


def _matched_route(scope: Scope, app: Any) -> str:
    """A bounded route label: the matched route's template, never the raw path (ids in paths would explode it).

    FastAPI's router leaves the route it matched in the scope (``scope["route"]``), nested routers included; a
    plain Starlette app's routes are matched here. ``app``: the one Starlette put in the scope, else the one
    we wrap."""
    from starlette.routing import Match

    matched = scope.get("route")
    template = getattr(matched, "path_format", None) or getattr(matched, "path", None)
    if template:
        return str(template)
    for candidate in getattr(scope.get("app", app), "routes", None) or ():
        try:
            match, _ = candidate.matches(scope)
        except Exception:  # a route type we do not know how to match: skip it, do not fail the request
            continue
        if match == Match.FULL:
            return str(getattr(candidate, "path_format", None) or getattr(candidate, "path", None) or "other")
    return "other"


class _RequestInApp:
    """One request on its way through the app: its :class:`TrackedRequest`, named by route once routing matched it."""

    __slots__ = ("app", "named", "req", "scope")

    def __init__(self, req: TrackedRequest, scope: Scope, app: Any) -> None:
        self.req = req
        self.scope = scope
        self.app = app
        self.named = False

    def name(self) -> None:
        if not self.named:
            self.named = True
            self.req.set_route(_matched_route(self.scope, self.app))

    def mark_start(self) -> None:
        self.name()
        self.req.acquire_sync()  # no admission limits here: takes a free slot at once, marks the start


class WrappedApp:
    """Pure ASGI layer around a whole app: one :class:`TrackedRequest` per HTTP request (see the module doc)."""

    def __init__(self, app: Any, tracker: Any, config: WrapConfig) -> None:
        self.app = app
        self.tracker = tracker
        self.config = config

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, flushing_at_shutdown(send, self.tracker.flush))
            return
        if scope["type"] != "http" or CURRENT_REQUEST.get() is not None:  # a mounted sub-app: tracked already
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.config.metrics_path and path == self.config.metrics_path and scope.get("method") == "GET":
            await self._metrics(send)
            return
        traced = scope.get(TRACED_KEY)
        arrival = None
        if traced is not None:  # decided at FastAPI's edge: the tracker's spans follow it (see the module doc)
            arrival = sp.Arrival(time.time(), time.perf_counter(), traced)
            arrival_token = sp.CURRENT_ARRIVAL.set(arrival)
        req = self.tracker.request("other")  # arrival now; the route is named once the app's router has matched it
        if arrival is not None:
            sp.CURRENT_ARRIVAL.reset(arrival_token)  # adopted: the request marks its start and end itself
        in_app = _RequestInApp(req, scope, self.app)
        token = CURRENT_REQUEST.set(in_app)
        state = {"status": 500, "streaming": False, "first": False}

        async def tracked_send(message: dict[str, Any]) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                state["status"] = int(message.get("status", 500))
                for name, value in message.get("headers") or ():
                    if name.lower() == b"content-type" and value.lower().startswith(b"text/event-stream"):
                        state["streaming"] = True
            elif kind == "http.response.body" and not state["first"] and message.get("body"):
                state["first"] = True
                if state["streaming"] or message.get("more_body", False):
                    req.first_token()
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except BaseException as exc:
            in_app.name()
            req.finish(exc)
            raise
        else:
            in_app.name()
            req.mark_outcome(outcome_of(state["status"]))
            req.finish()
        finally:
            CURRENT_REQUEST.reset(token)

    async def _metrics(self, send: Any) -> None:
        import anyio

        from collectors.tracking.metrics import metrics_response

        body, content_type = await anyio.to_thread.run_sync(metrics_response)  # reads files in multiprocess mode
        headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def edge_sampler(ratio: float, theirs: Any = None) -> Any:
    """FastAPI's ``exclude`` hook drawing the span sampling decision once per HTTP request, at the edge.

    True (no framework telemetry) for a request sampled out; the decision is left in the scope
    (:data:`TRACED_KEY`) for :class:`WrappedApp`. ``theirs``: the app's own hook, which still excludes
    what it excluded (the tracker then draws its own decision, as without FastAPI)."""

    def exclude(scope: Scope) -> bool:
        if theirs is not None and theirs(scope):
            return True
        if scope.get("type") != "http":
            return False  # websockets: not requests the tracker follows
        traced = ratio >= 1.0 or (ratio > 0.0 and random.random() < ratio) or sp.has_sampled_traceparent(scope.get("headers"))
        scope[TRACED_KEY] = traced
        return not traced

    exclude._llmdiag_edge_sampler = True  # type: ignore[attr-defined]
    return exclude


def sample_framework_spans(app: Any, ratio: float) -> bool:
    """Make FastAPI's own telemetry follow ``ratio`` when the global TracerProvider is the tracker's (see the
    module doc); True when it now does. An app without FastAPI's native telemetry is left as it is."""
    telemetry = getattr(app, "_telemetry", None)
    if not isinstance(telemetry, dict) or "exclude" not in telemetry or not sp.otlp_installed_here():
        return False
    theirs = telemetry.get("exclude")
    if not getattr(theirs, "_llmdiag_edge_sampler", False):
        telemetry["exclude"] = edge_sampler(ratio, theirs)
    return True


_TRACKER: Any = None


def _tracker(config: WrapConfig) -> Any:
    """One tracker per process, made on first use (after a fork: each worker its own)."""
    global _TRACKER
    if _TRACKER is None:
        from collectors.tracking.tracker import RequestTracker

        recorder: Any = config.recorder if config.recorder else False
        _TRACKER = RequestTracker(config.model, recorder=recorder, span_sample_ratio=config.span_sample_ratio)
        atexit.register(_TRACKER.close)  # a server run without lifespan events, or one that returns normally
    return _TRACKER


def install(config: WrapConfig) -> None:
    """Make every Starlette app this process serves answer through :class:`WrappedApp` (its outermost layer).

    Why ``__call__`` and not ``build_middleware_stack``: FastAPI overrides the latter, and both build the stack
    lazily on the first request; wrapping the stack the first call builds works for Starlette, FastAPI and their
    subclasses alike, after the app's own middleware is all added."""
    from starlette.applications import Starlette

    original = Starlette.__call__
    if getattr(original, "_llmdiag_wrapped", False):
        return

    async def __call__(self: Any, scope: Scope, receive: Any, send: Any) -> None:
        if self.middleware_stack is None:
            engine_locks.instrument_loaded_engines()  # the server's modules are imported by the time it serves
            tracker = _tracker(config)  # sets up OTLP export from the environment, if asked for
            sample_framework_spans(self, config.span_sample_ratio)  # at the lifespan's start: before any request
            self.middleware_stack = WrappedApp(self.build_middleware_stack(), tracker, config)
        await original(self, scope, receive, send)

    __call__._llmdiag_wrapped = True  # type: ignore[attr-defined]
    Starlette.__call__ = __call__  # type: ignore[method-assign]


def install_from_env() -> None:
    """The boot hook's entry: install when ``$LLMDIAG_WRAP`` holds a configuration; a bad one stops the process.

    Why stop rather than run untracked: the operator asked for tracking; a server that silently runs without
    it gives an incident with no data and no word why.
    """
    text = os.environ.get(ENV_CONFIG)
    if not text:
        return
    try:
        config = WrapConfig.from_env(text)
        install(config)
    except Exception as exc:
        print(f"diag wrap: cannot apply tracking in {sys.executable}: {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # at start-up an exception (SystemExit too) becomes a traceback and status 1: leave plainly
