"""A whole fleet from one Prometheus in one pass: each signal queried once for every target, split per target.

Why: asked "which of my 200 nodes are sick, and why?", running ``load_prometheus`` once per target costs N
query sets (about 60 range queries each) and N scrape-interval probes. Here the same query set runs once
with the fleet's selector: the per-series queries (host, cgroups, processes, GPUs, OOM counters) already
return one series per target, with its labels, and the request side's aggregations keep the target label
(``sum by (<label>) (...)``, ``sum by (le, <label>)`` for a histogram's buckets: from Prometheus their rates once,
the quantiles made here as its ``histogram_quantile`` makes them, elsewhere under the store's own
``histogram_quantile``; ``runs_prometheus_engine`` says why). The results are then
split by that label into one ``_Loaded`` per target and each is assembled by the single-target path's own
``_assemble``, so a target's Timeline is built as ``load_prometheus`` would build it for that target alone.
The number of queries depends on the catalog, never on the number of targets.

The target is the value of the ``by`` label (default ``instance``). For ``instance`` the port is dropped
(``10.0.0.5:9464`` -> ``10.0.0.5``), as the single-target path groups host series: the agent on :9464 and
the inference engine on :8000 are one machine and one diagnosis. The request side is aggregated by
``instance`` and mapped to the host here, not with ``label_replace`` in PromQL (which runs its regex for
every series at every step: measured 2-3x the cost of the quantile queries). Limitation: two backends on one
machine, on two ports, give one target whose request side is the first backend's (a warning says so; a label
naming each backend, with ``by``, keeps them apart). Any other label (the shipped scrape config's ``host``)
is taken as it is.

Fallback families (node_exporter, cAdvisor, DCGM) are queried even when ours were found -- some targets
may have only those -- and chosen per target: ours where the target has them. Series without the label
are left out and counted (``Fleet.unlabelled``).
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import numpy as np

from collectors import backends as bk
from diag.sources.prometheus import (
    _QUANTILES,
    _assemble,
    _check_window,
    _host_of,
    _Loaded,
    _Prometheus,
    _Queries,
    _resolution,
    _Result,
    _series,
)
from diag.timeline import Series, Timeline
from diag.timeline import signals as sig
from diag.timeline.backends import bucket_quantile

log = logging.getLogger(__name__)
_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Queries in flight. 2: a query is evaluated and encoded on one core of the store, so two at once use two. Measured by
# bench/fleet.py at 200 targets x 1 h on a quiet 2-core host, Prometheus 2.42 on the same cores: load 36.0 s with one
# in flight, 20.9-22.2 s with two, 20.6 s with three (the store's own CPU, ~33 s over two cores, is the floor). On a
# host loaded by other work the same comparison showed no gain (the cores were not free) -- a store on its own
# machine has them free.
CONCURRENCY = 2
MIN_POINTS = 12  # a target whose longest series has fewer steps is "too little data" (3 rate windows of 4 steps)

Progress = Callable[[str], None]


def check_label(label: str) -> str:
    """A Prometheus label name to group by; ValueError (one line) otherwise. ``__name__`` and the like are refused."""
    if not _LABEL_NAME.match(label) or label.startswith("__"):
        raise ValueError(f"--by {label!r}: not a label name (letters, digits and _, not starting with a digit or __)")
    return label


@dataclass
class FleetTarget:
    """One target's share of the fleet's results: picklable, so its Timeline can be assembled in a worker process."""

    name: str
    loaded: _Loaded
    url: str
    selector: str
    start: float
    end: float

    @property
    def points(self) -> int:
        """Steps in the target's longest series: how much there is to judge."""
        lengths = [len(s) for s in self.loaded.service.values()] + [len(r.ts) for r in _results(self.loaded)]
        return max(lengths, default=0)

    def timeline(self) -> Timeline:
        """Assembled exactly as ``load_prometheus`` assembles one selector's results."""
        return _assemble(self.loaded, self.url, self.selector, self.start, self.end)


@dataclass
class Fleet:
    """Every target's share, and what it cost."""

    targets: list[FleetTarget]
    by: str
    selector: str
    queries: int
    step: float
    window: tuple[float, float]
    unlabelled: int = 0  # series without the grouping label, left out


