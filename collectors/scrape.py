"""Scraping an inference backend's own ``/metrics`` into ``BackendSample`` records (``diag collect --scrape``).

Why the agent scrapes at all: most inference hosts run vLLM, TGI or llama.cpp's server, which already export
queue time, waiting/running requests, KV-cache usage, preemptions, TTFT and inter-token latency -- but only a
Prometheus ever read them, so the flight recorder of such a host (and a bundle taken mid-incident) had no
request side at all. Here each scrape keeps exactly the families ``collectors.backends`` maps to a signal:

- fetched with a total deadline (a server that drips bytes is cut off at it), at most ``max_bytes`` read;
  the classic text format asked for (names keep their ``:``), OpenMetrics accepted;
- read by ``collectors.exposition``: only the mapped families' lines, each series parsed by prometheus_client
  once per target and only its value read afterwards, labels no feed selects on summed away, a cap per
  family on what is left;
- histograms are stored as what each bucket gained since the previous successful scrape (zeros left out,
  but each non-zero bucket's lower neighbour kept, so a quantile can interpolate within it);
- a scrape that fails, hangs or returns garbage is a record with ``up`` false and the reason, counted on
  the agent's own ``/metrics`` (``llmdiag_backend_scrape_errors_total{target,reason}``) -- never an
  exception into the agent, never a stop of its sampling. Nothing the backend exports is re-exported.

Every target is scraped on its own thread (``ScrapeLoop``) at the agent's interval, so a hung backend
delays nothing but its own next scrape; the agent writes the records with its next sample.
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from collectors import backends as bk
from collectors import catalog as cat
from collectors.exposition import (
    ERROR_REASONS,
    MAX_BODY_BYTES,
    Hist,
    HistKey,
    Limits,
    Parsed,
    Reader,
    ScrapeError,
    deltas,
)
from collectors.records import BackendSample

log = logging.getLogger(__name__)

# The classic text format only: prometheus_client (vLLM's exporter) answers OpenMetrics whenever the header names it,
# whatever its q-value, and then escapes ``:`` in sample names. A server that speaks only OpenMetrics still answers
# it (parsed by its Content-Type).
ACCEPT = "text/plain;version=0.0.4;q=1.0,*/*;q=0.1"
USER_AGENT = "llm-diag-agent"
MAX_PENDING = 4096  # records waiting for the agent to write them (it drains every sample): beyond, the oldest go


def display_url(url: str) -> str:
    """The URL as recorded and exported: no credentials, no query or fragment (either may carry a token)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path or "/", "", ""))


# --------------------------------------------------------------------------- fetching


@dataclass
class Fetched:
    body: bytes
    content_type: str


