"""In-process request tracking for LLM inference services: queue wait vs inference time, admission control.

The public API (stable; the reference backend ``diag demo serve`` and third-party services use it)::

    from collectors.tracking import (RequestTracker, AdmissionConfig, AdmissionRejected, InferenceTimeout,
                                     TrackedRequest, instrument_fastapi)

    tracker = RequestTracker(model="demo", admission=AdmissionConfig(max_concurrency=4, queue_size=32))
    instrument_fastapi(app, tracker, metrics_path="/metrics", health_path="/health")

    async with tracker.request(route="/v1/completions") as req:
        await req.acquire()
        ...

Modules: ``tracker`` (RequestTracker: wires the two parts below and hands each request both),
``queueing`` (AdmissionControl: slots, wait queue, memory guard, arrival windows), ``recording``
(RequestRecorder: metrics, spans, flight-recorder records), ``request`` (TrackedRequest),
``admission`` (config, slot pool, exceptions), ``memory`` (the memory guard's cgroup/host probe),
``metrics`` (catalog-built Prometheus families, multiprocess /metrics), ``spans`` (OTel spans,
sampling, OTLP from env), ``asgi`` (FastAPI integration), ``batches`` (batch / MoE routing stats),
``loader`` (loader events), ``buffer`` (batched hand-off to the recorder), ``torch_memory`` (CUDA
allocator snapshot, CUDA OOM parser), ``wrapped`` + ``engine_locks`` + ``boot`` (the same tracking applied
from outside to a server we did not write: ``diag wrap``).

Imports run one way: tracker -> request -> queueing, recording -> the leaf modules; ``loader``
and ``asgi``'s middleware need no tracker (they are given what they use).
"""

from collectors.tracking.admission import AdmissionConfig, AdmissionRejected, InferenceTimeout, QueueTimeout
from collectors.tracking.asgi import TrackingMiddleware, install_exception_handlers, instrument_fastapi
from collectors.tracking.batches import batch_stats, routing_stats
from collectors.tracking.loader import TrackedLoader
from collectors.tracking.memory import MemoryProbe, MemoryReading
from collectors.tracking.metrics import metrics_response, multiprocess_enabled, sweep_dead_workers
from collectors.tracking.queueing import AdmissionControl
from collectors.tracking.recording import RequestRecorder
from collectors.tracking.spans import configure_otlp_from_env
from collectors.tracking.torch_memory import (
    capture_cuda_oom,
    parse_cuda_oom_message,
    torch_cuda_status,
    torch_memory_snapshot,
)
from collectors.tracking.tracker import RequestTracker, TrackedRequest

__all__ = [
    "AdmissionConfig",
    "AdmissionControl",
    "AdmissionRejected",
    "InferenceTimeout",
    "MemoryProbe",
    "MemoryReading",
    "QueueTimeout",
    "RequestRecorder",
    "RequestTracker",
    "TrackedLoader",
    "TrackedRequest",
    "TrackingMiddleware",
    "batch_stats",
    "capture_cuda_oom",
    "configure_otlp_from_env",
    "install_exception_handlers",
    "instrument_fastapi",
    "metrics_response",
    "multiprocess_enabled",
    "parse_cuda_oom_message",
    "routing_stats",
    "sweep_dead_workers",
    "torch_cuda_status",
    "torch_memory_snapshot",
]
