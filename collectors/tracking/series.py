"""The per-request series of one (route, model): what the tracker updates on every request.

Why plain numbers on the request path in both modes: a request updates four histograms, an outcome
counter and two gauges. Through prometheus_client that is ~9 value updates, each with its own lock
(and, in multiprocess mode, a ``getpid()`` and a struct pack into an mmap'd file: eleven locked mmap
writes per request, ~50k CPU instructions on the event loop). Here a request takes one lock and
adds to numbers in memory:

- single process (:class:`FastRequestSeries`): the numbers *are* the series; ``metrics.RequestCollector``
  renders them at scrape time.
- multiprocess (:class:`BatchedRequestSeries`): the numbers are what changed since the last flush,
  and a flush adds them to the prometheus_client children (whose values live in the shared mmap
  files every worker's scrape reads). Flushes happen every ``FLUSH_INTERVAL_S`` on a daemon thread,
  before this process renders /metrics, when the tracker flushes or closes, and at interpreter exit.
  So another worker's scrape sees this worker's requests at most ``FLUSH_INTERVAL_S`` late, and a
  worker killed outright (``kill -9``, the OOM killer) loses at most its last ``FLUSH_INTERVAL_S`` of
  counts -- the price of taking eleven locked writes off every request. The live gauges (queue
  depth, active inferences) are written as levels, once per flush when they changed.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import logging
import math
import os
import threading
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from prometheus_client.utils import floatToGoString

from collectors import catalog
from collectors.records import REQUEST_OUTCOMES as _OUTCOMES

log = logging.getLogger(__name__)

# Outcome and reason series are pre-created (at 0) from the first request on, so rate() and
# absent() behave and a dashboard shows 0 rather than "no data".
REJECTION_REASONS: tuple[str, ...] = ("queue_full", "memory_watermark", "memory_psi", "queue_timeout")

# How stale another worker's view of this one may be, and what a killed worker may lose (multiprocess mode).
FLUSH_INTERVAL_S = 1.0


class RequestSeries:
    """What the tracker updates per request, for one (route, model). Implementations below."""

    def queued(self) -> None:
        """A request joined the wait queue."""
        raise NotImplementedError

    def dequeued(self) -> None:
        """A request left the wait queue (granted, timed out or cancelled)."""
        raise NotImplementedError

    def started(self) -> None:
        """A request got an inference slot."""
        raise NotImplementedError

    def rejected(self, reason: str) -> None:
        """A refusal before inference (``REJECTION_REASONS``)."""
        raise NotImplementedError

    def finished(
        self,
        outcome: str,
        released: bool,
        queue_wait: float | None,
        inference: float | None,
        e2e: float | None,
        ttft: float | None,
    ) -> None:
        """A request ended: its outcome, whether it gave a slot back, and the durations to observe."""
        raise NotImplementedError


class _Hist:
    """One histogram child as plain numbers: non-cumulative bucket counts (+Inf last) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:  # caller holds the series lock
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # first bound >= value: Prometheus "le"
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            out.append((floatToGoString(bound), float(total)))
        return out


