"""The in-process request tracker: queue wait vs inference time for every request, with admission control.

Why: during an incident, "requests are slow" has two opposite causes -- a backlog (requests wait
for an inference slot; each inference is as fast as ever) and thrashing (no waiting, but every
inference crawls). Only the serving process knows when a request got its slot, so the tracker
marks three instants per request -- arrival, start (slot granted), finish -- and turns them into a
``RequestTiming`` record (flight recorder), Prometheus histograms, and optional OTel spans.

Usage in an ``async def`` FastAPI handler::

    tracker = RequestTracker(model="demo", admission=AdmissionConfig(max_concurrency=4, queue_size=32))

    @app.post("/v1/completions")
    async def complete(body: Body):
        async with tracker.request(route="/v1/completions") as req:
            await req.acquire()                  # wait for a slot; may raise AdmissionRejected
            req.set_prompt_tokens(len(tokens))
            out = await req.run(generate(...))   # enforces inference_timeout_s -> InferenceTimeout
            req.set_output_tokens(len(out))
            return {"text": ...}

In a worker thread (a ``def`` handler, a batcher thread)::

    with tracker.request(route="/x") as req:
        req.acquire_sync()
        for step in steps:
            req.check_deadline()                 # raises InferenceTimeout past inference_timeout_s
            ...

Streaming: call ``req.first_token()`` when the first token goes out (TTFT), and keep the ``with``
block open for the whole stream -- put it inside the response generator. ``tracker.request()``
marks arrival when *called*, so it can be created in the handler and entered in the generator.

Counting: every request is counted exactly once, when its ``with`` block ends, with one outcome
(``records.REQUEST_OUTCOMES``): ``ok``; ``rejected`` / ``queue_timeout`` / ``inference_timeout`` when
one of this request's own admission exceptions was raised (whether or not the handler caught it);
``error`` for any other exception leaving the block (including cancellation on client disconnect).
A request that never calls ``acquire()`` has no queue/inference split (``start`` None): only its
end-to-end time is observed.

What is observed per request (labels ``route``, ``model``): ``queue_wait`` for every request that
waited for a slot (granted, or ``queue_timeout`` -- the wait is the timeout, so a backlog is not
hidden by censoring); ``inference`` for requests that got a slot; ``e2e`` for every request except
``rejected`` ones (an instant 429 is not a latency sample of the service); ``ttft`` when
``first_token()`` was called; ``requests_total`` for every request.

Never into the app: failures of metrics, spans or the recorder are counted in
``llmdiag_tracker_errors_total{stage}`` and logged, never raised. Only the admission exceptions
(``AdmissionRejected``, ``QueueTimeout``, ``InferenceTimeout``) are raised, by the calls that
document them. Pass ``route`` as the route *template* ("/v1/models/{name}"), never the raw path:
it is a label; past 200 distinct routes new ones are folded into ``route="other"``.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import weakref
from collections.abc import Sequence
from os import PathLike
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from collectors.recorder import RecorderWriter
from collectors.records import BatchStats, CudaOomError, RoutingStats, TorchMemorySnapshot
from collectors.tracking import spans as sp
from collectors.tracking.admission import AdmissionConfig
from collectors.tracking.loader import TrackedLoader
from collectors.tracking.memory import MemoryProbe, MemoryReading
from collectors.tracking.queueing import AdmissionControl
from collectors.tracking.recording import MAX_ROUTES, OTHER_ROUTE, RequestRecorder
from collectors.tracking.request import TrackedRequest

__all__ = ["MAX_ROUTES", "OTHER_ROUTE", "RequestTracker", "TrackedRequest"]


class RequestTracker:
    """Per-model request tracking, admission control and in-process diagnostics (see the module doc).

    Two parts with one job each, both public: ``queueing`` (an :class:`AdmissionControl`: slots, the
    wait queue, the memory guard) and ``recording`` (a :class:`RequestRecorder`: metrics, spans, the
    flight recorder). The tracker wires them together and hands each request both. ``admission``
    is the :class:`AdmissionConfig` in force.

    Args:
        model: the ``model`` label and record field.
        recorder: flight-recorder path; ``None`` -> ``default_recorder_path()`` (``$LLMDIAG_RECORDER``);
            ``False`` -> no recorder; a ``RecorderWriter`` -> shared with its owner (not closed here).
            Records are queued in memory and written by a background thread: no disk I/O on the
            caller's thread.
        admission: what to enforce; the default enforces nothing (observe only).
        registry: prometheus_client registry; ``None`` -> the default REGISTRY. Trackers sharing a
            registry share metric families (distinguished by ``model``).
        tracer_provider: OTel TracerProvider; ``None`` -> the global one (configured from
            ``OTEL_EXPORTER_OTLP_ENDPOINT`` if set and nothing else configured it, see ``spans``).
        span_sample_ratio: share of requests (0..1) that get ``llm.queue`` / ``llm.inference`` spans
            when no ASGI middleware decided already; 0 disables our spans entirely.
        queue_span_min_s: a sampled request gets an ``llm.queue`` span when it waited at least this
            long between arrival and its slot (default 1 ms), or never got a slot; an instant grant
            gets only ``llm.inference`` (which always carries ``gen_ai.latency.time_in_queue``).
            A span costs ~150k CPU instructions, a wait of microseconds says nothing; 0 = always.
        provider_name: ``gen_ai.provider.name`` on our spans.
        memory_probe: a ``MemoryProbe`` (tests); default probes this process's cgroup/host.
    """

    def __init__(
        self,
        model: str,
        recorder: str | PathLike[str] | RecorderWriter | bool | None = None,
        admission: AdmissionConfig | None = None,
        registry: CollectorRegistry | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        span_sample_ratio: float = 1.0,
        *,
        provider_name: str = sp.DEFAULT_PROVIDER_NAME,
        queue_span_min_s: float = 0.001,
        memory_probe: MemoryProbe | None = None,
    ) -> None:
        if not 0.0 <= span_sample_ratio <= 1.0:
            raise ValueError("span_sample_ratio is between 0 and 1")
        self.model = model
        self.span_sample_ratio = float(span_sample_ratio)
        self.provider_name = provider_name
        self.tracer_provider = tracer_provider
        self.recording = RequestRecorder(
            model,
            recorder,
            registry,
            tracer_provider,
            provider_name=provider_name,
            queue_span_min_s=queue_span_min_s,
        )
        self.queueing = AdmissionControl(
            admission or AdmissionConfig(),
            memory_probe=memory_probe,
            on_reading=self._memory_reading,
            on_error=self.recording.error,
        )
        self.recording.admission_configured(self.queueing.config)
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (t := ref()) is not None and t._after_fork())

    @property
    def admission(self) -> AdmissionConfig:
        """The admission limits in force."""
        return self.queueing.config

    @property
    def queue_span_min_s(self) -> float:
        return self.recording.queue_span_min_s

    # ------------------------------------------------------------------ requests

    def request(self, route: str = "") -> TrackedRequest:
        """Start tracking one request: marks arrival now (or at the ASGI middleware, when installed)."""
        arrival = sp.CURRENT_ARRIVAL.get()
        if arrival is None or arrival.claimed:
            arrival = sp.Arrival(time.time(), time.perf_counter())
            traced = None
        else:
            traced = arrival.traced
        arrival.claimed = True
        self.queueing.opened(arrival)
        ratio = self.span_sample_ratio
        sampled = False
        ctx = None
        if ratio > 0.0:
            if traced is None:
                sampled = ratio >= 1.0 or random.random() < ratio
                if sampled:
                    ctx = otel_context.get_current()
            elif traced:
                ctx = sp.parent_context()
                sampled = ctx is not None
        return TrackedRequest(self.queueing, self.recording, route, arrival, sampled, ctx)

    def health(self) -> dict[str, Any]:
        """Readiness for a /health endpoint: ``status`` is ``degraded`` while new requests would be refused.

        Keys: status, model, pid, active_inference, queue_depth, max_concurrency, queue_size,
        accepting_new_requests, reasons (why not accepting), memory_used_percent (None when
        unknown), memory_used_bytes, memory_limit_bytes, memory_source, memory_psi_some_avg10,
        memory_error. Per process: with several workers each answers for itself.
        """
        admission = self.queueing
        config = admission.config
        reading = admission.reading()
        reasons: list[str] = []
        if admission.queue_full:
            reasons.append("queue_full")
        refusal = admission.refusal_at(reading) if admission.guard_enabled and reading is not None else None
        if refusal is not None:
            reasons.append(refusal[0])
        ratio = reading.used_ratio if reading is not None else None
        accepting = not reasons
        return {
            "status": "ok" if accepting else "degraded",
            "model": self.model,
            "pid": os.getpid(),
            "active_inference": admission.active,
            "queue_depth": admission.waiting,
            "max_concurrency": config.max_concurrency,
            "queue_size": config.queue_size,
            "accepting_new_requests": accepting,
            "reasons": reasons,
            "memory_used_percent": None if ratio is None else round(ratio * 100.0, 3),
            "memory_used_bytes": reading.used_bytes if reading else None,
            "memory_limit_bytes": reading.limit_bytes if reading else None,
            "memory_source": reading.source if reading else None,
            "memory_psi_some_avg10": reading.psi_some_avg10 if reading else None,
            "memory_error": reading.error if reading else "memory probe unavailable",
        }

    # ------------------------------------------------------------------ batches, routing, loaders, torch

    def record_batch(
        self,
        requests: int,
        input_tokens: int,
        max_request_tokens: int | None = None,
        active_decode_sequences: int = 0,
        concurrent_batches: int = 1,
        phase: str = "mixed",
    ) -> BatchStats | None:
        """Record one batch your batcher formed (see ``batches``). Returns the record, or None (and a
        counted ``batch`` error) when the numbers are impossible."""
        return self.recording.record_batch(
            requests, input_tokens, max_request_tokens, active_decode_sequences, concurrent_batches, phase
        )

    def record_routing(self, layer: int, expert_token_counts: Sequence[int], capacity: int | None = None) -> RoutingStats | None:
        """Record one MoE layer's routing step: top/median tokens, skew, balancedness, overflow (see
        ``batches``). Full counts go to the recorder only. None (and a counted error) on bad input."""
        return self.recording.record_routing(layer, expert_token_counts, capacity)

    def track_loader(self, name: str, bytes_read: int | None = None, cache_hit: bool | None = None) -> TrackedLoader:
        """Track a model load / registry refresh: a context manager (sync or async) or a decorator.

        The resulting ``LoaderEvent`` (``.event`` after the block) has ``in_request_path=True`` when
        the loader ran inside an in-flight request's arrival -> start window (see ``loader``).
        """
        return TrackedLoader(self.queueing, self.recording, name, bytes_read, cache_hit)

    def record_torch_memory(self, device: int = 0) -> TorchMemorySnapshot:
        """Snapshot ``torch.cuda.memory_stats(device)`` into the recorder and the torch gauges.

        Without torch/CUDA it returns an all-None snapshot and records nothing.
        """
        return self.recording.record_torch_memory(device)

    def record_cuda_oom(self, error: CudaOomError | str) -> CudaOomError | None:
        """Record a CUDA OOM (a parsed record or the exception's message). Returns the record, or None
        when the text is not a CUDA OOM message. Also snapshots torch memory when torch is present."""
        return self.recording.record_cuda_oom(error)

    def capture_cuda_oom(self) -> contextlib.AbstractContextManager[None]:
        """``with tracker.capture_cuda_oom(): ...``: record a CUDA OOM raised in the block, then re-raise it."""
        return self.recording.capture_cuda_oom()

    # ------------------------------------------------------------------ lifecycle

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every record submitted so far is in the flight recorder (tests, shutdown)."""
        return self.recording.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Flush the recorder and stop its threads (a ``RecorderWriter`` passed in is flushed, not closed)."""
        self.recording.close(timeout)

    @property
    def recorder(self) -> RecorderWriter | None:
        """The ``RecorderWriter`` behind this tracker (None without a recorder)."""
        return self.recording.writer

    # ------------------------------------------------------------------ wiring

    def _memory_reading(self, reading: MemoryReading, refused: bool) -> None:
        self.recording.memory_reading(reading, refused, self.queueing.guard_enabled)

    def _after_fork(self) -> None:
        """In a forked child (gunicorn --preload): fresh locks, queue and writer thread; the parent's are unusable."""
        self.queueing.after_fork()
        self.recording.after_fork()
