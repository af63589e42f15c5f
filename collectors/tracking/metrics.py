"""Prometheus metrics of the tracker, registered from the catalog, and the /metrics response.

Why from the catalog: dashboards and alerts refer to catalog entries, so every metric here is built
from its ``MetricSpec`` (name, help, labels, buckets) -- no ``llmdiag_`` literal appears in this
package.

Per-request families (queue wait, inference, e2e, TTFT, queue depth, active, requests, rejections)
are updated on every request as plain numbers behind one lock per (route, model) (``series``). In a
single process :class:`RequestCollector` renders them at scrape time -- one lock per request instead
of ~9 prometheus_client value locks (~40k CPU instructions per request saved, see bench/overhead.py).
In multiprocess mode they are flushed into prometheus_client's shared values once a second (and
before this process renders /metrics, at close, at exit) instead of eleven locked mmap writes per
request. The exposition is identical to prometheus_client's either way (tests compare them).

Multiple worker processes (``uvicorn --workers N``, gunicorn): each worker has its own registry, so
a scrape would see one random worker. prometheus_client's *multiprocess mode* fixes that: set
``PROMETHEUS_MULTIPROC_DIR`` to an empty, writable directory **before** prometheus_client is
first imported (i.e. in the environment of the server command, not in code), and serve /metrics
with :func:`metrics_response`, which then merges every worker's files with
``MultiProcessCollector``. Counters and histograms are summed over all workers that ever ran;
gauges use the ``multiprocess_mode`` declared in ``GAUGE_MODES`` (``livesum`` for queue depth and
active inferences: the sum over workers alive now). Wipe the directory when the service (not a
worker) restarts. A worker that dies without cleaning up (kill -9, OOM kill) would leave its live
gauges behind; :func:`metrics_response` therefore drops the live-gauge files of PIDs that no longer
exist before every scrape.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import threading
import time
import weakref
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from collectors import catalog
from collectors.catalog import MetricSpec
from collectors.records import REQUEST_OUTCOMES as _OUTCOMES
from collectors.tracking.series import (
    REJECTION_REASONS,
    BatchedRequestSeries,
    DirectRequestSeries,
    FastRequestSeries,
    PromChildren,
    RequestSeries,
    batchable,
    flush_batched,
)

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# How each gauge is merged over worker processes in multiprocess mode.
GAUGE_MODES: dict[str, str] = {
    catalog.QUEUE_DEPTH.name: "livesum",
    catalog.ACTIVE_INFERENCES.name: "livesum",
    catalog.ADMISSION_MAX_CONCURRENCY.name: "livesum",
    catalog.ADMISSION_QUEUE_CAPACITY.name: "livesum",
    catalog.MEMORY_GUARD_USED.name: "livemax",
    catalog.MEMORY_GUARD_ACCEPTING.name: "livemin",
    catalog.MOE_EXPERT_SKEW.name: "livemax",
    catalog.MOE_EXPERT_BALANCEDNESS.name: "livemin",
    **{spec.name: "livesum" for spec in catalog.TORCH_MEMORY.values()},
}

# The per-request families: updated on every request, so they get a fast path (see RequestSeries).
REQUEST_SPECS: tuple[MetricSpec, ...] = (
    catalog.REQUEST_QUEUE_WAIT,
    catalog.REQUEST_INFERENCE,
    catalog.REQUEST_E2E,
    catalog.REQUEST_TTFT,
    catalog.QUEUE_DEPTH,
    catalog.ACTIVE_INFERENCES,
    catalog.REQUESTS,
    catalog.ADMISSION_REJECTIONS,
)
# Everything else the tracker exports: rare events (batches, loaders, errors, config, the guard).
OTHER_SPECS: tuple[MetricSpec, ...] = (
    catalog.TRACKER_ERRORS,
    catalog.ADMISSION_MAX_CONCURRENCY,
    catalog.ADMISSION_QUEUE_CAPACITY,
    catalog.MEMORY_GUARD_USED,
    catalog.MEMORY_GUARD_ACCEPTING,
    catalog.BATCH_INPUT_TOKENS,
    catalog.BATCH_REQUESTS,
    catalog.BATCH_MAX_REQUEST_TOKENS,
    catalog.MOE_EXPERT_SKEW,
    catalog.MOE_EXPERT_BALANCEDNESS,
    catalog.MOE_EXPERT_OVERFLOW,
    catalog.LOADER_DURATION,
    catalog.LOADER_EVENTS,
    catalog.LOADER_READ,
    *catalog.TORCH_MEMORY.values(),
    catalog.CUDA_OOM_ERRORS,
)
TRACKER_SPECS: tuple[MetricSpec, ...] = REQUEST_SPECS + OTHER_SPECS


def multiprocess_enabled() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


def _build(spec: MetricSpec, registry: CollectorRegistry | None) -> Any:
    common: dict[str, Any] = {"labelnames": spec.labels, "registry": registry}
    if spec.type == "counter":
        return Counter(spec.base_name, spec.help, **common)
    if spec.type == "gauge":
        mode = GAUGE_MODES.get(spec.name, "livesum")
        return Gauge(spec.base_name, spec.help, multiprocess_mode=mode, **common)  # type: ignore[arg-type]
    if spec.type == "histogram":
        return Histogram(spec.base_name, spec.help, buckets=spec.buckets or Histogram.DEFAULT_BUCKETS, **common)
    raise ValueError(f"unsupported metric type {spec.type}")


def _get_or_build(spec: MetricSpec, registry: CollectorRegistry) -> Any:
    try:
        return _build(spec, registry)
    except ValueError:
        # Already registered there (another copy of this module, a reload): reuse it when it is ours.
        existing = getattr(registry, "_names_to_collectors", {}).get(spec.name)
        if existing is not None and getattr(existing, "_labelnames", None) == tuple(spec.labels):
            return existing
        log.warning("metric %s clashes with an existing one in the registry; exporting it unregistered", spec.name)
        return _build(spec, None)


class TrackerMetrics:
    """All tracker metric families in one registry (one instance per registry; see :func:`metrics_for`).

    ``fast`` (single-process mode): the per-request families live in plain numbers behind one lock
    per (route, model) and are rendered by a custom collector at scrape time -- one lock per
    request instead of ~9 prometheus_client value locks and their Python calls (~40k instructions
    per request saved). In multiprocess mode values must live in prometheus_client's mmap files, so
    the per-request families are ordinary prometheus_client metrics there.
    """

    def __init__(self, registry: CollectorRegistry, fast: bool | None = None) -> None:
        self.registry = registry
        self.fast = (not multiprocess_enabled()) if fast is None else fast
        specs = OTHER_SPECS if self.fast else TRACKER_SPECS
        self.by_name: dict[str, Any] = {spec.name: _get_or_build(spec, registry) for spec in specs}
        self._errors: dict[str, Any] = {}
        self.requests_collector: RequestCollector | None = None
        if self.fast:
            self.requests_collector = RequestCollector()
            try:
                registry.register(self.requests_collector)
            except ValueError:
                log.warning("request metric families already registered elsewhere; exporting them unregistered")

    def __getitem__(self, spec: MetricSpec) -> Any:
        return self.by_name[spec.name]

    def series(self, route: str, model: str) -> RequestSeries:
        """The per-request series of one (route, model); create once, keep it (label lookups are not free)."""
        if self.requests_collector is not None:
            return self.requests_collector.series(route, model)
        requests, rejections = self[catalog.REQUESTS], self[catalog.ADMISSION_REJECTIONS]
        children = PromChildren(
            self[catalog.REQUEST_QUEUE_WAIT].labels(route, model),
            self[catalog.REQUEST_INFERENCE].labels(route, model),
            self[catalog.REQUEST_E2E].labels(route, model),
            self[catalog.REQUEST_TTFT].labels(route, model),
            self[catalog.QUEUE_DEPTH].labels(route, model),
            self[catalog.ACTIVE_INFERENCES].labels(route, model),
            {o: requests.labels(route, model, o) for o in _OUTCOMES},
            {r: rejections.labels(route, model, r) for r in REJECTION_REASONS},
        )
        if batchable(children):
            return BatchedRequestSeries(route, model, children, self.error)
        return DirectRequestSeries(children)

    def error(self, stage: str, n: int = 1) -> None:
        """Count a failure of our own recording. Never raises."""
        try:
            child = self._errors.get(stage)
            if child is None:
                child = self._errors[stage] = self.by_name[catalog.TRACKER_ERRORS.name].labels(stage=stage)
            child.inc(n)
        except Exception:  # pragma: no cover - prometheus_client itself broken
            log.debug("could not count tracker error %s", stage, exc_info=True)


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, TrackerMetrics] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def metrics_for(registry: CollectorRegistry | None = None) -> TrackerMetrics:
    """The shared :class:`TrackerMetrics` of ``registry`` (default: prometheus_client's REGISTRY).

    Several trackers (one per model) share one set of families and differ by the ``model`` label.
    """
    reg = REGISTRY if registry is None else registry
    with _LOCK:
        found = _BY_REGISTRY.get(reg)
        if found is None:
            found = _BY_REGISTRY[reg] = TrackerMetrics(reg)
        return found


# --------------------------------------------------------------------------- per-request series (``series``)


class RequestCollector:
    """Renders every FastRequestSeries of one registry as the catalog's families, at scrape time."""

    def __init__(self) -> None:
        self._series: dict[tuple[str, str], FastRequestSeries] = {}
        self._lock = threading.Lock()
        self._created = time.time()

    def series(self, route: str, model: str) -> FastRequestSeries:
        with self._lock:
            found = self._series.get((route, model))
            if found is None:
                found = self._series[(route, model)] = FastRequestSeries(route, model)
            return found

    def describe(self) -> list[Metric]:
        return self._families(with_samples=False)

    def collect(self) -> list[Metric]:
        return self._families(with_samples=True)

    def _families(self, with_samples: bool) -> list[Metric]:
        hists = {
            spec.name: HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
            for spec in (catalog.REQUEST_QUEUE_WAIT, catalog.REQUEST_INFERENCE, catalog.REQUEST_E2E, catalog.REQUEST_TTFT)
        }
        depth = GaugeMetricFamily(catalog.QUEUE_DEPTH.name, catalog.QUEUE_DEPTH.help, labels=catalog.QUEUE_DEPTH.labels)
        active = GaugeMetricFamily(
            catalog.ACTIVE_INFERENCES.name, catalog.ACTIVE_INFERENCES.help, labels=catalog.ACTIVE_INFERENCES.labels
        )
        requests = CounterMetricFamily(catalog.REQUESTS.base_name, catalog.REQUESTS.help, labels=catalog.REQUESTS.labels)
        rejections = CounterMetricFamily(
            catalog.ADMISSION_REJECTIONS.base_name, catalog.ADMISSION_REJECTIONS.help, labels=catalog.ADMISSION_REJECTIONS.labels
        )
        if with_samples:
            with self._lock:
                all_series = list(self._series.values())
            for s in all_series:
                labels = [s.route, s.model]
                with s.lock:  # a consistent snapshot of this series
                    snapshot = [(h, h.cumulative(), h.sum) for h in (s.queue_wait, s.inference, s.e2e, s.ttft)]
                    d, a = s.depth, s.active
                    outcomes, reasons = dict(s.outcomes), dict(s.rejections)
                for spec, (_h, buckets, total) in zip(
                    (catalog.REQUEST_QUEUE_WAIT, catalog.REQUEST_INFERENCE, catalog.REQUEST_E2E, catalog.REQUEST_TTFT),
                    snapshot,
                    strict=True,
                ):
                    hists[spec.name].add_metric(labels, buckets, total)
                depth.add_metric(labels, d)
                active.add_metric(labels, a)
                for outcome, value in outcomes.items():
                    requests.add_metric([*labels, outcome], value, created=self._created)
                for reason, value in reasons.items():
                    rejections.add_metric([*labels, reason], value, created=self._created)
        return [*hists.values(), depth, active, requests, rejections]


# --------------------------------------------------------------------------- exposition

_LIVE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db$")


def sweep_dead_workers(path: str | None = None) -> list[int]:
    """Drop live-gauge files of worker PIDs that no longer exist (multiprocess mode). Returns those PIDs.

    prometheus_client expects ``mark_process_dead(pid)`` from the server's supervisor, which uvicorn
    does not call; without this, a worker killed by the OOM killer would keep reporting its last
    queue depth forever.
    """
    from prometheus_client import multiprocess

    directory = path or os.environ.get(MULTIPROC_ENV)
    if not directory:
        return []
    dead: set[int] = set()
    for name in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
        m = _LIVE_FILE.search(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid in dead or _alive(pid):
            continue
        dead.add(pid)
    for pid in dead:
        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(pid, directory)
    return sorted(dead)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its supervisor) is dead for our purpose.
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state != b"Z"
    except (OSError, IndexError):
        return True


def metrics_response(registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """``(body, content_type)`` for a /metrics endpoint.

    With ``PROMETHEUS_MULTIPROC_DIR`` set, merges all worker processes (plus ``registry`` when
    given, for collectors that are not multiprocess-aware); otherwise renders ``registry`` (default
    REGISTRY). Reads files in multiprocess mode: call it from a thread (a sync FastAPI endpoint),
    not on the event loop.
    """
    if multiprocess_enabled():
        from prometheus_client import multiprocess

        flush_batched()  # this worker's requests up to now; the others' are at most series.FLUSH_INTERVAL_S old
        sweep_dead_workers()
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        body = generate_latest(merged)
        if registry is not None and registry is not REGISTRY:
            body += generate_latest(registry)
        return body, CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY if registry is None else registry), CONTENT_TYPE_LATEST


def flush_metrics() -> None:
    """Write this process's batched per-request values to the shared files now (multiprocess mode; a no-op
    otherwise). The tracker calls it when it flushes or closes; a normal interpreter exit does too."""
    flush_batched()


def mark_own_process_dead() -> None:
    """Remove this process's live-gauge files (graceful worker shutdown in multiprocess mode)."""
    directory = os.environ.get(MULTIPROC_ENV)
    if directory:
        from prometheus_client import multiprocess

        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(os.getpid(), directory)
