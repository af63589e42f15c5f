"""FastAPI / ASGI integration: OTel server spans, edge sampling, arrival time, admission responses.

``instrument_fastapi(app, tracker)`` does four things, and costs ~nothing for sampled-out requests:

1. ``FastAPIInstrumentor.instrument_app(app, exclude_spans=["send", "receive"])``: one server span
   per traced request (the default would add 2+ internal spans per request for the ASGI send and
   receive events; measured at 0.42-0.48x bare throughput with wrk on the demo endpoint).
2. A pure ASGI middleware (never ``@app.middleware("http")``: BaseHTTPMiddleware alone costs 35-40 %
   of throughput) in front of it that, per HTTP request:
   - draws the sampling decision (``random() < span_sample_ratio``; a request arriving with a
     sampled W3C ``traceparent`` is always traced). Sampled-out requests bypass the OTel middleware
     entirely -- they run through the very same inner middleware stack, just without OTel around
     it -- so they pay no span, context or attribute cost. The tracker follows the decision: its
     ``llm.queue`` / ``llm.inference`` spans exist exactly for traced requests, as children of the
     server span;
   - marks the request's arrival (before body parsing, dependencies and the handler), which
     ``tracker.request()`` adopts, so the queue wait includes time stuck before the handler ran.
     (Only requests that reach ``tracker.request()`` count for loader detection: a /metrics scrape
     in flight must not make a background refresh look like it is on the request path.)
3. Exception handlers that turn ``AdmissionRejected`` / ``QueueTimeout`` / ``InferenceTimeout``
   into JSON responses with their status (429 / 503 / 504) and ``Retry-After``.
4. Optionally, ``metrics_path`` (Prometheus exposition, multiprocess-aware) and ``health_path``
   (``tracker.health()``; HTTP 503 while degraded) routes.

Call it once, before the app serves its first request (Starlette builds the middleware stack then).
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any

from opentelemetry import trace

from collectors.tracking import spans as sp
from collectors.tracking.admission import AdmissionRejected, InferenceTimeout
from collectors.tracking.metrics import metrics_response
from collectors.tracking.tracker import RequestTracker

log = logging.getLogger(__name__)

Scope = dict[str, Any]


def _has_sampled_traceparent(scope: Scope) -> bool:
    for name, value in scope.get("headers") or ():
        if name == b"traceparent":
            # version-traceid-spanid-flags; bit 0 of flags = sampled
            parts = value.split(b"-")
            if len(parts) >= 4 and len(parts[3]) >= 2:
                try:
                    return bool(int(parts[3][:2], 16) & 1)
                except ValueError:
                    return False
            return False
    return False


class TrackingMiddleware:
    """Pure ASGI middleware: edge sampling + arrival marking (see the module doc).

    ``traced_app`` is the stack wrapped by OpenTelemetry, ``bare_app`` the same stack without it
    (``bare_app`` None: everything goes through ``traced_app``).
    """

    def __init__(self, traced_app: Any, bare_app: Any, tracker: RequestTracker, ratio: float) -> None:
        self.traced_app = traced_app
        self.bare_app = bare_app if bare_app is not None else traced_app
        self.tracker = tracker
        self.ratio = ratio

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.traced_app(scope, receive, send)
            return
        ratio = self.ratio
        traced = ratio >= 1.0 or (ratio > 0.0 and random.random() < ratio) or _has_sampled_traceparent(scope)
        arrival = sp.Arrival(time.time(), time.perf_counter(), traced)
        token = sp.CURRENT_ARRIVAL.set(arrival)
        try:
            await (self.traced_app if traced else self.bare_app)(scope, receive, send)
        finally:
            arrival.started = True
            sp.CURRENT_ARRIVAL.reset(token)


def _retry_after(seconds: float | None) -> dict[str, str]:
    if seconds is None:
        return {}
    return {"Retry-After": str(max(0, math.ceil(seconds)))}


def install_exception_handlers(app: Any) -> None:
    """Map the tracker's admission exceptions to responses: 429/503 with Retry-After, 504."""
    from starlette.responses import JSONResponse

    async def admission_handler(request: Any, exc: Exception) -> Any:
        status = getattr(exc, "status_code", 503)
        body = {
            "error": getattr(exc, "reason", "rejected"),
            "outcome": getattr(exc, "outcome", "rejected"),
            "detail": str(exc),
        }
        return JSONResponse(body, status_code=status, headers=_retry_after(getattr(exc, "retry_after_s", None)))

    app.add_exception_handler(AdmissionRejected, admission_handler)
    app.add_exception_handler(InferenceTimeout, admission_handler)


