"""The FastAPI app of the reference backend -- and the worked example of instrumenting one with llm-diag.

What to copy into your own server (each marked ``# llm-diag:`` below):
1. one ``RequestTracker`` per model per process, with the admission limits you want enforced;
2. ``instrument_fastapi(app, tracker, metrics_path=..., health_path=...)``: arrival time at the edge,
   429/503/504 responses with ``Retry-After``, ``/metrics`` summed over workers, ``/healthz``;
3. in the handler: ``async with tracker.request(route=...) as req`` around *everything* the request
   does, ``await req.acquire()`` right before the model work, ``await req.run(...)`` around it;
4. ``tracker.record_batch`` / ``record_routing`` from the batcher, ``tracker.track_loader`` around loads.

Endpoints: ``POST /v1/completions`` (OpenAI-style ``{"prompt", "max_tokens"}``), ``GET /healthz``
(503 while the tracker would refuse new work), ``GET /metrics`` -- and, when several dialects are served
(``--metrics-dialect vllm,tgi``, or ``llmdiag,vllm``: the tracker's at /metrics), ``GET /metrics/<dialect>`` for each
engine's.

Status codes: 413 for a prompt over ``max_prompt_tokens`` and 400 for ``max_tokens`` over
``max_output_tokens`` (both raised inside the tracked block, so they are counted, as ``error``);
429 (queue full) and 503 (memory guard, queue timeout) from admission, with ``Retry-After``; 504 when
inference exceeds the request timeout. Prompts and completions never reach a log or a record: only
their token counts do.

Each worker writes one ``ServiceConfig`` record at start-up (its settings, the checkpoint's size and
path), so the rules can judge the configuration that produced an incident.

The deliberate failure mode ``--leak-kib-per-request N`` (off by default) retains N KiB of touched
memory per successful request for the life of the worker -- a real leak, for the leak scenario.

The deliberate failure mode ``--refresh every-request`` re-reads the checkpoint *synchronously on
the event loop* inside the request, before it asks for a slot -- exactly the blocking-loader bug,
so the LoaderEvents land in the request's arrival -> start window.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Response
from pydantic import BaseModel, ConfigDict, Field

from collectors.records import ServiceConfig
from collectors.tracking import AdmissionConfig, RequestTracker, instrument_fastapi
from collectors.tracking.metrics import mark_own_process_dead
from collectors.tracking.spans import otlp_endpoint_configured
from diag.demo.batcher import Batcher
from diag.demo.dialects import OURS, DialectMetrics, Served
from diag.demo.kvcache import KvBudget
from diag.demo.model import ByteTokenizer
from diag.demo.settings import DemoSettings
from diag.demo.weights import WeightRegistry

ROUTE = "/v1/completions"


class CompletionRequest(BaseModel):
    """The OpenAI completions body, reduced to what the demo uses (other fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    prompt: str
    max_tokens: int = Field(16, ge=1)


def build_tracker(settings: DemoSettings) -> RequestTracker:
    """The tracker as ``diag demo serve`` configures it from its flags."""
    admission = AdmissionConfig(
        max_concurrency=settings.max_concurrency,
        queue_size=settings.queue_size,
        queue_timeout_s=settings.queue_timeout_s,
        inference_timeout_s=settings.request_timeout_s,
        memory_high_watermark=settings.memory_guard,
        psi_memory_some_avg10=settings.psi_guard,
    )
    uninstrumented = settings.metrics_dialect != OURS  # an engine's /metrics only: nothing of ours is recorded
    recorder: Any = False if settings.recorder is None or uninstrumented else (settings.recorder or None)
    # Spans only when someone collects them: without an OTLP endpoint they would be no-ops anyway.
    ratio = 1.0 if otlp_endpoint_configured() else 0.0
    return RequestTracker(model=settings.model_name, recorder=recorder, admission=admission, span_sample_ratio=ratio)


def service_config(settings: DemoSettings, weights_bytes: int | None, experts: int) -> ServiceConfig:
    """The ``ServiceConfig`` record of this worker (the keys ``collectors.records.ServiceConfig`` documents)."""
    return ServiceConfig(
        ts=time.time(),
        service=settings.model_name,
        pid=os.getpid(),
        settings={
            "workers": settings.workers,
            "max_concurrency": settings.max_concurrency,
            "queue_size": settings.queue_size,
            "queue_timeout_s": settings.queue_timeout_s,
            "request_timeout_s": settings.request_timeout_s,
            "preload": settings.preload,
            "refresh": settings.refresh,
            "max_prompt_tokens": settings.max_prompt_tokens,
            "max_output_tokens": settings.max_output_tokens,
            "memory_guard": settings.memory_guard,
            "batching": settings.batching,
            "max_batch_requests": settings.max_batch_requests,
            "max_batch_tokens": settings.max_batch_tokens,
            "weights_bytes": weights_bytes,
            "model_path": settings.weights_path,
            "experts": experts,
            "router_skew": settings.router_skew,
            "expert_capacity_factor": settings.expert_capacity_factor,
        },
    )


class _Leak:
    """The leak bug: memory retained per request and never released (a list that only grows)."""

    def __init__(self, kib: int) -> None:
        self.chunk = b"\x5a" * (kib * 1024)  # written bytes: the pages are really resident
        self.kept: list[bytearray] = []

    def retain(self) -> None:
        if self.chunk:
            self.kept.append(bytearray(self.chunk))


def create_app(settings: DemoSettings, tracker: RequestTracker | None = None) -> FastAPI:
    """Build the app. Weights load and the batcher starts in the lifespan (i.e. in the worker process)."""
    if not settings.weights_path:
        raise ValueError("settings.weights_path is empty: generate the checkpoint first (diag.demo.server)")
    tracker = tracker or build_tracker(settings)  # llm-diag: one tracker per model per process
    tokenizer = ByteTokenizer()
    parts: dict[str, Any] = {}
    leak = _Leak(settings.leak_kib_per_request)
    kv = KvBudget(settings.kv_tokens)
    dialect = None
    engines = settings.engine_dialects
    if engines:  # with the tracker's first, the engines' families are served beside it (at /metrics/<dialect> only)
        dialect = DialectMetrics(engines[0], settings.model_name, kv,
                                 max_prompt_tokens=settings.max_prompt_tokens or settings.max_batch_tokens,
                                 max_output_tokens=settings.max_output_tokens,
                                 running=lambda: parts["batcher"].running if "batcher" in parts else 0,
                                 also=engines[1:])  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # llm-diag: every load goes through track_loader (the start-up one is not on a request path).
        registry = WeightRegistry(
            settings.weights_path,
            mode=settings.preload,  # type: ignore[arg-type]
            refresh=settings.refresh,  # type: ignore[arg-type]
            ttl_s=settings.refresh_ttl_s,
            loader_hook=tracker.track_loader,
        )
        batcher = Batcher(
            lambda: registry.current,
            mode=settings.batching,  # type: ignore[arg-type]
            max_batch_requests=settings.max_batch_requests,
            max_batch_tokens=settings.max_batch_tokens,
            batch_wait_s=settings.batch_wait_s,
            router_skew=settings.router_skew,
            capacity_factor=settings.expert_capacity_factor,
            on_batch=tracker.record_batch,  # llm-diag: one BatchStats per formed batch
            on_routing=tracker.record_routing,  # llm-diag: real per-expert token counts
            kv=kv,
            kv_enforced=settings.kv_cache_tokens > 0,  # the default budget only reports usage
            min_step_s=settings.min_step_s,
        )
        batcher.start()
        parts["registry"], parts["batcher"] = registry, batcher
        writer = tracker.recorder  # llm-diag: one ServiceConfig per worker, so the rules can judge the settings
        if writer is not None:
            current = registry.current
            writer.submit(service_config(settings, current.file_bytes, current.config.experts))
        try:
            yield
        finally:
            batcher.stop()
            registry.close()
            tracker.close()  # flushes the flight recorder
            mark_own_process_dead()

    app = FastAPI(title="llm-diag demo backend", lifespan=lifespan)
    app.state.tracker = tracker
    app.state.parts = parts

    @app.post(ROUTE)
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        if dialect is not None:
            return await _as_engine(body, dialect)
        return await _serve(body)

    async def _as_engine(body: CompletionRequest, metrics: DialectMetrics) -> dict[str, Any]:
        """The request timed as the engine's own metrics time it: WAITING from arrival until first scheduled into a
        running batch (a slot, the batch queue, free KV blocks), RUNNING from then to its last token."""
        t = {"arrival": time.monotonic()}
        metrics.arrived()

        def first_token() -> None:
            t.setdefault("first", time.monotonic())

        def scheduled() -> None:
            t.setdefault("start", time.monotonic())

        try:
            out = await _serve(body, on_scheduled=scheduled, on_first_token=first_token)
        except BaseException as exc:
            refused = getattr(exc, "status_code", None) in (429, 503) or type(exc).__name__ == "AdmissionRejected"
            metrics.left(refused=refused and "start" not in t, failed=True)
            raise
        end = time.monotonic()
        start, first = t.get("start", t["arrival"]), t.get("first", end)
        metrics.finished(Served(
            prompt_tokens=out["usage"]["prompt_tokens"], output_tokens=out["usage"]["completion_tokens"],
            queue_s=start - t["arrival"], ttft_s=first - t["arrival"], e2e_s=end - t["arrival"],
            inference_s=end - start, prefill_s=first - start, decode_s=end - first,
        ))  # fmt: skip
        return out

    async def _serve(body: CompletionRequest, on_scheduled: Any = None, on_first_token: Any = None) -> dict[str, Any]:
        registry: WeightRegistry = parts["registry"]
        batcher: Batcher = parts["batcher"]
        async with tracker.request(route=ROUTE) as req:  # llm-diag: everything the request does, inside
            n = tokenizer.count(body.prompt)
            req.set_prompt_tokens(n)
            if settings.max_prompt_tokens is not None and n > settings.max_prompt_tokens:
                raise HTTPException(413, f"prompt is {n} tokens; this server accepts {settings.max_prompt_tokens}")
            if body.max_tokens > settings.max_output_tokens:
                raise HTTPException(400, f"max_tokens {body.max_tokens} is over the limit of {settings.max_output_tokens}")
            registry.for_request()  # --refresh every-request: a blocking re-read right here (the bug)
            await req.acquire()  # llm-diag: the slot; AdmissionRejected -> 429/503 via the installed handler
            ids = tokenizer.encode(body.prompt)

            def first() -> None:
                req.first_token()
                if on_first_token is not None:
                    on_first_token()

            done = await req.run(batcher.submit(ids, body.max_tokens, on_first_token=first, on_scheduled=on_scheduled))
            req.set_output_tokens(len(done.ids))
        leak.retain()  # --leak-kib-per-request: the deliberate bug (a no-op when 0)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": settings.model_name,
            "choices": [{"index": 0, "text": tokenizer.decode(done.ids), "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": n, "completion_tokens": len(done.ids), "total_tokens": n + len(done.ids)},
            "system_fingerprint": f"pid-{os.getpid()}",
        }

    # llm-diag: edge arrival time, 429/503/504 handlers, /metrics (summed over workers), /healthz. After the
    # completions route: Starlette tries routes in order, so routes added first would be matched (and missed)
    # on every completion request before its own.
    ours = settings.metrics_dialect == OURS
    instrument_fastapi(app, tracker, metrics_path="/metrics" if ours else None, health_path="/healthz")
    if dialect is not None and not ours:  # the engine's own /metrics, from this worker's live state

        @app.get("/metrics")
        async def engine_metrics() -> Response:
            return Response(dialect.render(), media_type=EXPOSITION_TYPE)

    if dialect is not None and settings.also_metrics_dialects:  # every engine's dialect at its own path, the first too
        for name in dialect.exported:
            app.add_api_route(f"/metrics/{name}", _exposition_of(dialect, name), methods=["GET"])

    return app


EXPOSITION_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _exposition_of(metrics: DialectMetrics, dialect: str) -> Callable[[], Awaitable[Response]]:
    """The route serving ``dialect``'s exposition of ``metrics`` (a closure per dialect, not one over a loop variable)."""

    async def exposition() -> Response:
        return Response(metrics.render(dialect), media_type=EXPOSITION_TYPE)

    return exposition


def create_app_from_env() -> FastAPI:
    """uvicorn factory for spawned workers: settings come from ``LLMDIAG_DEMO_SETTINGS``."""
    return create_app(DemoSettings.from_env())
