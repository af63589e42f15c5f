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

import asyncio
import contextlib
import inspect
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Awaitable, Sequence
from os import PathLike
from typing import Any, NoReturn, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry

from collectors import catalog
from collectors.recorder import RecorderWriter, default_recorder_path
from collectors.records import (
    BatchStats,
    CudaOomError,
    LoaderEvent,
    Record,
    RequestOutcome,
    RequestTiming,
    RoutingStats,
    TorchMemorySnapshot,
)
from collectors.tracking import spans as sp
from collectors.tracking.admission import (
    AdmissionConfig,
    AdmissionRejected,
    InferenceTimeout,
    QueueFull,
    QueueTimeout,
    SlotPool,
)
from collectors.tracking.batches import batch_stats, routing_stats
from collectors.tracking.buffer import RecordBuffer, request_row
from collectors.tracking.loader import TrackedLoader
from collectors.tracking.memory import MemoryProbe, MemoryReading
from collectors.tracking.metrics import RequestSeries, TrackerMetrics, metrics_for
from collectors.tracking.torch_memory import capture_cuda_oom, parse_cuda_oom_message, torch_memory_snapshot

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_ROUTES = 200
OTHER_ROUTE = "other"

_PENDING, _STARTED, _FINISHED = 0, 1, 2


