"""A sampled-out request costs nothing in OpenTelemetry: no span object, no sampler call, no context.

Why a test: the tracking-overhead benchmark (``bench/overhead.py``) prices spans at 10 % as one
tenth of a traced request; that only holds if the other nine tenths never reach the SDK. The
sampler below counts every span the SDK is asked to create (recording or not), so any span object
made for a sampled-out request -- even a non-recording one -- shows up as an extra call.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Sampler, SamplingResult
from prometheus_client import CollectorRegistry

from collectors.tracking import RequestTracker, instrument_fastapi


class CountingSampler(Sampler):
    """ALWAYS_ON that counts how many spans the SDK was asked to start."""

    def __init__(self) -> None:
        self.calls = 0

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        self.calls += 1
        return ALWAYS_ON.should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return "counting"


def _provider() -> tuple[TracerProvider, CountingSampler, InMemorySpanExporter]:
    sampler = CountingSampler()
    provider = TracerProvider(sampler=sampler)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, sampler, exporter


def test_tracker_alone_makes_spans_only_for_its_sampled_requests() -> None:
    provider, sampler, exporter = _provider()
    tracker = RequestTracker(
        model="m", recorder=False, registry=CollectorRegistry(), tracer_provider=provider, span_sample_ratio=0.3,
        queue_span_min_s=60.0,
    )  # fmt: skip
    unsampled_spans = []
    for _ in range(200):
        with tracker.request(route="/r") as req:
            req.acquire_sync()
            if not req.span.is_recording():
                unsampled_spans.append(req.span)
    tracker.close()
    exported = exporter.get_finished_spans()
    assert 0 < len(exported) < 200  # ~60 sampled; a fair draw essentially never leaves this range
    assert {s.name for s in exported} == {"llm.inference"}  # instant grants: no llm.queue
    assert sampler.calls == len(exported)  # not one SDK span start for the sampled-out requests
    # what a sampled-out request hands out is the API's shared invalid span, not a new object
    assert len(unsampled_spans) == 200 - len(exported)
    assert all(s is trace.INVALID_SPAN for s in unsampled_spans)


def test_under_the_middleware_sampled_out_requests_never_reach_the_sdk() -> None:
    provider, sampler, exporter = _provider()
    tracker = RequestTracker(  # no llm.queue span: a slow first request must not change the count
        model="m", recorder=False, registry=CollectorRegistry(), tracer_provider=provider, span_sample_ratio=0.3,
        queue_span_min_s=60.0,
    )  # fmt: skip
    app = FastAPI()

    @app.get("/r")
    async def r() -> dict[str, bool]:
        async with tracker.request(route="/r") as req:
            await req.acquire()
            return {"recording": req.span.is_recording()}

    instrument_fastapi(app, tracker)

    async def main() -> list[bool]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.get("/r")).json()["recording"] for _ in range(200)]

    recording = asyncio.run(main())
    tracker.close()
    exported = exporter.get_finished_spans()
    traced = sum(recording)
    assert 0 < traced < 200
    # every traced request: one server span + one llm.inference span; the others: none
    assert sorted({s.name for s in exported}) == ["GET /r", "llm.inference"]
    assert len(exported) == 2 * traced
    assert sampler.calls == 2 * traced
