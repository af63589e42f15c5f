"""OpenTelemetry spans of the tracker (``llm.queue``, ``llm.inference``), sampling, and OTLP set-up.

Spans per sampled request: ``llm.queue`` (arrival -> slot granted, or -> refusal) and
``llm.inference`` (slot granted -> end), both children of the current span at arrival -- under
``instrument_fastapi`` that is the FastAPI server span. ``llm.queue`` is recorded when the request
waited at least ``queue_span_min_s`` (1 ms by default) or never got a slot; an instant grant has
only ``llm.inference``, whose ``gen_ai.latency.time_in_queue`` (vLLM's name) always says how long
the request waited.

Both carry the GenAI semantic-convention attributes ``gen_ai.operation.name``
(``text_completion``), ``gen_ai.provider.name`` (``llm-diag`` unless configured) and
``gen_ai.request.model``; ``llm.inference`` adds ``gen_ai.usage.input_tokens`` /
``output_tokens``, ``gen_ai.latency.time_in_queue``, ``gen_ai.latency.time_to_first_token`` (when
streamed), ``llm_diag.route`` and ``llm_diag.outcome`` (plus ``error.type`` and an ERROR status when
the outcome is not ``ok``). A refused or timed-out request has only ``llm.queue``, with the same
outcome attributes.

Sampling is decided **once per request, at the edge**, and a sampled-out request costs nothing in
OpenTelemetry: under ``instrument_fastapi`` the ASGI middleware draws ``random() < ratio`` before
OTel sees the request and sends sampled-out requests around the OTel middleware entirely (no
server span, no context, no attributes); the tracker then creates no ``llm.*`` spans either.
Requests that arrive with a W3C ``traceparent`` whose sampled flag is set always get the server
span, so a caller's distributed trace is not cut (they get ``llm.*`` spans too unless the tracker's
``span_sample_ratio`` is 0, which means "no llm.* spans, ever"). Without the middleware,
``RequestTracker`` draws with its own ``span_sample_ratio`` at arrival. The TracerProvider's own
sampler still applies on top.

Export: spans go to whatever TracerProvider you give the tracker (or the global one). If no
provider is configured and ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
is set, :func:`configure_otlp_from_env` installs a global SDK ``TracerProvider`` with a
``BatchSpanProcessor(OTLPSpanExporter())`` (OTLP over HTTP/protobuf, e.g.
``OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318``); the resource comes from ``OTEL_SERVICE_NAME``
/ ``OTEL_RESOURCE_ATTRIBUTES`` and the sampler from ``OTEL_TRACES_SAMPLER`` as usual.
``OTEL_SDK_DISABLED=true`` turns it off. Nothing else is started implicitly.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

log = logging.getLogger(__name__)

TRACER_NAME = "llm-diag.tracking"
SPAN_QUEUE = "llm.queue"
SPAN_INFERENCE = "llm.inference"
DEFAULT_PROVIDER_NAME = "llm-diag"
OPERATION_NAME = "text_completion"

ATTR_OPERATION = "gen_ai.operation.name"
ATTR_PROVIDER = "gen_ai.provider.name"
ATTR_MODEL = "gen_ai.request.model"
ATTR_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_TTFT = "gen_ai.latency.time_to_first_token"
ATTR_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
ATTR_ROUTE = "llm_diag.route"
ATTR_OUTCOME = "llm_diag.outcome"
ATTR_ERROR_TYPE = "error.type"


class Arrival:
    """When a request reached the server, and whether it is traced.

    Created by the ASGI middleware (earliest point we can see) or by the tracker itself. ``traced``
    None means "no edge decision: let the tracker draw". ``started`` flips when the request gets a
    slot (or ends); while False, the request sits in its arrival -> start window (loaders check it).
    ``claimed``: a TrackedRequest took this arrival over. A slotted class: one is made per request.
    """

    __slots__ = ("claimed", "mono", "started", "traced", "wall")

    def __init__(self, wall: float, mono: float, traced: bool | None = None) -> None:
        self.wall = wall
        self.mono = mono
        self.traced = traced
        self.started = False
        self.claimed = False


# The current request's edge arrival (set by the ASGI middleware for the duration of the request).
CURRENT_ARRIVAL: contextvars.ContextVar[Arrival | None] = contextvars.ContextVar("llmdiag_arrival", default=None)


def gen_ai_attributes(model: str, provider_name: str) -> dict[str, Any]:
    """The attributes both spans start with. Kept short on purpose: every attribute is validated and
    copied by the SDK (~4k instructions each), and the route is already on the server span."""
    return {ATTR_OPERATION: OPERATION_NAME, ATTR_PROVIDER: provider_name, ATTR_MODEL: model}


def parent_context() -> otel_context.Context | None:
    """The current context if it carries a recording span, else None (a sampled-out request)."""
    if trace.get_current_span().is_recording():
        return otel_context.get_current()
    return None


def has_sampled_traceparent(headers: Any) -> bool:
    """Whether ASGI ``headers`` carry a W3C ``traceparent`` whose sampled flag is set: the caller traces this
    request, so it is traced here too whatever our own ratio draws (a distributed trace is not cut)."""
    for name, value in headers or ():
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


def trace_id_hex(span: Any) -> str | None:
    try:
        ctx = span.get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid else None
    except Exception:
        return None


# --------------------------------------------------------------------------- OTLP from the environment

_OTLP_LOCK = threading.Lock()
_OTLP_DONE = False


def otlp_installed_here() -> bool:
    """Whether :func:`configure_otlp_from_env` installed the global TracerProvider (not the application)."""
    return _OTLP_DONE


def otlp_endpoint_configured() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure_otlp_from_env() -> bool:
    """Install a global SDK TracerProvider exporting over OTLP/HTTP if the environment asks for one.

    Does nothing (returns False) when no OTLP endpoint variable is set, when ``OTEL_SDK_DISABLED``
    is true, or when the application already set a global TracerProvider -- the application's
    choice always wins. Idempotent and never raises.
    """
    global _OTLP_DONE
    if not otlp_endpoint_configured() or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    with _OTLP_LOCK:
        if _OTLP_DONE:
            return True
        current = trace.get_tracer_provider()
        if not isinstance(current, trace.ProxyTracerProvider):
            return False
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            resource = Resource.create({} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "llm-diag"})
            provider = TracerProvider(resource=resource)
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            trace.set_tracer_provider(provider)
        except Exception as exc:  # a broken exporter install must not take the app down
            log.warning("could not configure OTLP tracing from the environment: %s", exc)
            return False
        _OTLP_DONE = True
        return True
