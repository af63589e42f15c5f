"""Load curves from the request table, and the Universal Scalability Law (USL) fit.

Why a module of its own: the queue-backlog and thrashing tests (diag/rules/requestload.py) ask
"how many requests were in flight, and how many finished per second?" -- and the answer has to be
computed exactly and in O(n log n), because a day of traffic is a million requests.

Concurrency is *time-averaged* per bucket (the integral of the in-flight count over the bucket
divided by its width), which is Little's L; counting requests that merely touch a bucket would
overstate it for short requests. Throughput is completions per second (goodput: outcome ``ok``).

USL (Gunther, *Guerrilla Capacity Planning*): X(N) = lambda*N / (1 + sigma*(N-1) + kappa*N*(N-1)).
sigma is contention (queueing for a shared resource: throughput flattens), kappa is coherency cost
(everyone slows everyone: throughput *falls* past N* = sqrt((1-sigma)/kappa)). Thrashing is a
textbook kappa > 0 -- each extra request evicts the pages the others need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diag.rules import numstats
from diag.timeline import Table

MAX_BUCKETS = 5000  # 24 h at ~17 s buckets; keeps every per-bucket step cheap
TARGET_COMPLETIONS_PER_BUCKET = 10  # fewer makes per-bucket throughput mostly Poisson noise


@dataclass
class LoadCurve:
    """Per time bucket: time-averaged in-service / in-system request counts, goodput, mean service time."""

    edges: np.ndarray  # absolute Unix seconds, len = buckets + 1
    n_service: np.ndarray  # requests between start and finish (holding an inference slot)
    n_system: np.ndarray  # requests between arrival and finish (waiting or served)
    throughput: np.ndarray  # ok completions per second
    s_mean: np.ndarray  # mean inference seconds of requests finishing in the bucket (NaN: none)

    @property
    def dt(self) -> float:
        return float(self.edges[1] - self.edges[0])

    @property
    def centers(self) -> np.ndarray:
        return (self.edges[:-1] + self.edges[1:]) / 2

    def __len__(self) -> int:
        return int(self.n_service.size)


def time_averaged_count(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean number of intervals [start, end) open over each bucket between consecutive ``edges``.

    Uses F(e) = sum_i clip(e - s_i, 0, e_i - s_i) = sum_{s_i<e}(e - s_i) - sum_{e_i<e}(e - e_i), evaluated
    with sorted arrays and prefix sums: O((n + buckets) log n). Callers pass times relative to a
    nearby origin so the prefix sums keep their precision.
    """
    s = np.sort(starts)
    e = np.sort(ends)
    cs = np.concatenate(([0.0], np.cumsum(s)))
    ce = np.concatenate(([0.0], np.cumsum(e)))
    ks = np.searchsorted(s, edges, "left")
    ke = np.searchsorted(e, edges, "left")
    integral = (ks * edges - cs[ks]) - (ke * edges - ce[ke])
    width = np.diff(edges)
    return np.diff(integral) / np.where(width > 0, width, 1.0)


