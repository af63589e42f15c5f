"""One pass over the request table: the load each request met, and how waiting and serving change with it.

Queueing theory splits a request's time in the system into waiting and service, W = W_q + S. A
backlog (too little capacity) grows W_q with load while S stays flat; a service that thrashes or
contends grows S itself. ``analyse_requests`` measures both, once per analysis, for every rule that
asks (``requests.queue_backlog``, ``requests.thrashing``, ``config.unsafe``): per request, the number
of requests in the system at its arrival (the load it met); low-load and high-load quartiles by that
number give the baseline and the loaded service time and queue wait; a time split (first fifth vs the
worst fifth) catches a service that slows over time at constant load; the load curve and its USL fit
say whether throughput plateaus or falls.

The thresholds of the queue-vs-thrash test live here too, because two rules apply them: the
per-request ones (``requests.*``) and the one on aggregated histograms (``aggregated.queue_vs_thrash``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from diag.rules import levels, numstats
from diag.rules.base import TooLittleData
from diag.rules.context import AnalysisContext, shared
from diag.rules.usl import LoadCurve, UslFit, concurrency_levels, count_at, fit_usl, load_curve
from diag.timeline import Timeline

MIN_REQUESTS = 30  # started requests; below this a quartile is a handful of requests and medians are noise

# Service time "flat" vs "inflated", relative to its low-load baseline. With enough capacity S does not
# depend on load: a loaded median within +20 % of the calm one is read as flat (a margin for batching and
# for the noise of a quartile's median), +50 % or more as the service itself slowing down.
S_FLAT = 1.2
S_INFLATED = 1.5
S_SEVERE = 3.0  # three times its calm level: severely inflated
# A wait that dwarfs the service time: at >= 5x the inference time at load the queue is >= 83 % of each request's
# latency, and a service slowed by less than S_SEVERE cannot account for it -- more work arrives than the slots
# serve, with the slowdown contributing (a 17x wait over a 2x slower inference is a backlog, not a coin toss).
WAIT_DOMINATES = 5.0
# Queue wait counts as risen when the loaded median is at least this long (absolute and relative to S),
# and several times the calm median: a backlog of 20 ms in front of a 2 s service is not an incident.
W_MIN_S = 0.05
W_MIN_VS_S = 0.5
W_RISE = 4.0
W_RISE_MARGIN_S = 0.02  # ... plus 20 ms, so a calm median of ~0 does not make every wait a rise
# A window with no calm period to compare with is a backlog when the evidence is overwhelming: at least
# OVERWHELM_SHARE of the started requests each waited OVERWHELM_FACTOR x their own inference time.
OVERWHELM_FACTOR = levels.OVERWHELM_FACTOR  # shared with the queue cause alert
OVERWHELM_SHARE = 0.8

MIN_QUARTILE = 5  # requests in the low- and high-load quartiles, however few started
KENDALL_MAX_POINTS = 20_000  # Kendall's tau on a stride beyond this: O(n log^2 n), a million rows stay under a second
ACTIVE_BUCKET = 0.05  # load-curve buckets with at least this many requests in the system on average are active
BUSY_QUANTILE = 0.75  # the busiest quarter of the active buckets ...
PEAK_QUANTILE = 0.9  # ... against the p90 goodput: ~1 when throughput plateaus under load
# Throughput falls as concurrency grows (retrograde): the fitted USL peak lies inside the range and the highest
# concurrency level lost >= 10 % of the peak goodput, or that level alone lost >= 20 %.
RETROGRADE_FIT_LOSS = 0.9
RETROGRADE_LOSS = 0.8


@dataclass
class RequestLoad:
    """What the request table says about waiting vs serving, at low and high load."""

    started: int
    total: int
    t_first: float
    t_last: float
    load_low: float  # median requests in system met at arrival, low-load quartile
    load_high: float
    s_base: float  # median inference seconds, low-load quartile
    s_high: float
    s_high_p99: float
    s_early: float  # median inference seconds, first fifth of requests by start time
    s_worst: float  # worst fifth's median
    w_low: float  # median queue wait, low-load quartile
    w_high: float
    w_high_p95: float
    tau_s: float  # Kendall tau of inference time vs load met
    tau_w: float
    high_start: float  # arrival range of the high-load quartile (where the incident shows)
    high_end: float
    curve: LoadCurve | None
    fit: UslFit | None
    x_peak: float  # highest mean goodput over concurrency levels (req/s)
    n_at_peak: float
    x_top: float  # mean goodput at the highest concurrency level
    n_top: float
    x_loaded_share: float  # goodput in the busiest buckets / p90 goodput: ~1 = plateau
    little_l: float  # mean requests in system
    little_lw: float  # arrival rate x mean time in system
    outcomes: dict[str, int]

    @property
    def s_inflation(self) -> float:
        by_load = self.s_high / self.s_base if self.s_base > 0 else 1.0
        by_time = self.s_worst / self.s_early if self.s_early > 0 else 1.0
        return max(by_load, by_time)

    @property
    def retrograde(self) -> bool:
        """Throughput falls as concurrency grows: the fitted peak is inside the range, or the top level lost >= 20 %."""
        if self.fit is not None and self.fit.retrograde and self.x_top < RETROGRADE_FIT_LOSS * self.x_peak:
            return True
        return self.n_top > self.n_at_peak and self.x_top < RETROGRADE_LOSS * self.x_peak

    @property
    def little_error(self) -> float:
        return abs(self.little_l - self.little_lw) / self.little_l if self.little_l > 0 else math.nan


def analyse_requests(tl: Timeline, ac: AnalysisContext | None = None) -> RequestLoad | None:
    """The shared pass over the request table, once per analysis: several rules ask on one timeline."""
    return shared(ac, tl, "requests.analyse", lambda: _analyse(tl))


def too_few_requests(tl: Timeline) -> TooLittleData | None:
    """What the request rules say when the table has rows but fewer than ``MIN_REQUESTS`` started ones."""
    req = tl.requests
    if not len(req) or "start" not in req:
        return None
    n = int(np.isfinite(req["start"]).sum())
    if n >= MIN_REQUESTS:
        return None
    return TooLittleData(f"{n} started requests", f"{MIN_REQUESTS} started requests")


def _kendall(x: np.ndarray, y: np.ndarray) -> float:
    if x.size > KENDALL_MAX_POINTS:
        step = x.size // KENDALL_MAX_POINTS + 1
        x, y = x[::step], y[::step]
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    tau = numstats.kendalltau(x, y)
    return tau if np.isfinite(tau) else 0.0


def _analyse(tl: Timeline) -> RequestLoad | None:
    req = tl.requests
    if len(req) == 0:
        return None
    arrival, start, finish = req["arrival"], req["start"], req["finish"]
    valid = np.isfinite(arrival) & np.isfinite(finish) & (finish >= arrival)
    started = valid & np.isfinite(start)
    n = int(started.sum())
    if n < MIN_REQUESTS:
        return None
    # First, while nothing else of this pass is held: it sorts and integrates its own copies of the columns (a day
    # of a million requests: ~60 MiB at once), and only its bucket-sized result outlives it.
    curve = load_curve(req, tl.start, tl.end)
    origin = float(np.min(arrival[valid]))
    load = count_at(arrival[started] - origin, arrival[valid] - origin, finish[valid] - origin)
    s = req["inference_s"][started]
    w = req["queue_wait_s"][started]
    arr = arrival[started]
    q = max(MIN_QUARTILE, n // 4)
    order = np.lexsort((arr, load))  # by load met, ties by time
    low, high = order[:q], order[-q:]
    by_start = np.argsort(start[started], kind="stable")
    fifths = [s[part] for part in np.array_split(by_start, 5)]
    medians = [numstats.finite_median(f) for f in fifths]
    del fifths, by_start
    fit = None
    x_peak = x_top = n_at_peak = n_top = math.nan
    loaded_share = math.nan
    little_l = little_lw = math.nan
    if curve is not None and len(curve) >= 2:
        active = curve.n_system > ACTIVE_BUCKET
        fit = fit_usl(curve.n_service[active], curve.throughput[active])
        lv, lx, _ = concurrency_levels(curve.n_service[active], curve.throughput[active], min_buckets=2)
        if lv.size < 2:
            lv, lx, _ = concurrency_levels(curve.n_service[active], curve.throughput[active], min_buckets=1)
        if lv.size:
            i_peak = int(np.argmax(lx))
            x_peak, n_at_peak = float(lx[i_peak]), float(lv[i_peak])
            x_top, n_top = float(lx[-1]), float(lv[-1])
        if active.sum() >= 4:
            busy = curve.n_system[active] >= np.quantile(curve.n_system[active], BUSY_QUANTILE)
            p90 = float(np.quantile(curve.throughput[active], PEAK_QUANTILE))
            loaded_share = float(np.mean(curve.throughput[active][busy]) / p90) if p90 > 0 else math.nan
        span = float(curve.edges[-1] - curve.edges[0])
        little_l = float(np.mean(curve.n_system))
        little_lw = float(valid.sum() / span * np.mean(finish[valid] - arrival[valid])) if span > 0 else math.nan
    outcomes: dict[str, int] = {}
    if "outcome" in req:
        # counted over the objects themselves: astype(str) + np.unique made two fixed-width copies of the column
        # (2 x 68 MiB for a million requests, the analysis's peak); then named by their text (a few distinct values:
        # str() on each of a million rows cost 0.17 s more than the count)
        counted: Counter[str] = Counter()
        for value, count in Counter(req["outcome"].tolist()).items():
            counted[str(value)] += count
        outcomes = {v: counted[v] for v in sorted(counted)}
    s_high_vals = s[high]
    return RequestLoad(
        started=n,
        total=int(valid.sum()),
        t_first=origin,
        t_last=float(np.max(finish[valid])),
        load_low=numstats.finite_median(load[low]),
        load_high=numstats.finite_median(load[high]),
        s_base=numstats.finite_median(s[low]),
        s_high=numstats.finite_median(s_high_vals),
        s_high_p99=float(np.quantile(s_high_vals[np.isfinite(s_high_vals)], 0.99))
        if np.isfinite(s_high_vals).any()
        else math.nan,
        s_early=medians[0],
        s_worst=float(np.nanmax(medians)),
        w_low=numstats.finite_median(w[low]),
        w_high=numstats.finite_median(w[high]),
        w_high_p95=float(np.quantile(w[high], 0.95)),
        tau_s=_kendall(load, s),
        tau_w=_kendall(load, w),
        high_start=float(np.min(arr[high])),
        high_end=float(np.max(finish[started][high])),
        curve=curve,
        fit=fit,
        x_peak=x_peak,
        n_at_peak=n_at_peak,
        x_top=x_top,
        n_top=n_top,
        x_loaded_share=loaded_share,
        little_l=little_l,
        little_lw=little_lw,
        outcomes=outcomes,
    )
