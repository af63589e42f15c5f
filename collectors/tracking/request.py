"""One tracked request: arrival, slot, finish -- the object ``RequestTracker.request()`` returns.

It is where admission and recording meet, so it holds one of each and uses only their public
methods: :class:`~collectors.tracking.queueing.AdmissionControl` decides (slot, queue, memory guard,
timeouts) and :class:`~collectors.tracking.recording.RequestRecorder` reports (the route's series,
``llm.*`` spans, the ``RequestTiming`` record). See ``tracker`` for the usage and counting rules.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable
from typing import Any, NoReturn, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from collectors.records import REQUEST_OUTCOMES, RequestOutcome
from collectors.tracking import spans as sp
from collectors.tracking.admission import AdmissionRejected, InferenceTimeout, QueueFull, QueueTimeout
from collectors.tracking.metrics import RequestSeries
from collectors.tracking.queueing import AdmissionControl
from collectors.tracking.recording import RequestRecorder

T = TypeVar("T")

_PENDING, _STARTED, _FINISHED = 0, 1, 2


class TrackedRequest:
    """One request between arrival and finish. Use it as ``with`` / ``async with`` (see the module doc)."""

    __slots__ = (
        "_admission",
        "_arrival",
        "_ctx",
        "_deadline",
        "_first_mono",
        "_holds_slot",
        "_inference_span",
        "_outcome",
        "_recording",
        "_sampled",
        "_series",
        "_start_mono",
        "_state",
        "output_tokens",
        "prompt_tokens",
        "route",
    )

    def __init__(
        self,
        admission: AdmissionControl,
        recording: RequestRecorder,
        route: str,
        arrival: sp.Arrival,
        sampled: bool,
        ctx: Any,
    ) -> None:
        self._admission = admission
        self._recording = recording
        self.route = route
        # Resolved at first use, not here: a layer outside the app (``diag wrap``) opens each request under a
        # placeholder route and names it once routing matched; resolving now would leave an empty series of the
        # placeholder in /metrics for the process's life.
        self._series: RequestSeries | None = None
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
        if not await self._admission.wait_for_slot(waiter):
            self._queue_timeout()
        self._mark_start()

    def acquire_sync(self) -> None:
        """Thread-side :meth:`acquire`: blocks this thread (never call it on the event loop)."""
        waiter = self._admit(None)
        if waiter is None:
            return
        if not self._admission.wait_for_slot_sync(waiter):
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
        admission = self._admission
        if admission.guard_enabled:
            refusal = admission.refusal()
            if refusal is not None:
                self._reject(refusal[0], 503, refusal[1])
        if admission.try_acquire():
            self._mark_start()
            return None
        series = self._route_series()
        try:
            waiter = admission.enqueue(loop, series.queued, series.dequeued)  # the pool counts depth
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
        task = asyncio.current_task()
        if task is None:  # driven outside a task (no loop to sweep on): a timeout of its own
            timeout = asyncio.timeout(remaining)
            try:
                async with timeout:
                    return await awaitable
            except TimeoutError:
                if timeout.expired():
                    self._inference_timeout()
                raise
        deadline = self._admission.deadlines(task.get_loop()).add(self._deadline, task)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if deadline.timed_out():
                self._inference_timeout()
            raise
        finally:
            deadline.done = True

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

    def set_route(self, route: str) -> None:
        """Name the route once routing knows it, before the start (a layer outside the app, ``diag wrap``, sees the
        request arrive before the app's router has matched it); later calls are ignored."""
        if self._state == _PENDING and route != self.route:
            self.route = route
            self._series = None

    def _route_series(self) -> RequestSeries:
        series = self._series
        if series is None:
            series = self._series = self._recording.series_for(self.route)
        return series

    def mark_outcome(self, outcome: RequestOutcome) -> None:
        """Set the outcome a layer outside the handler observed (e.g. the HTTP status of a response the tracker did
        not produce: ``diag wrap``); an outcome admission decided already (rejected, timed out) is kept."""
        if outcome not in REQUEST_OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; one of {', '.join(REQUEST_OUTCOMES)}")
        if self._state != _FINISHED and self._outcome is None:
            self._outcome = outcome

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
        """The live ``llm.inference`` span (a non-recording span when not sampled or not started).

        Created here, on first use: a request nobody asks for its span gets it built once, whole,
        when it finishes (one SDK span creation with every attribute, instead of a start plus a
        second attribute pass and its lock) -- same name, parent, times and attributes."""
        if self._inference_span is None and self._sampled and self._state == _STARTED and self._start_mono is not None:
            self._inference_span = self._new_inference_span(self._recording.span_attrs)
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
        try:
            self._route_series().rejected(reason)
        except Exception:
            self._recording.error("metrics")
        raise AdmissionRejected(reason, status, self._admission.config.retry_after_s, detail)

    def _queue_timeout(self) -> NoReturn:
        self._outcome = "queue_timeout"
        try:
            self._route_series().rejected("queue_timeout")
        except Exception:
            self._recording.error("metrics")
        waited = time.perf_counter() - self._arrival.mono
        raise QueueTimeout(waited, self._admission.config.retry_after_s)

    def _inference_timeout(self) -> NoReturn:
        self._outcome = "inference_timeout"
        raise InferenceTimeout(self._admission.config.inference_timeout_s or 0.0)

    def _mark_start(self) -> None:
        now = time.perf_counter()
        self._start_mono = now
        self._state = _STARTED
        self._holds_slot = True
        if self._outcome is not None:  # refused earlier, caught by the handler, and admitted on a retry
            self._outcome = None
        admission = self._admission
        budget = admission.config.inference_timeout_s
        if budget is not None:
            self._deadline = now + budget
        admission.closed(self._arrival)
        try:
            self._route_series().started()
            if self._sampled:
                self._start_spans(now)
        except Exception:
            self._recording.error("metrics")

    def _start_spans(self, start_mono: float) -> None:
        """At the grant: the ``llm.queue`` span if the request waited long enough (``llm.inference`` is lazy, see ``span``)."""
        recording = self._recording
        arrival = self._arrival
        if start_mono - arrival.mono < recording.queue_span_min_s:
            return
        try:
            queue = recording.tracer.start_span(
                sp.SPAN_QUEUE, context=self._ctx, start_time=int(arrival.wall * 1e9), attributes=recording.span_attrs
            )
            queue.end(end_time=int((arrival.wall + (start_mono - arrival.mono)) * 1e9))
        except Exception:
            recording.error("spans")

    def _new_inference_span(self, attributes: dict[str, Any]) -> Any:
        arrival = self._arrival
        start_ns = int((arrival.wall + (self._start_mono - arrival.mono)) * 1e9)  # type: ignore[operator]
        return self._recording.tracer.start_span(sp.SPAN_INFERENCE, context=self._ctx, start_time=start_ns, attributes=attributes)

    def finish(self, exc: BaseException | None = None) -> None:
        """End the request (the ``with`` block calls it). Idempotent: only the first call counts."""
        state = self._state
        if state == _FINISHED:
            return
        self._state = _FINISHED
        finish_mono = time.perf_counter()
        arrival = self._arrival
        # The slot first, on its own: whatever fails below, the slot must go back.
        released = self._holds_slot
        if released:
            self._holds_slot = False
            self._admission.release()
        if not arrival.started:
            self._admission.closed(arrival)
        outcome: RequestOutcome = self._outcome or ("ok" if exc is None else "error")
        self._outcome = outcome
        mono0 = arrival.mono
        e2e = finish_mono - mono0
        start_mono = self._start_mono
        ttft = None if self._first_mono is None else self._first_mono - mono0
        recording = self._recording
        try:
            if state == _STARTED and start_mono is not None:
                self._route_series().finished(outcome, released, start_mono - mono0, finish_mono - start_mono, e2e, ttft)
            else:
                queue_wait = e2e if outcome == "queue_timeout" else None
                self._route_series().finished(outcome, released, queue_wait, None, None if outcome == "rejected" else e2e, ttft)
        except Exception:
            recording.error("metrics")
        trace_id = self._end_spans(outcome, exc, finish_mono) if self._sampled else None
        if recording.records_requests:
            try:
                wall0 = arrival.wall
                recording.submit_request(
                    wall0,
                    None if start_mono is None else wall0 + (start_mono - mono0),
                    wall0 + e2e,
                    outcome,
                    self.route,
                    self.prompt_tokens,
                    self.output_tokens,
                    ttft,
                    trace_id,
                )
            except Exception:
                recording.error("record")

    def _end_spans(self, outcome: str, exc: BaseException | None, finish_mono: float) -> str | None:
        recording = self._recording
        arrival = self._arrival
        try:
            end_ns = int((arrival.wall + (finish_mono - arrival.mono)) * 1e9)
            attrs: dict[str, Any] = {sp.ATTR_OUTCOME: outcome, sp.ATTR_ROUTE: self.route}
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
            span = self._inference_span
            if span is not None:  # live: someone asked for it during the request
                span.set_attributes(attrs)  # one call, one lock
            elif self._start_mono is not None:  # built whole now (see ``span``)
                span = self._new_inference_span({**recording.span_attrs, **attrs})
            else:  # never got a slot: the queue span covers arrival -> refusal
                span = recording.tracer.start_span(
                    sp.SPAN_QUEUE,
                    context=self._ctx,
                    start_time=int(arrival.wall * 1e9),
                    attributes={**recording.span_attrs, **attrs},
                )
            if outcome != "ok":
                span.set_status(Status(StatusCode.ERROR, outcome))
            span.end(end_time=end_ns)
            return sp.trace_id_hex(span)
        except Exception:
            recording.error("spans")
            return None