def load_fleet(
    url: str,
    *,
    selector: str,
    by: str = "instance",
    since_s: float = 3600,
    step_s: float | None = None,
    timeout_s: float = 60.0,
    until: float | None = None,
    progress: Progress | None = None,
    concurrency: int = CONCURRENCY,
    headers: Mapping[str, str] | None = None,
) -> Fleet:
    """Every target ``selector`` matches, over the last ``since_s`` seconds, split by label ``by``.

    ``concurrency``: queries in flight at once, for a Prometheus with cores to spare: the host parts, every signal's
    first feed and a histogram's statistics are asked side by side, each reply decoded while the store works on the
    next ones. The queries issued are the same whatever it is. ``headers``: sent with every
    query (``prometheus.request_headers``: authentication, the tenant), never shown.

    Raises ValueError (one line) on a bad label, an unreachable server or a refused query.
    """
    check_label(by)
    _check_window(since_s, step_s)
    say = progress or (lambda _msg: None)
    end = float(until) if until is not None else time.time()
    start = end - float(since_s)
    prom = _LazyPrometheus(url, selector, timeout_s, headers, in_flight=concurrency)
    try:
        step, window = _resolution(prom, end, since_s, step_s)
        loaded = _Loaded()
        parts = ("host", "cgroups", "processes", "gpus", "ooms")
        signals = bk.signals()
        # Threads for every part and every signal's first feed, so that the store always has ``concurrency`` queries
        # to work on (``_LazyPrometheus`` holds the rest back); a histogram's statistics on threads of their own, as
        # their callers wait for them.
        with ThreadPoolExecutor(max_workers=len(parts) + len(signals)) as pool, \
                ThreadPoolExecutor(max_workers=max(1, concurrency) * len(_QUANTILES)) as stats:  # fmt: skip
            q = _FleetQueries(prom, start, end, step, window, by, stats if concurrency > 1 else None)
            q.quantiles_here = runs_prometheus_engine(prom)
            say(f"querying host, cgroup, process, GPU and OOM series and the request side ({concurrency} at a time)")
            # Each part fills its own lists of ``loaded`` (and of ``q.fallback``): they run side by side. Every
            # signal's first feed is queried whatever the parts find, so it is asked meanwhile (``service``).
            host = [pool.submit(getattr(q, part), loaded) for part in parts]
            first = {signal: pool.submit(q.feed_by_target, bk.feeds_of(signal)[0]) for signal in signals} \
                if concurrency > 1 else {}  # fmt: skip
            _first_failure([*host, *first.values()])
            say(f"host, cgroup, process, GPU and OOM series read; the request side ({prom.queries} queries so far)")
            q.service(loaded, {signal: future.result() for signal, future in first.items()})
        queries = prom.queries
    except _Aborted:  # a query not sent after another failed, reached first (a histogram's statistics, in order)
        assert prom.failure is not None
        raise prom.failure from None
    finally:
        prom.close()
    if q.shadowed:
        say(
            f"{len(q.shadowed)} targets have several backends (instances on one host); the first one's request side "
            "was used for each: --by a label naming each backend keeps them apart"
        )
    shares, unlabelled = _split(loaded, q.fallback, q.service_by_target, by)
    targets = [FleetTarget(name, share, url, _target_selector(prom.selector, by, name), start, end)
               for name, share in sorted(shares.items())]  # fmt: skip
    say(f"{len(targets)} targets from {queries} queries (step {step:g} s)")
    return Fleet(targets, by, prom.selector, queries, step, (start, end), unlabelled)