class TrackedRequest:
    """One request between arrival and finish. Use it as ``with`` / ``async with`` (see the module doc)."""

    __slots__ = (
        "_arrival",
        "_ctx",
        "_deadline",
        "_first_mono",
        "_holds_slot",
        "_inference_span",
        "_outcome",
        "_sampled",
        "_series",
        "_start_mono",
        "_state",
        "_tracker",
        "output_tokens",
        "prompt_tokens",
        "route",
    )

    def __init__(self, tracker: RequestTracker, route: str, arrival: sp.Arrival, sampled: bool, ctx: Any) -> None:
        self._tracker = tracker
        self.route = route
        self._series = tracker._series_for(route)
        self._arrival = arrival
        self._sampled = sampled
        self._ctx = ctx
        self._state = _PENDING
        self._holds_slot = False
        self._start_mono: float | None = None
        self._first_mono: float | None = None
        self._deadline: float | None = None
        self._outcome: RequestOutcome | None = None
        self._inference_span: Any = None
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> TrackedRequest:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.finish(exc)

    async def __aenter__(self) -> TrackedRequest:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.finish(exc)

    # ------------------------------------------------------------------ admission

    async def acquire(self) -> None:
        """Wait (asynchronously) for an inference slot; marks the start of inference.

        Raises :class:`AdmissionRejected` (429 queue full, 503 memory guard) or :class:`QueueTimeout`
        (503, after ``queue_timeout_s``). Calling it again after a grant is a no-op.
        """
        waiter = self._admit(asyncio.get_running_loop())
        if waiter is None:
            return
        if not await self._tracker._pool.wait_async(waiter, self._tracker.admission.queue_timeout_s):
            self._queue_timeout()
        self._mark_start()

    def acquire_sync(self) -> None:
        """Thread-side :meth:`acquire`: blocks this thread (never call it on the event loop)."""
        waiter = self._admit(None)
        if waiter is None:
            return
        if not self._tracker._pool.wait_sync(waiter, self._tracker.admission.queue_timeout_s):
            self._queue_timeout()
        self._mark_start()

    def _admit(self, loop: asyncio.AbstractEventLoop | None) -> Any:
        """Everything :meth:`acquire` and :meth:`acquire_sync` do before waiting.

        Returns the pool's waiter to wait on, or None when there is nothing to wait for: the request
        already started (or finished: raises), or it took a free slot. Raises the memory-guard and
        queue-full refusals.
        """
        if self._state != _PENDING:
            self._check_not_finished()
            return None
        tracker = self._tracker
        if tracker._guard_on:
            tracker._check_memory(self)
        pool = tracker._pool
        if pool.try_acquire():
            self._mark_start()
            return None
        series = self._series
        try:
            waiter = pool.enqueue(loop, series.queued, series.dequeued)  # the pool counts depth
        except QueueFull:
            self._reject("queue_full", 429, "the wait queue is full")
        if waiter is None:
            self._mark_start()
        return waiter

    async def run(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` as this request's inference, enforcing ``inference_timeout_s``.

        Acquires a slot first if :meth:`acquire` was not called. On timeout the awaitable is
        cancelled and :class:`InferenceTimeout` (504) is raised.
        """
        try:
            if self._state == _PENDING:
                await self.acquire()
            self._check_not_finished()
        except BaseException:
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never started: avoid "coroutine was never awaited"
            raise
        if self._deadline is None:
            return await awaitable
        remaining = self._deadline - time.perf_counter()
        if remaining <= 0:
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            self._inference_timeout()
        timeout = asyncio.timeout(remaining)
        try:
            async with timeout:
                return await awaitable
        except TimeoutError:
            if timeout.expired():
                self._inference_timeout()
            raise

    def check_deadline(self) -> None:
        """Raise :class:`InferenceTimeout` if the inference budget is spent (call it between steps)."""
        if self._deadline is not None and time.perf_counter() > self._deadline:
            self._inference_timeout()

    @property
    def remaining_s(self) -> float | None:
        """Seconds left of the inference budget (None: no budget or not started)."""
        return None if self._deadline is None else self._deadline - time.perf_counter()

    # ------------------------------------------------------------------ annotations

    def set_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens = int(n)

    def set_output_tokens(self, n: int) -> None:
        self.output_tokens = int(n)

    def first_token(self) -> None:
        """Mark the first streamed token (only the first call counts)."""
        if self._first_mono is None:
            self._first_mono = time.perf_counter()

    @property
    def outcome(self) -> RequestOutcome | None:
        """The outcome once decided (admission exceptions decide it early), else None."""
        return self._outcome

    @property
    def span(self) -> Any:
        """The live ``llm.inference`` span (a non-recording span when not sampled or not started)."""
        return self._inference_span if self._inference_span is not None else trace.INVALID_SPAN

    def inference_context(self) -> otel_context.Context:
        """An OTel context whose current span is ``llm.inference``: parent your own spans with it."""
        return trace.set_span_in_context(self.span, self._ctx or otel_context.get_current())

    # ------------------------------------------------------------------ internals

    def _check_not_finished(self) -> None:
        if self._state == _FINISHED:
            raise RuntimeError("this request has already finished")

    def _reject(self, reason: str, status: int, detail: str) -> NoReturn:
        self._outcome = "rejected"
        tracker = self._tracker
        try:
            self._series.rejected(reason)
        except Exception:
            tracker._error("metrics")
        raise AdmissionRejected(reason, status, tracker.admission.retry_after_s, detail)

    def _queue_timeout(self) -> NoReturn:
        self._outcome = "queue_timeout"
        try:
            self._series.rejected("queue_timeout")
        except Exception:
            self._tracker._error("metrics")
        waited = time.perf_counter() - self._arrival.mono
        raise QueueTimeout(waited, self._tracker.admission.retry_after_s)

    def _inference_timeout(self) -> NoReturn:
        self._outcome = "inference_timeout"
        raise InferenceTimeout(self._tracker.admission.inference_timeout_s or 0.0)

    def _mark_start(self) -> None:
        now = time.perf_counter()
        self._start_mono = now
        self._state = _STARTED
        self._holds_slot = True
        if self._outcome is not None:  # refused earlier, caught by the handler, and admitted on a retry
            self._outcome = None
        tracker = self._tracker
        budget = tracker.admission.inference_timeout_s
        if budget is not None:
            self._deadline = now + budget
        arrival = self._arrival
        arrival.started = True
        tracker._pending.pop(id(arrival), None)
        try:
            self._series.started()
            if self._sampled:
                self._start_spans(now)
        except Exception:
            tracker._error("metrics")

    def _start_spans(self, start_mono: float) -> None:
        tracker = self._tracker
        arrival = self._arrival
        try:
            start_ns = int((arrival.wall + (start_mono - arrival.mono)) * 1e9)
            attrs = tracker._span_attrs
            if start_mono - arrival.mono >= tracker.queue_span_min_s:
                queue = tracker._tracer.start_span(
                    sp.SPAN_QUEUE, context=self._ctx, start_time=int(arrival.wall * 1e9), attributes=attrs
                )
                queue.end(end_time=start_ns)
            self._inference_span = tracker._tracer.start_span(
                sp.SPAN_INFERENCE, context=self._ctx, start_time=start_ns, attributes=attrs
            )
        except Exception:
            tracker._error("spans")

    def finish(self, exc: BaseException | None = None) -> None:
        """End the request (the ``with`` block calls it). Idempotent: only the first call counts."""
        if self._state == _FINISHED:
            return
        started = self._state == _STARTED
        self._state = _FINISHED
        finish_mono = time.perf_counter()
        tracker = self._tracker
        series = self._series
        arrival = self._arrival
        # The slot first, on its own: whatever fails below, the slot must go back.
        released = self._holds_slot
        if released:
            self._holds_slot = False
            tracker._pool.release()
        arrival.started = True
        tracker._pending.pop(id(arrival), None)
        outcome: RequestOutcome = self._outcome or ("ok" if exc is None else "error")
        self._outcome = outcome
        e2e = finish_mono - arrival.mono
        start_mono = self._start_mono
        ttft = None if self._first_mono is None else self._first_mono - arrival.mono
        try:
            if started and start_mono is not None:
                queue_wait: float | None = start_mono - arrival.mono
                inference: float | None = finish_mono - start_mono
            else:
                queue_wait = e2e if outcome == "queue_timeout" else None
                inference = None
            series.finished(outcome, released, queue_wait, inference, None if outcome == "rejected" else e2e, ttft)
        except Exception:
            tracker._error("metrics")
        trace_id = None
        if self._sampled:
            trace_id = self._end_spans(outcome, exc, finish_mono)
        if tracker._buffer is not None:
            try:
                wall0, mono0 = arrival.wall, arrival.mono
                tracker._submit_request(
                    wall0,
                    None if start_mono is None else wall0 + (start_mono - mono0),
                    wall0 + (finish_mono - mono0),
                    outcome,
                    self.route,
                    self.prompt_tokens,
                    self.output_tokens,
                    ttft,
                    trace_id,
                )
            except Exception:
                tracker._error("record")

    def _end_spans(self, outcome: str, exc: BaseException | None, finish_mono: float) -> str | None:
        tracker = self._tracker
        arrival = self._arrival
        try:
            end_ns = int((arrival.wall + (finish_mono - arrival.mono)) * 1e9)
            span = self._inference_span
            if span is None:  # never got a slot: the queue span covers arrival -> refusal
                span = tracker._tracer.start_span(
                    sp.SPAN_QUEUE,
                    context=self._ctx,
                    start_time=int(arrival.wall * 1e9),
                    attributes=tracker._span_attrs,
                )
            attrs: dict[str, Any] = {sp.ATTR_OUTCOME: outcome, sp.ATTR_ROUTE: self.route}  # one call, one lock
            if self._start_mono is not None:
                attrs[sp.ATTR_TIME_IN_QUEUE] = self._start_mono - arrival.mono
            if self.prompt_tokens is not None:
                attrs[sp.ATTR_INPUT_TOKENS] = self.prompt_tokens
            if self.output_tokens is not None:
                attrs[sp.ATTR_OUTPUT_TOKENS] = self.output_tokens
            if self._first_mono is not None:
                attrs[sp.ATTR_TTFT] = self._first_mono - arrival.mono
            if outcome != "ok":
                attrs[sp.ATTR_ERROR_TYPE] = type(exc).__name__ if outcome == "error" and exc else outcome
                span.set_status(Status(StatusCode.ERROR, outcome))
            span.set_attributes(attrs)
            span.end(end_time=end_ns)
            return sp.trace_id_hex(span)
        except Exception:
            tracker._error("spans")
            return None


class RequestTracker:
    """Per-model request tracking, admission control and in-process diagnostics (see the module doc).

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
        self.admission = admission or AdmissionConfig()
        self.span_sample_ratio = float(span_sample_ratio)
        self.provider_name = provider_name
        self.queue_span_min_s = float(queue_span_min_s)
        self.tracer_provider = tracer_provider
        self._pid = os.getpid()
        self._metrics: TrackerMetrics = metrics_for(registry)
        self._series: dict[str, RequestSeries] = {}
        self._series_lock = threading.Lock()
        self._pool = SlotPool(self.admission.max_concurrency, self.admission.queue_size)
        self._pending: dict[int, sp.Arrival] = {}
        self._guard_on = self.admission.memory_guard_enabled
        self._probe = memory_probe
        self._last_reading: MemoryReading | None = None
        self._last_refusal: tuple[str, str] | None = None
        self._closed = False
        # recorder: records go through a RecordBuffer (batched hand-off, see ``buffer``)
        self._buffer: RecordBuffer | None = None
        if recorder is not False:
            if isinstance(recorder, RecorderWriter):
                writer, owns = recorder, False
            else:
                writer = RecorderWriter(default_recorder_path() if recorder is None or recorder is True else recorder)
                owns = True
            self._buffer = RecordBuffer(writer, owns_writer=owns, on_drop=self._error)
        self._seen_write_errors = 0
        # tracing
        if tracer_provider is None:
            sp.configure_otlp_from_env()
            self._tracer = trace.get_tracer(sp.TRACER_NAME)
        else:
            self._tracer = tracer_provider.get_tracer(sp.TRACER_NAME)
        self._span_attrs = sp.gen_ai_attributes(model, provider_name)
        self._set_config_gauges()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (t := ref()) is not None and t._after_fork())

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
        self._pending[id(arrival)] = arrival
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
        return TrackedRequest(self, route, arrival, sampled, ctx)

    def health(self) -> dict[str, Any]:
        """Readiness for a /health endpoint: ``status`` is ``degraded`` while new requests would be refused.

        Keys: status, model, pid, active_inference, queue_depth, max_concurrency, queue_size,
        accepting_new_requests, reasons (why not accepting), memory_used_percent (None when
        unknown), memory_used_bytes, memory_limit_bytes, memory_source, memory_psi_some_avg10,
        memory_error. Per process: with several workers each answers for itself.
        """
        reading = self._memory_reading()
        reasons: list[str] = []
        if self._pool.queue_full:
            reasons.append("queue_full")
        refusal = self._memory_refusal(reading) if self._guard_on and reading is not None else None
        if refusal is not None:
            reasons.append(refusal[0])
        ratio = reading.used_ratio if reading is not None else None
        accepting = not reasons
        return {
            "status": "ok" if accepting else "degraded",
            "model": self.model,
            "pid": os.getpid(),
            "active_inference": self._pool.active,
            "queue_depth": self._pool.waiting,
            "max_concurrency": self.admission.max_concurrency,
            "queue_size": self.admission.queue_size,
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
        try:
            stats = batch_stats(
                self.model,
                requests=requests,
                input_tokens=input_tokens,
                max_request_tokens=max_request_tokens,
                active_decode_sequences=active_decode_sequences,
                concurrent_batches=concurrent_batches,
                phase=phase,
            )
        except (TypeError, ValueError) as exc:
            self._error("batch")
            log.warning("record_batch ignored: %s", exc)
            return None
        try:
            m = self._metrics
            m[catalog.BATCH_INPUT_TOKENS].labels(self.model, phase).observe(stats.input_tokens)
            m[catalog.BATCH_REQUESTS].labels(self.model, phase).observe(stats.requests)
            m[catalog.BATCH_MAX_REQUEST_TOKENS].labels(self.model, phase).observe(stats.max_request_tokens)
        except Exception:
            self._error("metrics")
        self._submit(stats)
        return stats

    def record_routing(self, layer: int, expert_token_counts: Sequence[int], capacity: int | None = None) -> RoutingStats | None:
        """Record one MoE layer's routing step: top/median tokens, skew, balancedness, overflow (see
        ``batches``). Full counts go to the recorder only. None (and a counted error) on bad input."""
        try:
            stats = routing_stats(self.model, layer, expert_token_counts, capacity)
        except (TypeError, ValueError) as exc:
            self._error("routing")
            log.warning("record_routing ignored: %s", exc)
            return None
        try:
            m = self._metrics
            layer_label = str(stats.layer)
            # median 0: infinitely skewed if anyone got tokens, undefined if nobody did
            undefined = float("inf") if stats.top_expert_tokens > 0 else float("nan")
            skew = stats.skew if stats.skew is not None else undefined
            m[catalog.MOE_EXPERT_SKEW].labels(self.model, layer_label).set(skew)
            m[catalog.MOE_EXPERT_BALANCEDNESS].labels(self.model, layer_label).set(
                stats.balancedness if stats.balancedness is not None else float("nan")
            )
            overflow = m[catalog.MOE_EXPERT_OVERFLOW].labels(self.model, layer_label)
            if stats.overflow_tokens:
                overflow.inc(stats.overflow_tokens)
        except Exception:
            self._error("metrics")
        self._submit(stats)
        return stats

    def track_loader(self, name: str, bytes_read: int | None = None, cache_hit: bool | None = None) -> TrackedLoader:
        """Track a model load / registry refresh: a context manager (sync or async) or a decorator.

        The resulting ``LoaderEvent`` (``.event`` after the block) has ``in_request_path=True`` when
        the loader ran inside an in-flight request's arrival -> start window (see ``loader``).
        """
        return TrackedLoader(self, name, bytes_read, cache_hit)

    def record_torch_memory(self, device: int = 0) -> TorchMemorySnapshot:
        """Snapshot ``torch.cuda.memory_stats(device)`` into the recorder and the torch gauges.

        Without torch/CUDA it returns an all-None snapshot and records nothing.
        """
        snap = torch_memory_snapshot(device)
        if snap.allocated_bytes is None and snap.reserved_bytes is None:
            return snap
        try:
            dev = str(snap.device)
            values = {
                "allocated": snap.allocated_bytes,
                "reserved": snap.reserved_bytes,
                "allocated_peak": snap.peak_allocated_bytes,
                "reserved_peak": snap.peak_reserved_bytes,
            }
            for part, value in values.items():
                if value is not None:
                    self._metrics[catalog.TORCH_MEMORY[part]].labels(dev).set(value)
        except Exception:
            self._error("metrics")
        self._submit(snap)
        return snap

    def record_cuda_oom(self, error: CudaOomError | str) -> CudaOomError | None:
        """Record a CUDA OOM (a parsed record or the exception's message). Returns the record, or None
        when the text is not a CUDA OOM message. Also snapshots torch memory when torch is present."""
        try:
            parsed = error if isinstance(error, CudaOomError) else parse_cuda_oom_message(error, pid=self._pid)
            if parsed is None:
                return None
            if parsed.pid is None:
                parsed.pid = self._pid
            device = "unknown" if parsed.device is None else str(parsed.device)
            self._metrics[catalog.CUDA_OOM_ERRORS].labels(self.model, device).inc()
            self._submit(parsed)
            if parsed.device is not None:
                self.record_torch_memory(parsed.device)
            return parsed
        except Exception:
            self._error("torch")
            return None

    def capture_cuda_oom(self) -> contextlib.AbstractContextManager[None]:
        """``with tracker.capture_cuda_oom(): ...``: record a CUDA OOM raised in the block, then re-raise it."""
        return capture_cuda_oom(self.record_cuda_oom)

    # ------------------------------------------------------------------ lifecycle

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every record submitted so far is in the flight recorder (tests, shutdown)."""
        ok = self._buffer.flush(timeout) if self._buffer is not None else True
        self._sync_writer_counters()
        return ok

    def close(self, timeout: float = 10.0) -> None:
        """Flush the recorder and stop its threads (a ``RecorderWriter`` passed in is flushed, not closed)."""
        if self._closed:
            return
        self._closed = True
        if self._buffer is not None:
            try:
                self._buffer.close(timeout)
            except Exception:
                self._error("recorder_close")
            self._sync_writer_counters()

    @property
    def recorder(self) -> RecorderWriter | None:
        """The ``RecorderWriter`` behind this tracker (None without a recorder)."""
        return self._buffer.writer if self._buffer is not None else None

    # ------------------------------------------------------------------ internals

    def _series_for(self, route: str) -> RequestSeries:
        series = self._series.get(route)
        if series is not None:
            return series
        with self._series_lock:
            series = self._series.get(route)
            if series is None:
                if len(self._series) >= MAX_ROUTES:
                    self._error("route_cardinality")
                    route = OTHER_ROUTE
                    series = self._series.get(route)
                if series is None:
                    series = self._series[route] = self._metrics.series(route, self.model)
        return series

    def _submit_request(
        self,
        arrival: float,
        start: float | None,
        finish: float,
        outcome: str,
        route: str,
        prompt_tokens: int | None,
        output_tokens: int | None,
        ttft: float | None,
        trace_id: str | None,
    ) -> None:
        """One finished request to the recorder: as a row SQLite renders (``buffer.request_row``), else a record."""
        buffer = self._buffer
        if buffer is None:
            return
        row = request_row(
            arrival, start, finish, outcome, route, self.model, prompt_tokens, output_tokens, ttft, self._pid, trace_id
        )
        if row is None:
            self._submit(
                RequestTiming(
                    ts=finish, arrival=arrival, start=start, finish=finish, outcome=outcome,  # type: ignore[arg-type]
                    route=route, model=self.model, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                    ttft_s=ttft, pid=self._pid, trace_id=trace_id,
                )
            )  # fmt: skip
            return
        self._hand_off(buffer, row)

    def _submit(self, record: Record) -> None:
        buffer = self._buffer
        if buffer is not None:
            self._hand_off(buffer, record)

    def _hand_off(self, buffer: RecordBuffer, item: Any) -> None:
        try:
            buffer.submit(item)  # counts its own drops
            if buffer.writer.write_errors != self._seen_write_errors:
                self._sync_writer_counters()
        except Exception:
            self._error("recorder")

    def _sync_writer_counters(self) -> None:
        if self._buffer is None:
            return
        errors = self._buffer.writer.write_errors
        if errors > self._seen_write_errors:
            self._error("recorder_write", errors - self._seen_write_errors)
            self._seen_write_errors = errors

    def _error(self, stage: str, n: int = 1) -> None:
        self._metrics.error(stage, n)

    def _record_loader(self, event: LoaderEvent) -> None:
        try:
            m = self._metrics
            in_path = "true" if event.in_request_path else "false"
            cache = "unknown" if event.cache_hit is None else ("hit" if event.cache_hit else "miss")
            m[catalog.LOADER_DURATION].labels(self.model, in_path).observe(event.duration_s)
            m[catalog.LOADER_EVENTS].labels(self.model, cache, in_path).inc()
            if event.bytes_read:
                m[catalog.LOADER_READ].labels(self.model).inc(event.bytes_read)
        except Exception:
            self._error("metrics")
        self._submit(event)

    def _waiting_since_before(self, mono: float) -> bool:
        """True if an in-flight request arrived at or before ``mono`` and still has no slot."""
        return any(a.mono <= mono and not a.started for a in list(self._pending.values()))

    # -- memory guard

    def _memory_reading(self) -> MemoryReading | None:
        try:
            if self._probe is None:
                self._probe = MemoryProbe(self.admission.memory_cache_s)
            reading = self._probe.read()
        except Exception:
            self._error("memory_probe")
            return None
        if reading is not self._last_reading:
            self._last_reading = reading
            self._on_new_reading(reading)
        return reading

    def _on_new_reading(self, reading: MemoryReading) -> None:
        try:
            if reading.error:
                self._error("memory_probe")
            m = self._metrics
            ratio = reading.used_ratio
            if ratio is not None:
                m[catalog.MEMORY_GUARD_USED].labels(self.model).set(ratio)
            if self._guard_on:
                refused = self._memory_refusal(reading) is not None
                m[catalog.MEMORY_GUARD_ACCEPTING].labels(self.model).set(0 if refused else 1)
        except Exception:
            self._error("metrics")

    def _memory_refusal(self, reading: MemoryReading) -> tuple[str, str] | None:
        """(reason, detail) when the guard refuses new work at this reading. Unknown values admit (fail open)."""
        cfg = self.admission
        ratio = reading.used_ratio
        if cfg.memory_high_watermark is not None and ratio is not None and ratio > cfg.memory_high_watermark:
            return "memory_watermark", (
                f"memory {ratio * 100:.1f}% of {reading.source} is above the {cfg.memory_high_watermark * 100:.1f}% watermark"
            )
        psi = reading.psi_some_avg10
        if cfg.psi_memory_some_avg10 is not None and psi is not None and psi > cfg.psi_memory_some_avg10:
            return "memory_psi", f"memory PSI some avg10 {psi:.2f}% is above {cfg.psi_memory_some_avg10:.2f}%"
        return None

    def _check_memory(self, req: TrackedRequest) -> None:
        reading = self._memory_reading()
        if reading is None:
            return
        refusal = self._memory_refusal(reading)
        if refusal is not None:
            req._reject(refusal[0], 503, refusal[1])

    # -- config gauges, fork

    def _set_config_gauges(self) -> None:
        try:
            m = self._metrics
            cfg = self.admission
            if cfg.max_concurrency is not None:
                m[catalog.ADMISSION_MAX_CONCURRENCY].labels(self.model).set(cfg.max_concurrency)
            if cfg.queue_size is not None and cfg.max_concurrency is not None:
                m[catalog.ADMISSION_QUEUE_CAPACITY].labels(self.model).set(cfg.queue_size)
            if self._guard_on:
                m[catalog.MEMORY_GUARD_ACCEPTING].labels(self.model).set(1)
        except Exception:
            self._error("metrics")

    def _after_fork(self) -> None:
        """In a forked child (gunicorn --preload): fresh locks, queue and writer thread; the parent's are unusable."""
        self._pid = os.getpid()
        self._pool = SlotPool(self.admission.max_concurrency, self.admission.queue_size)
        self._pending = {}
        self._series_lock = threading.Lock()
        self._probe = None
        if self._buffer is not None:
            old = self._buffer
            writer = RecorderWriter(old.writer.path) if old.owns_writer else old.writer
            self._buffer = RecordBuffer(writer, owns_writer=old.owns_writer, on_drop=self._error)
            self._seen_write_errors = 0