def instrument_fastapi(
    app: Any,
    tracker: RequestTracker,
    span_sample_ratio: float | None = None,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: Any = None,
    exception_handlers: bool = True,
    metrics_path: str | None = None,
    health_path: str | None = None,
    registry: Any = None,
) -> None:
    """Instrument a FastAPI app for ``tracker`` (see the module doc).

    Args:
        span_sample_ratio: share of requests traced (server span + ``llm.*`` spans); default: the
            tracker's ``span_sample_ratio``. 0 traces nothing except requests with a sampled
            ``traceparent``.
        tracer_provider: for the server span; default: the tracker's (else the global one).
        meter_provider: passed to FastAPIInstrumentor (its ``http.server.*`` metrics); default: global.
        exception_handlers: install the 429/503/504 handlers.
        metrics_path / health_path: add those routes when given (e.g. "/metrics", "/health").
        registry: the registry ``metrics_path`` renders (default REGISTRY / multiprocess merge).
    """
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    ratio = tracker.span_sample_ratio if span_sample_ratio is None else float(span_sample_ratio)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError("span_sample_ratio is between 0 and 1")
    if getattr(app, "_llmdiag_instrumented", False):
        log.warning("instrument_fastapi: app already instrumented; ignoring the second call")
        return
    app._llmdiag_instrumented = True
    if exception_handlers:
        install_exception_handlers(app)
    if metrics_path:
        _add_metrics_route(app, metrics_path, registry)
    if health_path:
        _add_health_route(app, health_path, tracker)
    provider = tracer_provider or tracker.tracer_provider
    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=provider,
        meter_provider=meter_provider,
        exclude_spans=["send", "receive"],
    )
    otel_build = app.build_middleware_stack

    def build_middleware_stack() -> Any:
        outer = otel_build()
        bare = _inner_of(outer)
        if bare is None:
            log.warning("unexpected OpenTelemetry middleware layout: every request goes through OTel (ratio via sampler)")
        return TrackingMiddleware(outer, bare, tracker, ratio)

    app.build_middleware_stack = build_middleware_stack
    app.middleware_stack = None  # rebuilt on the next request/startup


def _inner_of(outer: Any) -> Any | None:
    """The stack inside the OTel middleware: ServerErrorMiddleware(OpenTelemetryMiddleware(inner))."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    node = outer
    for _ in range(3):
        if isinstance(node, OpenTelemetryMiddleware):
            return node.app
        node = getattr(node, "app", None)
        if node is None:
            return None
    return None


def _add_metrics_route(app: Any, path: str, registry: Any) -> None:
    from starlette.responses import Response

    def metrics_endpoint() -> Any:  # sync: Starlette runs it in a thread (multiprocess mode reads files)
        body, content_type = metrics_response(registry)
        return Response(body, media_type=content_type)

    app.add_api_route(path, metrics_endpoint, methods=["GET"], include_in_schema=False)


def _add_health_route(app: Any, path: str, tracker: RequestTracker) -> None:
    from starlette.responses import JSONResponse

    def health_endpoint() -> Any:
        health = tracker.health()
        return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)

    app.add_api_route(path, health_endpoint, methods=["GET"], include_in_schema=False)