class FastRequestSeries(RequestSeries):
    """Plain numbers, one lock per request (see the module doc)."""

    __slots__ = ("active", "depth", "e2e", "inference", "lock", "model", "outcomes", "queue_wait", "rejections", "route",
                 "ttft")  # fmt: skip

    def __init__(self, route: str, model: str) -> None:
        self.route, self.model = route, model
        self.lock = threading.Lock()
        self.depth = 0
        self.active = 0
        self.queue_wait = _Hist(catalog.REQUEST_QUEUE_WAIT.buckets or ())
        self.inference = _Hist(catalog.REQUEST_INFERENCE.buckets or ())
        self.e2e = _Hist(catalog.REQUEST_E2E.buckets or ())
        self.ttft = _Hist(catalog.REQUEST_TTFT.buckets or ())
        self.outcomes = dict.fromkeys(_OUTCOMES, 0)
        self.rejections = dict.fromkeys(REJECTION_REASONS, 0)

    def queued(self) -> None:
        with self.lock:
            self.depth += 1

    def dequeued(self) -> None:
        with self.lock:
            self.depth -= 1

    def started(self) -> None:
        with self.lock:
            self.active += 1

    def rejected(self, reason: str) -> None:
        with self.lock:
            self.rejections[reason] += 1

    def finished(
        self,
        outcome: str,
        released: bool,
        queue_wait: float | None,
        inference: float | None,
        e2e: float | None,
        ttft: float | None,
    ) -> None:
        # _Hist.observe inlined: this runs once per request, and a call costs as much as the update
        with self.lock:
            if released:
                self.active -= 1
            if queue_wait is not None:
                h = self.queue_wait
                h.counts[bisect_left(h.bounds, queue_wait)] += 1
                h.sum += queue_wait
            if inference is not None:
                h = self.inference
                h.counts[bisect_left(h.bounds, inference)] += 1
                h.sum += inference
            if e2e is not None:
                h = self.e2e
                h.counts[bisect_left(h.bounds, e2e)] += 1
                h.sum += e2e
            if ttft is not None:
                h = self.ttft
                h.counts[bisect_left(h.bounds, ttft)] += 1
                h.sum += ttft
            self.outcomes[outcome] += 1


class PromChildren:
    """The prometheus_client children of one (route, model): where a multiprocess series' values live."""

    __slots__ = ("active", "depth", "e2e", "inference", "outcomes", "queue_wait", "rejections", "ttft")

    def __init__(
        self,
        queue_wait: Any,
        inference: Any,
        e2e: Any,
        ttft: Any,
        depth: Any,
        active: Any,
        outcomes: dict[str, Any],
        rejections: dict[str, Any],
    ) -> None:
        self.queue_wait, self.inference, self.e2e, self.ttft = queue_wait, inference, e2e, ttft
        self.depth, self.active = depth, active
        self.outcomes, self.rejections = outcomes, rejections

    def histograms(self) -> tuple[Any, Any, Any, Any]:
        return self.queue_wait, self.inference, self.e2e, self.ttft


def batchable(children: PromChildren) -> bool:
    """Whether the histogram children hold one value per bucket, +Inf last, as :class:`_Hist` counts them.

    A batched flush adds a whole bucket's count to prometheus_client's value of that bucket; this is
    the layout of every prometheus_client release this package supports (``_buckets``, ``_sum``). Should
    a release change it, the series fall back to writing every observation (:class:`DirectRequestSeries`).
    """
    specs = (catalog.REQUEST_QUEUE_WAIT, catalog.REQUEST_INFERENCE, catalog.REQUEST_E2E, catalog.REQUEST_TTFT)
    for spec, child in zip(specs, children.histograms(), strict=True):
        buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
        if not isinstance(buckets, list) or total is None or len(buckets) != len(spec.buckets or ()) + 1:
            return False
        if not all(hasattr(v, "inc") for v in (*buckets, total)):
            return False
    return True


