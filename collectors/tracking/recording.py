"""Recording and export: what the tracker reports about requests and the model -- metrics, spans, records.

Why apart from admission: reporting must never change a request's fate, and it has its own
failure policy -- every failure here is counted in ``llmdiag_tracker_errors_total{stage}`` and
swallowed. :class:`RequestRecorder` owns the Prometheus series (one per route, capped), the OTel
tracer with the attributes every ``llm.*`` span starts with, and the flight-recorder hand-off
(``buffer.RecordBuffer``); it also records the model-side events (batches, MoE routing, loaders,
torch memory, CUDA OOMs) that never pass through admission.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from os import PathLike

from opentelemetry import trace
from prometheus_client import CollectorRegistry

from collectors import catalog
from collectors.recorder import RecorderWriter, default_recorder_path
from collectors.records import (
    BatchStats,
    CudaOomError,
    LoaderEvent,
    Record,
    RequestTiming,
    RoutingStats,
    TorchMemorySnapshot,
)
from collectors.tracking import spans as sp
from collectors.tracking.admission import AdmissionConfig
from collectors.tracking.batches import batch_stats, routing_stats
from collectors.tracking.buffer import RecordBuffer, request_row
from collectors.tracking.memory import MemoryReading
from collectors.tracking.metrics import RequestSeries, TrackerMetrics, flush_metrics, metrics_for
from collectors.tracking.torch_memory import capture_cuda_oom, parse_cuda_oom_message, torch_memory_snapshot

log = logging.getLogger(__name__)

MAX_ROUTES = 200
OTHER_ROUTE = "other"


class RequestRecorder:
    """Metrics, spans and flight-recorder records of one model in one process (see the module doc).

    ``recorder``: a path; ``None``/``True`` -> ``default_recorder_path()``; ``False`` -> none; a
    ``RecorderWriter`` -> shared with its owner (flushed, never closed here).
    """

    def __init__(
        self,
        model: str,
        recorder: str | PathLike[str] | RecorderWriter | bool | None = None,
        registry: CollectorRegistry | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        provider_name: str = sp.DEFAULT_PROVIDER_NAME,
        queue_span_min_s: float = 0.001,
    ) -> None:
        self.model = model
        self.pid = os.getpid()
        self.queue_span_min_s = float(queue_span_min_s)
        self.metrics: TrackerMetrics = metrics_for(registry)
        self._series: dict[str, RequestSeries] = {}
        self._series_lock = threading.Lock()
        self._buffer: RecordBuffer | None = None
        if recorder is not False:
            if isinstance(recorder, RecorderWriter):
                writer, owns = recorder, False
            else:
                writer = RecorderWriter(default_recorder_path() if recorder is None or recorder is True else recorder)
                owns = True
            self._buffer = RecordBuffer(writer, owns_writer=owns, on_drop=self.error)  # counts drops and write errors
        # True when finished requests go to a flight recorder (else submit_request is a no-op); a
        # plain attribute, read once per request.
        self.records_requests = self._buffer is not None
        self._closed = False
        if tracer_provider is None:
            sp.configure_otlp_from_env()
            self.tracer = trace.get_tracer(sp.TRACER_NAME)
        else:
            self.tracer = tracer_provider.get_tracer(sp.TRACER_NAME)
        self.span_attrs = sp.gen_ai_attributes(model, provider_name)

    # ------------------------------------------------------------------ per request

    def series_for(self, route: str) -> RequestSeries:
        """The per-request series of ``route`` (past ``MAX_ROUTES`` routes: ``other``, and a counted error)."""
        series = self._series.get(route)
        if series is not None:
            return series
        with self._series_lock:
            series = self._series.get(route)
            if series is None:
                if len(self._series) >= MAX_ROUTES:
                    self.error("route_cardinality")
                    route = OTHER_ROUTE
                    series = self._series.get(route)
                if series is None:
                    series = self._series[route] = self.metrics.series(route, self.model)
        return series

    def submit_request(
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
        """One finished request (Unix times) to the recorder: a row SQLite renders (``buffer.request_row``), else a record."""
        buffer = self._buffer
        if buffer is None:
            return
        row = request_row(
            arrival, start, finish, outcome, route, self.model, prompt_tokens, output_tokens, ttft, self.pid, trace_id
        )
        if row is None:
            self.submit(
                RequestTiming(
                    ts=finish, arrival=arrival, start=start, finish=finish, outcome=outcome,  # type: ignore[arg-type]
                    route=route, model=self.model, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                    ttft_s=ttft, pid=self.pid, trace_id=trace_id,
                )
            )  # fmt: skip
            return
        buffer.submit(row)  # never raises; counts its own drops

    def submit(self, record: Record) -> None:
        """Any record to the flight recorder (no-op without one). Never raises."""
        buffer = self._buffer
        if buffer is not None:
            try:
                buffer.submit(record)
            except Exception:
                self.error("recorder")

    def error(self, stage: str, n: int = 1) -> None:
        """Count a failure of our own recording (``llmdiag_tracker_errors_total{stage}``). Never raises."""
        self.metrics.error(stage, n)

    # ------------------------------------------------------------------ admission's observations

    def admission_configured(self, config: AdmissionConfig) -> None:
        """Export the limits in force (so a dashboard can draw queue depth against its capacity)."""
        try:
            m = self.metrics
            if config.max_concurrency is not None:
                m[catalog.ADMISSION_MAX_CONCURRENCY].labels(self.model).set(config.max_concurrency)
            if config.queue_size is not None and config.max_concurrency is not None:
                m[catalog.ADMISSION_QUEUE_CAPACITY].labels(self.model).set(config.queue_size)
            if config.memory_guard_enabled:
                m[catalog.MEMORY_GUARD_ACCEPTING].labels(self.model).set(1)
        except Exception:
            self.error("metrics")

    def memory_reading(self, reading: MemoryReading, refused: bool, guard_enabled: bool) -> None:
        """Export a new memory reading, and whether the guard accepts new work at it."""
        try:
            m = self.metrics
            ratio = reading.used_ratio
            if ratio is not None:
                m[catalog.MEMORY_GUARD_USED].labels(self.model).set(ratio)
            if guard_enabled:
                m[catalog.MEMORY_GUARD_ACCEPTING].labels(self.model).set(0 if refused else 1)
        except Exception:
            self.error("metrics")

    # ------------------------------------------------------------------ model-side events

    def record_batch(
        self,
        requests: int,
        input_tokens: int,
        max_request_tokens: int | None = None,
        active_decode_sequences: int = 0,
        concurrent_batches: int = 1,
        phase: str = "mixed",
    ) -> BatchStats | None:
        """See ``RequestTracker.record_batch``."""
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
            self.error("batch")
            log.warning("record_batch ignored: %s", exc)
            return None
        try:
            m = self.metrics
            m[catalog.BATCH_INPUT_TOKENS].labels(self.model, phase).observe(stats.input_tokens)
            m[catalog.BATCH_REQUESTS].labels(self.model, phase).observe(stats.requests)
            m[catalog.BATCH_MAX_REQUEST_TOKENS].labels(self.model, phase).observe(stats.max_request_tokens)
        except Exception:
            self.error("metrics")
        self.submit(stats)
        return stats

    def record_routing(self, layer: int, expert_token_counts: Sequence[int], capacity: int | None = None) -> RoutingStats | None:
        """See ``RequestTracker.record_routing``."""
        try:
            stats = routing_stats(self.model, layer, expert_token_counts, capacity)
        except (TypeError, ValueError) as exc:
            self.error("routing")
            log.warning("record_routing ignored: %s", exc)
            return None
        try:
            m = self.metrics
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
            self.error("metrics")
        self.submit(stats)
        return stats

    def record_loader(self, event: LoaderEvent) -> None:
        """A finished loader run (``loader.TrackedLoader`` calls it)."""
        try:
            m = self.metrics
            in_path = "true" if event.in_request_path else "false"
            cache = "unknown" if event.cache_hit is None else ("hit" if event.cache_hit else "miss")
            m[catalog.LOADER_DURATION].labels(self.model, in_path).observe(event.duration_s)
            m[catalog.LOADER_EVENTS].labels(self.model, cache, in_path).inc()
            if event.bytes_read:
                m[catalog.LOADER_READ].labels(self.model).inc(event.bytes_read)
        except Exception:
            self.error("metrics")
        self.submit(event)

    def record_torch_memory(self, device: int = 0) -> TorchMemorySnapshot:
        """See ``RequestTracker.record_torch_memory``."""
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
                    self.metrics[catalog.TORCH_MEMORY[part]].labels(dev).set(value)
        except Exception:
            self.error("metrics")
        self.submit(snap)
        return snap

    def record_cuda_oom(self, error: CudaOomError | str) -> CudaOomError | None:
        """See ``RequestTracker.record_cuda_oom``."""
        try:
            parsed = error if isinstance(error, CudaOomError) else parse_cuda_oom_message(error, pid=self.pid)
            if parsed is None:
                return None
            if parsed.pid is None:
                parsed.pid = self.pid
            device = "unknown" if parsed.device is None else str(parsed.device)
            self.metrics[catalog.CUDA_OOM_ERRORS].labels(self.model, device).inc()
            self.submit(parsed)
            if parsed.device is not None:
                self.record_torch_memory(parsed.device)
            return parsed
        except Exception:
            self.error("torch")
            return None

    def capture_cuda_oom(self) -> contextlib.AbstractContextManager[None]:
        """``with recording.capture_cuda_oom(): ...``: record a CUDA OOM raised in the block, then re-raise it."""
        return capture_cuda_oom(self.record_cuda_oom)

    # ------------------------------------------------------------------ lifecycle

    @property
    def writer(self) -> RecorderWriter | None:
        """The ``RecorderWriter`` behind this recorder (None without one)."""
        return self._buffer.writer if self._buffer is not None else None

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every record submitted so far is in the flight recorder (and the per-request metrics are in
        the shared files, in multiprocess mode)."""
        flush_metrics()
        return self._buffer.flush(timeout) if self._buffer is not None else True

    def close(self, timeout: float = 10.0) -> None:
        """Flush the recorder and stop its threads (a shared ``RecorderWriter`` is flushed, not closed)."""
        if self._closed:
            return
        self._closed = True
        flush_metrics()
        if self._buffer is not None:
            try:
                self._buffer.close(timeout)
            except Exception:
                self.error("recorder_close")

    def after_fork(self) -> None:
        """In a forked child: a fresh series lock and writer thread (the parent's are unusable here)."""
        self.pid = os.getpid()
        self._series_lock = threading.Lock()
        if self._buffer is not None:
            old = self._buffer
            old.abandon()
            writer = RecorderWriter(old.writer.path) if old.owns_writer else old.writer
            self._buffer = RecordBuffer(writer, owns_writer=old.owns_writer, on_drop=self.error)