def count_at(times: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Number of intervals with start <= t < end at each of ``times`` (O((n + m) log n))."""
    s = np.sort(starts)
    e = np.sort(ends)
    return (np.searchsorted(s, times, "right") - np.searchsorted(e, times, "right")).astype(np.float64)


def load_curve(requests: Table, start: float, end: float) -> LoadCurve | None:
    """Bucket the request table over [start, end]; None when there is too little to bucket.

    The bucket width aims at ~10 completions per bucket (at least 1 s, at most ``MAX_BUCKETS``
    buckets), so a 90 s scenario with a few hundred requests gets a few dozen buckets.
    """
    if not len(requests) or "arrival" not in requests:
        return None
    arrival, begin, finish = requests["arrival"], requests["start"], requests["finish"]
    ok_rows = np.isfinite(arrival) & np.isfinite(finish) & (finish >= arrival)
    if ok_rows.sum() < 2:
        return None
    lo = min(start, float(np.min(arrival[ok_rows])))
    hi = max(end, float(np.max(finish[ok_rows])))
    span = hi - lo
    if span <= 0:
        return None
    started = ok_rows & np.isfinite(begin)
    goodput = started & (_outcome_is(requests, "ok") if "outcome" in requests else True)
    n_done = max(int(goodput.sum()), 1)
    dt = max(1.0, span * TARGET_COMPLETIONS_PER_BUCKET / n_done, span / MAX_BUCKETS)
    buckets = max(1, math.ceil(span / dt))
    rel_edges = np.arange(buckets + 1, dtype=np.float64) * dt
    a = arrival[ok_rows] - lo
    f = finish[ok_rows] - lo
    st = begin[started] - lo
    fs = finish[started] - lo
    n_system = time_averaged_count(a, f, rel_edges)
    n_service = time_averaged_count(st, fs, rel_edges)
    done_idx = np.clip(((finish[goodput] - lo) // dt).astype(np.int64), 0, buckets - 1)
    throughput = np.bincount(done_idx, minlength=buckets).astype(np.float64) / dt
    s_idx = np.clip((fs // dt).astype(np.int64), 0, buckets - 1)
    s_sum = np.bincount(s_idx, weights=fs - st, minlength=buckets)
    s_cnt = np.bincount(s_idx, minlength=buckets)
    with np.errstate(invalid="ignore", divide="ignore"):
        s_mean = np.where(s_cnt > 0, s_sum / np.maximum(s_cnt, 1), np.nan)
    return LoadCurve(rel_edges + lo, n_service, n_system, throughput, s_mean)


def _outcome_is(requests: Table, value: str) -> np.ndarray:
    return np.asarray(requests["outcome"] == value, dtype=bool)


# --------------------------------------------------------------------------- USL


def usl(n: np.ndarray, lam: float, sigma: float, kappa: float) -> np.ndarray:
    """X(N) = lam*N / (1 + sigma*(N-1) + kappa*N*(N-1))."""
    return lam * n / (1.0 + sigma * (n - 1.0) + kappa * n * (n - 1.0))


@dataclass
class UslFit:
    lam: float  # throughput of one request in flight (requests/s)
    sigma: float  # contention, 0..1
    kappa: float  # coherency (crosstalk) cost, >= 0
    n_star: float  # concurrency of peak throughput; inf when kappa ~ 0
    r2: float  # goodness of fit on the level means
    levels: np.ndarray  # concurrency levels the fit used
    level_x: np.ndarray  # mean throughput per level
    level_buckets: np.ndarray  # buckets per level

    @property
    def retrograde(self) -> bool:
        """Throughput falls inside the observed range: the peak N* is below the highest level seen."""
        return self.kappa > 0 and math.isfinite(self.n_star) and self.n_star < float(self.levels.max())


def concurrency_levels(n: np.ndarray, x: np.ndarray, min_buckets: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group buckets by concurrency: integer levels up to 32, else 16 quantile bins. Idle buckets (N < 0.5) are dropped."""
    keep = np.isfinite(n) & np.isfinite(x) & (n >= 0.5)
    n, x = n[keep], x[keep]
    if n.size == 0:
        return np.empty(0), np.empty(0), np.empty(0)
    if n.max() <= 32:
        key = np.rint(n).astype(np.int64)
    else:
        cuts = np.unique(np.quantile(n, np.linspace(0, 1, 17)[1:-1]))
        key = np.searchsorted(cuts, n, "right")
    _, inv, counts = np.unique(key, return_inverse=True, return_counts=True)
    n_mean = np.bincount(inv, weights=n) / counts
    x_mean = np.bincount(inv, weights=x) / counts
    good = counts >= min_buckets
    return n_mean[good], x_mean[good], counts[good].astype(np.float64)


def fit_usl(n: np.ndarray, x: np.ndarray, min_levels: int = 4) -> UslFit | None:
    """Fit the USL to per-bucket (concurrency, throughput) by bounded weighted least squares; None under ``min_levels`` levels.

    The fit runs on level means weighted by sqrt(buckets per level), so a level seen once does not
    pull the curve as hard as one seen a hundred times. ``numstats.usl_fit`` minimises what
    scipy's ``curve_fit`` did (same start, bounds and weights) without importing scipy.
    """
    levels, level_x, counts = concurrency_levels(np.asarray(n, float), np.asarray(x, float))
    if levels.size < min_levels or not np.any(level_x > 0):
        return None
    lam0 = float(level_x[np.argmin(levels)] / max(levels.min(), 1e-9)) or float(level_x.max())
    fitted = numstats.usl_fit(levels, level_x, 1.0 / np.sqrt(counts), (max(lam0, 1e-9), 0.05, 1e-3))
    if fitted is None:
        return None
    lam, sigma, kappa = fitted.lam, fitted.sigma, fitted.kappa
    pred = usl(levels, lam, sigma, kappa)
    ss_res = float(np.sum((level_x - pred) ** 2))
    ss_tot = float(np.sum((level_x - level_x.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    n_star = math.sqrt((1.0 - sigma) / kappa) if kappa > 1e-12 else math.inf
    return UslFit(lam, sigma, kappa, n_star, r2, levels, level_x, counts)


# --------------------------------------------------------------------------- interval coverage


def covered_time(starts: np.ndarray, ends: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Seconds of [a_i, b_i] covered by the union of intervals [starts, ends] (O((n + m) log m)).

    Why: "how much of this request's wait was spent while a loader ran" and "how much of the time a
    long prompt was in flight" are both coverage questions; merging the intervals first makes
    overlapping loaders count once.
    """
    out = np.zeros(np.shape(a), dtype=np.float64)
    keep = np.isfinite(starts) & np.isfinite(ends) & (ends > starts)
    if not keep.any():
        return out
    order = np.argsort(starts[keep], kind="stable")
    s, e = starts[keep][order], ends[keep][order]
    run_end = np.maximum.accumulate(e)
    new_group = np.concatenate(([True], s[1:] > run_end[:-1]))
    gid = np.cumsum(new_group) - 1
    ms = s[new_group]
    me = np.full(ms.size, -np.inf)
    np.maximum.at(me, gid, e)
    length = me - ms
    before = np.concatenate(([0.0], np.cumsum(length)))

    def g(t: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(ms, t, "right") - 1
        safe = np.clip(idx, 0, None)
        val = before[safe] + np.clip(t - ms[safe], 0.0, length[safe])
        return np.where(idx >= 0, val, 0.0)

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    ok = np.isfinite(a) & np.isfinite(b) & (b > a)
    out[ok] = g(b[ok]) - g(a[ok])
    return out