class BatchedRequestSeries(FastRequestSeries):
    """Multiprocess series: the request path updates plain numbers; :meth:`flush` writes what changed into the
    prometheus_client children's shared values (see the module doc)."""

    __slots__ = ("_children", "_flush_lock", "_on_error", "_written_active", "_written_depth")

    def __init__(self, route: str, model: str, children: PromChildren, on_error: Callable[[str], None]) -> None:
        super().__init__(route, model)
        self._children = children
        self._on_error = on_error
        self._flush_lock = threading.Lock()  # one flush at a time: the gauges' levels are written in order
        self._written_depth: int | None = None
        self._written_active: int | None = None
        _register(self)

    def flush(self) -> None:
        """Add what changed since the last flush to the shared values. Never raises (a failure is counted)."""
        try:
            with self._flush_lock:
                with self.lock:
                    hists = (self.queue_wait, self.inference, self.e2e, self.ttft)
                    taken = [h for h in hists if any(h.counts)]
                    if taken:
                        self.queue_wait, self.inference, self.e2e, self.ttft = (
                            _Hist(h.bounds) if h in taken else h for h in hists
                        )
                    outcomes = _take(self.outcomes)
                    reasons = _take(self.rejections)
                    depth, active = self.depth, self.active
                children = self._children
                for h, child in zip(hists, children.histograms(), strict=True):
                    if h in taken:
                        for value, count in zip(child._buckets, h.counts, strict=True):
                            if count:
                                value.inc(count)
                        child._sum.inc(h.sum)
                for outcome, n in outcomes.items():
                    children.outcomes[outcome].inc(n)
                for reason, n in reasons.items():
                    children.rejections[reason].inc(n)
                if depth != self._written_depth:
                    children.depth.set(depth)
                    self._written_depth = depth
                if active != self._written_active:
                    children.active.set(active)
                    self._written_active = active
        except Exception:
            log.debug("could not flush request metrics of %s", self.route, exc_info=True)
            with contextlib.suppress(Exception):  # the error counter itself broken: nothing left to tell
                self._on_error("metrics")

    def after_fork(self) -> None:
        """In a forked child: fresh locks and nothing pending -- what the parent counted is the parent's to flush."""
        self.lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self.depth = self.active = 0
        for h in (self.queue_wait, self.inference, self.e2e, self.ttft):
            h.counts = [0] * len(h.counts)
            h.sum = 0.0
        self.outcomes = dict.fromkeys(self.outcomes, 0)
        self.rejections = dict.fromkeys(self.rejections, 0)
        self._written_depth = self._written_active = None


def _take(counts: dict[str, int]) -> dict[str, int]:
    """The non-zero counts, zeroed in place (caller holds the series lock)."""
    out = {k: v for k, v in counts.items() if v}
    for k in out:
        counts[k] = 0
    return out


class DirectRequestSeries(RequestSeries):
    """Multiprocess series writing every update straight to prometheus_client (the fallback of :func:`batchable`)."""

    def __init__(self, children: PromChildren) -> None:
        self.c = children

    def queued(self) -> None:
        self.c.depth.inc()

    def dequeued(self) -> None:
        self.c.depth.dec()

    def started(self) -> None:
        self.c.active.inc()

    def rejected(self, reason: str) -> None:
        self.c.rejections[reason].inc()

    def finished(
        self,
        outcome: str,
        released: bool,
        queue_wait: float | None,
        inference: float | None,
        e2e: float | None,
        ttft: float | None,
    ) -> None:
        c = self.c
        if released:
            c.active.dec()
        if queue_wait is not None:
            c.queue_wait.observe(queue_wait)
        if inference is not None:
            c.inference.observe(inference)
        if e2e is not None:
            c.e2e.observe(e2e)
        if ttft is not None:
            c.ttft.observe(ttft)
        c.outcomes[outcome].inc()


# --------------------------------------------------------------------------- the flusher (one per process)

_BATCHED: list[BatchedRequestSeries] = []  # strong: prometheus_client keeps every value alive anyway
_STATE_LOCK = threading.Lock()
_flusher: threading.Thread | None = None
_wake = threading.Event()


def _register(series: BatchedRequestSeries) -> None:
    global _flusher
    with _STATE_LOCK:
        _BATCHED.append(series)
        if _flusher is None:
            _flusher = threading.Thread(target=_flush_loop, name="llmdiag-metrics-flush", daemon=True)
            _flusher.start()


def _flush_loop() -> None:
    while True:
        _wake.wait(FLUSH_INTERVAL_S)
        flush_batched()


def flush_batched() -> None:
    """Write every batched series' pending values now (before a scrape, at close, at exit). Never raises."""
    with _STATE_LOCK:
        series = list(_BATCHED)
    for s in series:
        s.flush()


def _after_fork_in_child() -> None:
    global _STATE_LOCK, _flusher
    _STATE_LOCK = threading.Lock()
    _flusher = None  # threads do not survive a fork: the next registration or flush starts one
    for s in _BATCHED:
        s.after_fork()
    if _BATCHED:
        _flusher = threading.Thread(target=_flush_loop, name="llmdiag-metrics-flush", daemon=True)
        _flusher.start()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(flush_batched)  # a worker that exits normally (SIGTERM to uvicorn) loses nothing