def _first_failure(futures: list[Future[Any]]) -> None:
    """Wait for ``futures``; raise the first real failure among them (one not sent after it, ``_Aborted``, is not)."""
    wait_futures(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    real = [e for e in errors if not isinstance(e, _Aborted)]
    if real or errors:
        raise (real or errors)[0]  # type: ignore[misc]


def _target_selector(selector: str, by: str, name: str) -> str:
    """What the target's Timeline says it was read with (the fleet's matchers plus the target's)."""
    value = re.escape(name) + "(:[0-9]+)?" if by == "instance" else name
    quoted = value.replace("\\", "\\\\").replace('"', '\\"')  # a PromQL string literal
    own = f'{by}=~"{quoted}"' if by == "instance" else f'{by}="{quoted}"'
    return ",".join(m for m in (selector, own) if m)


class _Reply(msgspec.Struct):
    """A Prometheus API reply with its series left undecoded (each is decoded on its own, see ``_LazyPrometheus``)."""

    status: str = ""
    data: dict[str, msgspec.Raw] = {}
    errorType: str | None = None
    error: str | None = None
    warnings: list[str] = []
    isPartial: bool | None = None  # a VictoriaMetrics cluster with a storage node down says so


class _RawSeries(msgspec.Struct):
    metric: dict[str, str] = {}
    values: list[tuple[float, str]] = []


class _FloatSeries(msgspec.Struct):
    """A series whose values are decoded straight to floats (``"1.5"`` -> 1.5, see ``_decode_series``)."""

    metric: dict[str, str] = {}
    values: list[tuple[float, float]] = []


_STRICT = msgspec.json.Decoder(_RawSeries)
# Non-strict: a number in a string is decoded as the number, by the same correctly rounded parser (``"NaN"`` and
# ``"-Inf"`` included, but not ``"+Inf"``, which falls back to the strict form).
_FLOATS = msgspec.json.Decoder(_FloatSeries, strict=False)


def _decode_series(raw: msgspec.Raw) -> tuple[dict[str, str], np.ndarray, np.ndarray]:
    """One series' labels, times and values.

    Why not the strict form alone: there each value is a Python string, then parsed again by numpy -- at 800
    targets about 110 M points, most of the client's time. Decoded as floats and flattened in one pass it costs
    half (the values are the same floats: both parsers round correctly). A series holding ``"+Inf"`` (a quantile
    in the last bucket) takes the strict form."""
    try:
        item = _FLOATS.decode(raw)
        flat = np.fromiter(itertools.chain.from_iterable(item.values), dtype=np.float64, count=2 * len(item.values))
        return item.metric, flat[0::2].copy(), flat[1::2].copy()
    except msgspec.ValidationError:
        strict = _STRICT.decode(raw)
        ts = np.fromiter((v[0] for v in strict.values), dtype=np.float64, count=len(strict.values))
        vals = np.array([v[1] for v in strict.values], dtype=np.float64)  # "NaN", "+Inf" parse as floats
        return strict.metric, ts, vals


class _Aborted(Exception):
    """A query not sent because another one failed first (never reaches the caller: that failure does)."""


class _LazyPrometheus(_Prometheus):
    """The query client, decoding a reply's series one at a time.

    Why: a fleet's per-series queries answer with every target's series at once (200 machines' host memory
    families: ~16 000 series of 720 points). Decoded whole, as ``json`` does, every point is a list, a float and a
    string -- several GiB at that size; here the reply stays as bytes and each series becomes its two arrays before
    the next is decoded. Same checks and errors as the single path's client.
    """

    def __init__(self, url: str, selector: str, timeout_s: float, headers: Mapping[str, str] | None = None,
                 in_flight: int = 1) -> None:  # fmt: skip
        super().__init__(url, selector, timeout_s, headers)
        self._lock = threading.Lock()  # queries run on several threads (httpx's client is thread-safe)
        # The store's share: at most ``in_flight`` requests at once, however many threads have one to make. Only the
        # request is inside (the server evaluating and encoding, the reply on the wire); decoding it is not, so the
        # store is handed its next query while this process decodes the last reply.
        self._in_flight = threading.BoundedSemaphore(max(1, in_flight))
        # Set once a query failed: the other threads' queries are not sent (``load_fleet`` raises the first failure
        # at once instead of after the dozens of queries still waiting for their turn).
        self.aborted = threading.Event()
        self.failure: BaseException | None = None  # the failure that set it
        self.grids = _Grids()  # times shared by the series of every reply

    def _count(self) -> None:
        with self._lock:
            self.queries += 1

    def _post(self, where: str, params: dict[str, Any]) -> httpx.Response:
        with self._in_flight:
            if self.aborted.is_set():
                raise _Aborted
            try:
                resp = super()._post(where, params)
            except BaseException:
                self.aborted.set()
                raise
            if resp.status_code != 200:  # a refusal (``_call`` says which): set before the next request may go
                self.aborted.set()
            return resp

    def _call(self, path: str, params: dict[str, Any]) -> Any:
        try:
            return super()._call(path, params)
        except _Aborted:
            raise
        except BaseException as exc:
            with self._lock:
                if self.failure is None:
                    self.failure = exc
            self.aborted.set()
            raise

    def _decode(self, resp: httpx.Response) -> Any:
        reply = msgspec.json.decode(resp.content, type=_Reply)
        return {"status": reply.status, "data": reply.data, "errorType": reply.errorType, "error": reply.error,
                "warnings": reply.warnings, "isPartial": reply.isPartial}  # fmt: skip

    def range(self, query: str, start: float, end: float, step: float) -> list[_Result]:
        params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        return _lazy_matrix(self._call("/api/v1/query_range", params), self.grids)

    def raw(self, query: str, at: float) -> list[_Result]:
        return _lazy_matrix(self._call("/api/v1/query", {"query": query, "time": f"{at:.3f}"}), self.grids)


class _Grids:
    """Time arrays shared between series: the series of a range query mostly stand on the same steps.

    Why: the times are half of what a fleet holds (800 targets: ~110 M points, 0.9 GB of times alone), and nearly
    all are copies of a few step grids. A series whose times equal a grid already seen gets that grid's array,
    made read-only so that a later in-place change fails loudly instead of changing every series sharing it."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, float, float], list[np.ndarray]] = {}

    def share(self, ts: np.ndarray) -> np.ndarray:
        if not ts.size:
            return ts
        same = self._seen.setdefault((ts.size, float(ts[0]), float(ts[-1])), [])
        for grid in same:
            if np.array_equal(grid, ts):
                return grid
        if len(same) < 8:  # a few irregular series with the same ends must not make every lookup long
            ts.flags.writeable = False
            same.append(ts)
        return ts


def _lazy_matrix(data: dict[str, msgspec.Raw], grid: _Grids | None = None) -> list[_Result]:
    """As ``prometheus._parse_matrix``, one series decoded at a time; a series in another shape is left out."""
    try:
        kind = msgspec.json.decode(data.get("resultType", b'""'))
        items = msgspec.json.decode(data.get("result", b"[]"), type=list[msgspec.Raw]) if kind == "matrix" else []
    except msgspec.DecodeError:
        return []
    grid = grid or _Grids()
    out = []
    for raw in items:
        try:
            metric, ts, vals = _decode_series(raw)
        except (msgspec.DecodeError, ValueError, OverflowError):
            log.warning("Prometheus: a series in an unexpected shape was left out")
            continue
        keep = ~np.isnan(vals) & np.isfinite(ts)
        if keep.all():
            out.append(_Result(metric, grid.share(ts), vals))
        elif keep.any():
            out.append(_Result(metric, grid.share(ts[keep]), vals[keep]))
    return out


class _FleetQueries(_Queries):
    """The single-target query set, with the fallbacks always queried and the request side kept per target."""

    EVERY_FALLBACK = True

    def __init__(self, prom: _Prometheus, start: float, end: float, step: float, window: float, by: str,
                 pool: ThreadPoolExecutor | None = None) -> None:  # fmt: skip
        super().__init__(prom, start, end, step, window)
        self.pool = pool
        self.by = by
        self.shadowed: set[str] = set()  # targets with a second backend whose request side was left out
        self.fallback = _Loaded()  # cAdvisor, DCGM, node_exporter's OOM counter: taken per target where ours lack
        self.service_by_target: dict[str, dict[str, Series]] = defaultdict(dict)
        # A histogram's quantiles made here from its bucket rates (``quantile_results``), or asked of the store: see
        # ``runs_prometheus_engine`` for which stores gain by it.
        self.quantiles_here = False

    def cgroups(self, out: _Loaded) -> None:
        self.cgroups_ours(out)
        self.cgroups_cadvisor(self.fallback)

    def gpus(self, out: _Loaded) -> None:
        self.gpus_ours(out)
        self.gpus_dcgm(self.fallback)

    def ooms(self, out: _Loaded) -> None:
        self.ooms_ours(out)
        self.ooms_node(self.fallback)

    # ---- request side, per target

    def grouped(self, fn: str, inner: str, extra: Iterable[str] = ()) -> str:
        """``fn by (extra, by) (inner)``: the aggregation of the single path, kept per target."""
        return f"{fn} by ({', '.join([*extra, self.by])}) ({inner})"

    def _rate_by(self, name: str, feed: bk.Feed) -> str:
        return self.grouped("sum", f"rate({self._selector(name, feed)}[{self.w}])")

    def _per_target(self, query: str) -> dict[str, Series]:
        return self._pick(self.range(query))

    def _pick(self, results: Iterable[_Result]) -> dict[str, Series]:
        """Each target's series: the first result with its label (a second one, another backend, is noted)."""
        out: dict[str, Series] = {}
        for res in results:
            target = _target_of(res, self.by)
            if target is None:
                continue
            if target in out:
                self.shadowed.add(target)
                continue
            out[target] = _series(res)
        return out

    def feed_by_target(self, feed: bk.Feed) -> dict[str, dict[str, Series]]:
        """What one feed gives each target, by service key: one range query per statistic, whatever the fleet size."""
        name = feed.family.name
        if feed.how == "gauge":
            return _keyed(feed.signal, self._per_target(self.grouped(feed.combine, self._selector(name, feed))))
        if feed.how == "rate":
            return _keyed(feed.signal, self._per_target(self._rate_by(name, feed)))
        if feed.how == "ratio":
            assert feed.per is not None
            query = f"{self._rate_by(name, feed)} / {self._rate_by(feed.per.name, feed)}"
            return _keyed(feed.signal, self._per_target(query))
        if feed.how == "sum_rate":
            return _keyed(feed.signal, self._per_target(self._rate_by(name + "_sum", feed)))
        # The mean beside the quantiles: the single path asks it only once a quantile had data, here both cost one
        # round trip and the mean is kept for targets with quantiles.
        rate = f"rate({self._selector(name + '_bucket', feed)}[{self.w}])"
        mean = f"{self._rate_by(name + '_sum', feed)} / {self._rate_by(name + '_count', feed)}"
        run = self.pool.map if self.pool else map
        if self.quantiles_here:
            buckets, mean_results = run(self.range, [self.grouped("sum", rate, ["le"]), mean])
            quantiles = [self._pick(results) for results in quantile_results(buckets, [q for q, _ in _QUANTILES])]
        else:
            queries = [f"histogram_quantile({q}, {self.grouped('sum', rate, ['le'])})" for q, _ in _QUANTILES]
            *quantile_replies, mean_results = run(self.range, [*queries, mean])
            quantiles = [self._pick(results) for results in quantile_replies]
        means = self._pick(mean_results)
        # Per target as the single path takes them: the quantiles up to the first one without data, and the mean
        # where at least one quantile had data.
        got: dict[str, dict[str, Series]] = {}
        for target in set().union(*quantiles):
            stats: dict[str, Series] = {}
            for (_, stat), per_target in zip(_QUANTILES, quantiles, strict=True):
                if target not in per_target:
                    break
                stats[sig.latency(feed.signal, stat)] = per_target[target]
            if stats:
                if target in means:
                    stats[sig.latency(feed.signal, "mean")] = means[target]
                got[target] = stats
        return got

    def service(self, out: _Loaded, first: Mapping[str, dict[str, dict[str, Series]]] | None = None) -> None:
        """Each signal from, per target, the first feed with data for it; the next feed only while a target lacks it.

        ``first``: what each signal's first feed gave, when it was queried already (``load_fleet``)."""
        known = {t for t in (_target_of(r, self.by) for r in [*_results(out), *_results(self.fallback)]) if t}
        first = first or {}
        for signal in bk.signals():
            have: set[str] = set()
            for i, feed in enumerate(bk.feeds_of(signal)):
                given = first.get(signal) if i == 0 else None
                for target, series in (given if given is not None else self.feed_by_target(feed)).items():
                    if target in have:
                        continue
                    have.add(target)
                    known.add(target)
                    mine = self.service_by_target[target]
                    for key, values in series.items():
                        mine.setdefault(key, values)
                if known and known <= have:
                    break


def runs_prometheus_engine(prom: _Prometheus) -> bool:
    """Whether the store says it is Prometheus (or a store running its query engine: Thanos, Mimir), which gains by
    a fleet's quantiles made here from the bucket rates it sends once.

    Why it differs by store: Prometheus' engine evaluates ``histogram_quantile``'s argument anew for every quantile
    -- the rate of every bucket series -- so two quantiles cost it the rates twice. Measured at 200 targets x 1 h on
    a 2-core host (``bench/fleet.py``, Prometheus 2.42 on the same cores): its CPU 34.3-36.1 s -> 21.9-23.6 s, ours
    9.7-10.1 -> 12.2-13.1 s for the larger replies, load and rules 23.6-24.0 s -> 18.6-19.3 s. VictoriaMetrics
    computes its ``histogram_quantile`` for little: there the same change cost 5-7 s more of our decoding (load
    8.2-9.5 -> 13.9-18.6 s) and ~300 MiB more at the peak, so it is asked for its own quantiles.

    How it is told: Prometheus, Thanos and Mimir answer ``/api/v1/status/buildinfo`` with their version and Go
    version; VictoriaMetrics answers an empty document. Any other answer, or none, keeps the store's quantiles (the
    answer is the same either way, only the cost moves).
    """
    try:
        resp = prom.http.get(f"{prom.base}/api/v1/status/buildinfo")
        body = resp.json()
    except (httpx.HTTPError, ValueError, RecursionError):
        return False
    data = body.get("data") if isinstance(body, dict) else None
    return resp.status_code == 200 and isinstance(data, dict) and bool(data.get("version")) and bool(data.get("goVersion"))


def quantile_results(buckets: Iterable[_Result], qs: Sequence[float]) -> list[list[_Result]]:
    """``histogram_quantile(q, B)`` for each ``q``, made here from ``B``'s own result (cumulative bucket rates with
    an ``le`` label), as Prometheus 2.42 makes it.

    Per series of ``B`` less its ``le``, in the store's order, at each step where any of its buckets has a sample:
    the buckets present, sorted by bound, those with equal bounds added together, every count raised to the highest
    count below it (a count that fell), then ``bucket_quantile`` (the linear interpolation, the ``+Inf`` and
    no-observation cases). A step without a ``+Inf`` bucket or observations has no quantile (the store's NaN, which
    the reply decoding drops). A bucket whose ``le`` is no number is skipped, as the store skips it.

    Histograms whose buckets are all present on one shared step grid with the same bounds -- nearly every target's
    -- are computed together, their columns side by side: one ``bucket_quantile`` per quantile for the fleet.
    """
    groups: dict[tuple[tuple[str, str], ...], list[tuple[float, _Result]]] = {}
    for res in buckets:
        le = res.labels.get("le", "")
        try:  # as Go's ParseFloat reads it: no blanks or digit separators ("+Inf", "1e-3" and "1.0" are numbers)
            bound = float(le) if le == le.strip() and "_" not in le else math.nan
        except ValueError:
            continue
        if math.isnan(bound):
            continue
        key = tuple(sorted((k, v) for k, v in res.labels.items() if k != "le"))
        groups.setdefault(key, []).append((bound, res))
    keys = sorted(groups)  # the store's order: by labels
    answers: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    # Histograms side by side: same step grid (the reply's shared array, alive while its results are) and bounds.
    together: dict[tuple[int, tuple[float, ...]], list[tuple[int, np.ndarray, np.ndarray]]] = defaultdict(list)
    for i, key in enumerate(keys):
        grid, les, counts = _bucket_matrix(groups[key])
        if grid.size and not np.isnan(counts).any():
            together[(id(grid), tuple(les))].append((i, grid, counts))
        else:
            answers[i] = _quantiles_by_pattern(grid, les, counts, qs)
    for (_, bounds), members in together.items():
        grid = members[0][1]
        cumulative = np.maximum.accumulate(np.hstack([counts for *_, counts in members]), axis=0)
        values = [bucket_quantile(q, np.array(bounds), cumulative).reshape(len(members), grid.size) for q in qs]
        for m, (i, *_) in enumerate(members):
            answers[i] = [_kept(grid, v[m]) for v in values]
    out: list[list[_Result]] = [[] for _ in qs]
    for i, key in enumerate(keys):
        for per_q, (ts, values) in zip(out, answers[i], strict=True):
            if ts.size:
                per_q.append(_Result(dict(key), ts, values))
    return out


def _bucket_matrix(series: list[tuple[float, _Result]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One histogram's buckets over the union of their steps: (times, sorted distinct bounds, counts by bound x
    step, NaN where a bucket has no sample); buckets with equal bounds added together where either has one."""
    series = sorted(series, key=lambda item: item[0])
    grids = [res.ts for _, res in series]
    if all(g is grids[0] for g in grids):  # the usual case: one step grid shared by the reply's series
        grid, counts = grids[0], np.vstack([res.values for _, res in series])
    else:
        grid = grids[0] if all(np.array_equal(g, grids[0]) for g in grids) else np.unique(np.concatenate(grids))
        counts = np.full((len(series), grid.size), np.nan)
        for row, (_, res) in enumerate(series):
            counts[row, np.searchsorted(grid, res.ts)] = res.values
    bounds = np.array([b for b, _ in series])
    les, first = np.unique(bounds, return_index=True)
    if les.size < bounds.size:  # "1" and "1.0": one bucket
        summed = np.add.reduceat(np.nan_to_num(counts), first, axis=0)
        anywhere = np.logical_or.reduceat(~np.isnan(counts), first, axis=0)
        counts = np.where(anywhere, summed, np.nan)
    return grid, les, counts


def _quantiles_by_pattern(
    grid: np.ndarray, les: np.ndarray, counts: np.ndarray, qs: Sequence[float]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One histogram whose buckets are not all present at every step: each set of buckets present on its steps."""
    present = ~np.isnan(counts)
    values = np.full((len(qs), grid.size), np.nan)
    patterns, which = np.unique(present, axis=1, return_inverse=True)
    for p in range(patterns.shape[1]):
        rows, cols = patterns[:, p], np.flatnonzero(which.reshape(-1) == p)
        cumulative = np.maximum.accumulate(counts[np.ix_(rows, cols)], axis=0)
        for i, q in enumerate(qs):
            values[i, cols] = bucket_quantile(q, les[rows], cumulative)
    return [_kept(grid, row) for row in values]


def _kept(grid: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The steps with a quantile (the store's NaN steps are dropped from its reply)."""
    keep = ~np.isnan(values)
    return (grid, values) if keep.all() else (grid[keep], values[keep])


def _keyed(signal: str, per_target: dict[str, Series]) -> dict[str, dict[str, Series]]:
    return {target: {signal: series} for target, series in per_target.items()}


def _target_of(res: _Result, by: str) -> str | None:
    if by == "instance":
        return _host_of(res.labels.get("instance", "")) or None
    return res.labels.get(by) or None


def _results(loaded: _Loaded) -> Iterable[_Result]:
    yield from (r for r, *_ in loaded.host)
    yield from (r for r, *_ in loaded.cgroups)
    yield from (r for r, _ in loaded.processes)
    yield from (r for r, *_ in loaded.gpus)
    yield from (r for r, _ in loaded.ooms)
    yield from loaded.model_processes
    yield from loaded.gpu_available
    yield from loaded.gpu_processes


@dataclass
class _Splitter:
    by: str
    shares: dict[str, _Loaded] = field(default_factory=lambda: defaultdict(_Loaded))
    unlabelled: int = 0

    def put(self, part: str, entries: Iterable[object]) -> None:
        for entry in entries:
            res = entry[0] if isinstance(entry, tuple) else entry
            assert isinstance(res, _Result)
            target = _target_of(res, self.by)
            if target is None:
                self.unlabelled += 1
                continue
            getattr(self.shares[target], part).append(entry)


def _split(loaded: _Loaded, fallback: _Loaded, service: dict[str, dict[str, Series]],
           by: str) -> tuple[dict[str, _Loaded], int]:  # fmt: skip
    """One ``_Loaded`` per target; a fallback family's series only for a target without ours."""
    main, spare = _Splitter(by), _Splitter(by)
    for part in ("host", "cgroups", "processes", "gpus", "gpu_available", "gpu_processes", "ooms", "model_processes"):
        main.put(part, getattr(loaded, part))
    for part in ("cgroups", "gpus", "ooms"):
        spare.put(part, getattr(fallback, part))
    shares = main.shares
    for target, extra in spare.shares.items():
        share = shares[target]
        for part in ("cgroups", "gpus", "ooms"):
            if not getattr(share, part):
                setattr(share, part, getattr(extra, part))
    for target, series in service.items():
        shares[target].service.update(series)
    return dict(shares), main.unlabelled + spare.unlabelled