def fetch(url: str, timeout_s: float, max_bytes: int = MAX_BODY_BYTES) -> Fetched:
    """GET ``url`` within ``timeout_s`` in total (connect, headers and body), reading at most ``max_bytes``.

    Raises ``ScrapeError``: ``connect`` (refused, unreachable, name not resolved, TLS), ``timeout``, ``http``
    (a status other than 200), ``too_large``.
    """
    parts = urlsplit(url)
    deadline = time.monotonic() + timeout_s
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = conn_cls(parts.hostname or "", parts.port, timeout=max(0.001, timeout_s))
    try:
        try:
            conn.request("GET", path, headers={"Accept": ACCEPT, "User-Agent": USER_AGENT, "Accept-Encoding": "identity"})
            _left(deadline, conn, timeout_s)
            resp = conn.getresponse()
        except TimeoutError:
            raise ScrapeError("timeout", f"no answer within {timeout_s:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise ScrapeError("connect", _why(exc)) from None
        if resp.status != 200:
            raise ScrapeError("http", f"HTTP {resp.status} {resp.reason}".strip())
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise ScrapeError("too_large", f"Content-Length {length} bytes, over the {max_bytes}-byte cap")
        chunks: list[bytes] = []
        got = 0
        while True:
            _left(deadline, conn, timeout_s, got)
            try:
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
            except TimeoutError:
                raise ScrapeError("timeout", f"body not complete within {timeout_s:g} s ({got} bytes read)") from None
            except (OSError, http.client.HTTPException) as exc:
                raise ScrapeError("connect", f"body cut off after {got} bytes: {_why(exc)}") from None
            if not chunk:
                break
            got += len(chunk)
            if got > max_bytes:
                raise ScrapeError("too_large", f"over the {max_bytes}-byte cap")
            chunks.append(chunk)
        return Fetched(b"".join(chunks), resp.getheader("Content-Type") or "")
    finally:
        conn.close()


def _left(deadline: float, conn: http.client.HTTPConnection, timeout_s: float, got: int = 0) -> None:
    """Give the socket only what is left of the deadline; past it, time out (a slow drip cannot outlast it)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ScrapeError("timeout", f"not complete within {timeout_s:g} s ({got} bytes read)")
    if conn.sock is not None:
        conn.sock.settimeout(left)
    else:
        conn.timeout = left


def _why(exc: BaseException) -> str:
    if isinstance(exc, socket.gaierror):
        return f"name not resolved ({exc.strerror or exc})"
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


# --------------------------------------------------------------------------- one target


class TargetScraper:
    """One backend: fetch, parse, and the histogram state the deltas need. ``scrape()`` never raises."""

    def __init__(self, url: str, limits: Limits | None = None, fetcher: Callable[[str, float, int], Fetched] = fetch) -> None:
        self.url = url
        self.target = display_url(url)
        self.limits = limits or Limits()
        self.fetcher = fetcher
        self.previous: dict[HistKey, Hist] = {}
        self.reader = Reader(self.limits)

    def scrape(self, ts: float | None = None) -> BackendSample:
        ts = time.time() if ts is None else ts
        started = time.perf_counter()
        try:
            got = self.fetcher(self.url, self.limits.timeout_s, self.limits.max_bytes)
            parsed = self.reader.read(got.body, got.content_type)
        except ScrapeError as exc:
            return self.failed(ts, exc, time.perf_counter() - started)
        return self.record(ts, parsed, time.perf_counter() - started)

    def from_text(self, ts: float, body: bytes, content_type: str = "text/plain; version=0.0.4") -> BackendSample:
        """A record from an exposition already in hand (tests, the benchmark, replays)."""
        started = time.perf_counter()
        try:
            parsed = self.reader.read(body, content_type)
        except ScrapeError as exc:
            return self.failed(ts, exc, time.perf_counter() - started)
        return self.record(ts, parsed, time.perf_counter() - started)

    def failed(self, ts: float, exc: ScrapeError, duration_s: float) -> BackendSample:
        return BackendSample(ts=ts, target=self.target, dialect="unknown", duration_s=duration_s, dropped_series=0,
                             up=False, error=f"{exc.reason}: {exc.detail}")  # fmt: skip

    def record(self, ts: float, parsed: Parsed, duration_s: float) -> BackendSample:
        gains: dict[str, float] = {}
        for key, hist in parsed.hists.items():
            gains.update(deltas(hist, self.previous.get(key), key[0], key[1]))
            self.previous[key] = hist
        return BackendSample(
            ts=ts, target=self.target, dialect=parsed.dialect, duration_s=duration_s,
            dropped_series=parsed.dropped, gauges=parsed.gauges, counters=parsed.counters, deltas=gains, up=True,
        )  # fmt: skip


# --------------------------------------------------------------------------- health, on the agent's /metrics


class ScrapeHealth(Collector):
    """The scrapes' own health, by target: up, duration, scrapes, errors by reason, series dropped by the cap.

    Nothing the backend exports is re-exported: a backend's families reach Prometheus from the backend itself.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._up: dict[str, tuple[int, str]] = {}
        self._duration: dict[str, float] = {}
        self._scrapes: dict[str, int] = {}
        self._errors: dict[tuple[str, str], int] = {}
        self._dropped: dict[str, int] = {}
        self._kept: dict[str, int] = {}
        self._warned: dict[str, str] = {}

    def observe(self, sample: BackendSample) -> None:
        target = sample.target
        reason = (sample.error or "").split(":", 1)[0] if not sample.up else ""
        with self._lock:
            self._scrapes[target] = self._scrapes.get(target, 0) + 1
            self._up[target] = (int(bool(sample.up)), sample.dialect)
            self._duration[target] = float(sample.duration_s or 0.0)
            self._dropped[target] = self._dropped.get(target, 0) + int(sample.dropped_series or 0)
            self._kept[target] = len(sample.gauges) + len(sample.counters) + len(sample.deltas)
            for r in ERROR_REASONS:
                self._errors.setdefault((target, r), 0)
            if reason:
                self._errors[(target, reason)] = self._errors.get((target, reason), 0) + 1
            changed = self._warned.get(target) != reason
            self._warned[target] = reason
        if changed and reason:
            log.warning("scrape of %s failed (%s); counted, and tried again every sample", target, sample.error)
        elif changed:
            log.info("scraping %s: %s families", target, bk.DIALECT_NAMES.get(sample.dialect, sample.dialect))

    def forget(self, target: str) -> None:
        """A target no longer scraped (an auto-discovered backend that went away): its series leave /metrics."""
        with self._lock:
            for table in (self._up, self._duration, self._scrapes, self._dropped, self._kept, self._warned):
                table.pop(target, None)
            for key in [k for k in self._errors if k[0] == target]:
                del self._errors[key]

    def errors(self, target: str) -> dict[str, int]:
        with self._lock:
            return {r: n for (t, r), n in self._errors.items() if t == target}

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            up, duration, scrapes = dict(self._up), dict(self._duration), dict(self._scrapes)
            errors, dropped, kept = dict(self._errors), dict(self._dropped), dict(self._kept)
        fams = {
            spec.name: (CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily)(
                spec.base_name, spec.help, labels=list(spec.labels))
            for spec in (cat.BACKEND_UP, cat.BACKEND_SCRAPE_DURATION, cat.BACKEND_SCRAPES, cat.BACKEND_SCRAPE_ERRORS,
                         cat.BACKEND_DROPPED_SERIES, cat.BACKEND_KEPT_SERIES)
        }  # fmt: skip
        for target, (value, dialect) in sorted(up.items()):
            fams[cat.BACKEND_UP.name].add_metric([target, dialect], value)
            fams[cat.BACKEND_SCRAPE_DURATION.name].add_metric([target], duration.get(target, 0.0))
            fams[cat.BACKEND_SCRAPES.name].add_metric([target], scrapes.get(target, 0))
            fams[cat.BACKEND_DROPPED_SERIES.name].add_metric([target], dropped.get(target, 0))
            fams[cat.BACKEND_KEPT_SERIES.name].add_metric([target], kept.get(target, 0))
        for (target, reason), n in sorted(errors.items()):
            fams[cat.BACKEND_SCRAPE_ERRORS.name].add_metric([target, reason], n)
        yield from (f for f in fams.values() if f.samples)


# --------------------------------------------------------------------------- the scrape threads


class ScrapeLoop(threading.Thread):
    """Scrapes one target every ``interval_s`` (skipping ticks it overran) until stopped."""

    def __init__(self, scraper: TargetScraper, interval_s: float, sink: Callable[[BackendSample], None]) -> None:
        super().__init__(name=f"scrape {scraper.target}", daemon=True)
        self.scraper = scraper
        self.interval_s = interval_s
        self.sink = sink
        self.stopping = threading.Event()

    def run(self) -> None:
        next_tick = time.monotonic()
        while not self.stopping.is_set():
            try:
                self.sink(self.scraper.scrape())
            except Exception:  # the scraper promises not to raise; a bug here must not end the loop silently
                log.exception("scraping %s failed unexpectedly", self.scraper.target)
            next_tick += self.interval_s
            now = time.monotonic()
            if next_tick < now:
                next_tick = now + self.interval_s - ((now - next_tick) % self.interval_s)
            self.stopping.wait(next_tick - now)

    def stop(self) -> None:
        self.stopping.set()


class Scrapers:
    """Every scraped target, each on its own ``ScrapeLoop``; the agent drains their records with each sample."""

    def __init__(self, interval_s: float, limits: Limits | None = None, health: ScrapeHealth | None = None) -> None:
        self.interval_s = interval_s
        self.limits = limits or Limits()
        self.health = health or ScrapeHealth()
        self._lock = threading.Lock()
        self._pending: deque[BackendSample] = deque()
        self._loops: dict[str, ScrapeLoop] = {}
        self.lost = 0  # records dropped because nobody drained them (the agent stalled)

    def _sink(self, sample: BackendSample) -> None:
        self.health.observe(sample)
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                self._pending.popleft()
                self.lost += 1
            self._pending.append(sample)

    def set_targets(self, urls: Iterable[str]) -> None:
        """Scrape exactly these URLs from now on: new ones start, others stop (their state is dropped)."""
        wanted = list(dict.fromkeys(urls))
        with self._lock:
            gone = [u for u in self._loops if u not in wanted]
            stopped = [self._loops.pop(u) for u in gone]
            for url in wanted:
                if url not in self._loops:
                    loop = ScrapeLoop(TargetScraper(url, self.limits), self.interval_s, self._sink)
                    self._loops[url] = loop
                    loop.start()
        for loop in stopped:
            loop.stop()
            self.health.forget(loop.scraper.target)

    @property
    def targets(self) -> list[str]:
        with self._lock:
            return list(self._loops)

    def drain(self) -> list[BackendSample]:
        with self._lock:
            out = list(self._pending)
            self._pending.clear()
        return out

    def close(self, wait_s: float = 1.0) -> None:
        with self._lock:
            loops = list(self._loops.values())
            self._loops.clear()
        for loop in loops:
            loop.stop()
        deadline = time.monotonic() + wait_s
        for loop in loops:
            loop.join(max(0.0, deadline - time.monotonic()))
