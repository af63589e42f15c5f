"""Statistics and scoping shared by the rule families: trend tests on troughs, change points, load, the service.

Why these and not a plain regression slope:

- Memory samples are autocorrelated (a 1 Hz series of a slowly moving level), which makes an
  ordinary Mann-Kendall test far too confident. We test *troughs* (the lower envelope: the minimum
  of each time window), which removes the per-request sawtooth and most of the short-range
  autocorrelation, and then apply the Hamed-Rao (1998) variance correction on top, which inflates
  the variance of S by the effective-sample-size factor computed from the significant lags of the
  ranks' autocorrelation (what ``pymannkendall.hamed_rao_modification_test`` does). Two dozen
  troughs cannot reveal their own autocorrelation, so the factor is also estimated from the dense
  series at lags of whole trough spacings (``dense_correction``), with an AR(1) extrapolation when
  the residuals look AR(1); the larger factor wins. On 200 seeded AR(1) series (phi 0.95 and 0.8,
  no trend, 90 s at 1 Hz) the leak rule built on this fires once each (0.5 %, for a nominal 1 %).
- Theil-Sen (``numstats.theilslopes``, scipy's definition) gives a slope that one outlier window cannot drag.
- Warm-up and cache fill look like growth at first: ``plateau_after_change`` finds the best
  ramp-then-flat split and says whether the data are explained by it much better than by one line.

Everything here is O(n) in the raw samples (blocking via ``searchsorted``/``reduceat``); the
quadratic parts (Mann-Kendall's S, Theil-Sen) run on at most a few dozen troughs.

The second half answers "which memory is the service's?" (``service_scope``) so that every
family judges the same processes and cgroups: the PIDs named by the service's own records
(requests, batches, loader, torch, config), else the processes holding a model file, plus the
watched cgroups those processes live in; ``service_context`` narrows it to the one cgroup whose
stalls are the service's, and ``memory_series`` to one memory series. Every rule family imports
from here; nothing here imports a rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from diag.rules import numstats
from diag.rules.context import AnalysisContext, shared
from diag.timeline import ProcessTrack, Series, Table, Timeline

MIN_SAMPLES = 20  # below this a trend verdict rests on too little data (1 Hz: 20 s)
MIN_SPAN_S = 30.0  # ... or too short a time
MIN_WINDOWS = 8  # troughs: Mann-Kendall on fewer than 8 points cannot reach p < 0.01 with any honesty
MAX_WINDOWS = 48  # 24 h -> 30 min windows; more windows only make the O(k^2) parts slower
SAMPLES_PER_WINDOW = 5  # at 1 Hz a 5 s window spans a few requests: its minimum is the level between them
UNLIMITED = float(1 << 60)  # cgroup "limits" at or above this are the page-counter maximum, i.e. none


# --------------------------------------------------------------------------- trend tests


@dataclass(frozen=True)
class Trend:
    """Mann-Kendall (Hamed-Rao corrected) + Theil-Sen of one series. Slopes are per second."""

    n: int
    s: float
    z: float
    p: float  # two-sided
    tau: float
    correction: float  # Hamed-Rao n/n* (>= 1: autocorrelation widened the variance by this factor)
    slope: float
    intercept: float  # value at ts = 0 of the time axis handed in (callers pass ts - t0)
    slope_low: float  # 95 % confidence band of the Sen slope
    slope_high: float


def text_masks(values: np.ndarray) -> dict[str, np.ndarray]:
    """Where each distinct text of a column is, keyed by the text as ``str()`` writes it (values whose texts are
    equal share one mask): what ``values.astype(str) == text`` gives for every text at once.

    Why: a text column (a request's outcome, route, model) holds a few distinct objects over a million rows;
    comparing the objects with each distinct one costs a tenth of converting every row to a fixed-width string
    (0.03 s against 0.15 s for a million outcomes, and no 68 MiB copy). Values are matched by equality, so numbers
    equal across types (``1`` and ``True``) share a mask where ``astype(str)`` would tell them apart: not a mix a text
    column holds."""
    if values.dtype != object:
        return {str(v): values == v for v in np.unique(values)}
    masks: dict[str, np.ndarray] = {}
    for value in set(values.tolist()):
        where = values == value
        text = str(value)
        masks[text] = masks[text] | where if text in masks else where
    return masks


def mann_kendall(y: np.ndarray, alpha_acf: float = 0.05, min_correction: float = 1.0) -> tuple[float, float, float, float, float]:
    """(S, z, p two-sided, tau, variance correction) of ``y`` (a few hundred points at most: S is O(n^2)).

    The correction is the larger of Hamed-Rao on ``y`` itself and ``min_correction`` (see
    ``trough_trend``: the troughs' autocorrelation estimated from the dense series).
    """
    y = np.asarray(y, dtype=np.float64)
    n = y.size
    if n < 3:
        return 0.0, 0.0, 1.0, 0.0, 1.0
    s, var, hamed_rao = _mk_parts(y, alpha_acf)
    return _mk_test(n, s, var, max(hamed_rao, min_correction))


def _mk_parts(y: np.ndarray, alpha_acf: float) -> tuple[float, float, float]:
    """(S, its variance without autocorrelation, the Hamed-Rao factor) of ``y`` (n >= 3): what does not depend on
    the correction, so ``trough_trend`` can test again with a larger one without redoing the O(n^2) parts."""
    n = y.size
    diff = np.sign(y[None, :] - y[:, None])
    s = float(np.triu(diff, 1).sum())
    _, counts = np.unique(y, return_counts=True)
    ties = counts[counts > 1].astype(np.float64)
    var = (n * (n - 1) * (2 * n + 5) - float((ties * (ties - 1) * (2 * ties + 5)).sum())) / 18.0
    return s, var, _hamed_rao(y, alpha_acf)


def _mk_test(n: int, s: float, var: float, correction: float) -> tuple[float, float, float, float, float]:
    var *= correction
    if var <= 0:
        return s, 0.0, 1.0, 0.0, correction
    z = (s - math.copysign(1.0, s)) / math.sqrt(var) if s != 0 else 0.0
    p = 2.0 * numstats.norm_sf(abs(z))
    tau = s / (0.5 * n * (n - 1))
    return s, z, min(1.0, p), tau, correction


def _hamed_rao(y: np.ndarray, alpha: float) -> float:
    """n/n* from the significant autocorrelations of the ranks of the Sen-detrended series (>= 1).

    Floored at 1: negative autocorrelation would *shrink* the variance, and a diagnosis should
    never become more confident because the data wiggle.
    """
    n = y.size
    if n < 4:
        return 1.0
    idx = np.arange(n, dtype=np.float64)
    slope = numstats.theil_slope(y, idx)
    ranks = numstats.rankdata(y - slope * idx)
    r = ranks - ranks.mean()
    denom = float((r * r).sum())
    if denom <= 0:
        return 1.0
    acf = np.correlate(r, r, mode="full")[n:] / denom  # lags 1..n-1
    bound = numstats.norm_ppf(1 - alpha / 2) / math.sqrt(n)
    return _hr_factor(n, acf, bound)


def _hr_factor(n: int, acf: np.ndarray, bound: float) -> float:
    """Hamed-Rao n/n* for ``n`` points from autocorrelations at lags 1..len(acf); only |rho| > bound count."""
    k = np.arange(1, acf.size + 1, dtype=np.float64)
    keep = np.abs(acf) > bound
    weights = (n - k) * (n - k - 1) * (n - k - 2)
    factor = 1.0 + 2.0 / (n * (n - 1) * (n - 2)) * float((weights * acf * keep).sum())
    return max(1.0, factor)


def dense_correction(series: Series, slope: float, intercept: float, t0: float, spacing_s: float, n_troughs: int) -> float:
    """Hamed-Rao factor for ``n_troughs`` troughs ``spacing_s`` apart, from the *dense* series' autocorrelation.

    Why: two dozen troughs cannot reveal their own autocorrelation (a bound of 1.96/sqrt(18) = 0.46
    hides almost everything), so a slow wander (1 Hz samples correlated over tens of seconds)
    passes as a trend. The dense series has 5x the points: the ranks of its residuals around the
    troughs' Sen line, correlated at lags of 1, 2, ... trough spacings, estimate the troughs'
    autocorrelation far better. O(n) per lag, at most ``n_troughs`` lags.
    """
    s = series.valid()
    n = len(s)
    if n < 10 or n_troughs < 4 or spacing_s <= 0:
        return 1.0
    dt = float(numstats.median(np.diff(s.ts)))
    if dt <= 0:
        return 1.0
    step = max(1, round(spacing_s / dt))
    ranks = numstats.rankdata(s.values - (intercept + slope * (s.ts - t0)))
    r = ranks - ranks.mean()
    denom = float((r * r).sum())
    if denom <= 0:
        return 1.0
    lags = [step * k for k in range(1, n_troughs) if step * k < n - 2]
    if not lags:
        return 1.0
    acf = np.array([float((r[:-lag] * r[lag:]).sum()) / denom for lag in lags])
    bound = numstats.norm_ppf(0.975) / math.sqrt(n)
    acf = np.where(np.abs(acf) > bound, acf, 0.0)
    # Short series underestimate autocorrelation at long lags (the detrending eats it): when the
    # residuals behave like an AR(1) process, also take the AR(1) extrapolation of the lag-1
    # coefficient, bias-corrected (Kendall 1954: E[r1] ~ phi - (1 + 3 phi)/n). "Behave like": the
    # correlation one trough spacing away is at least half what that AR(1) predicts. A staircase
    # (busy phases that leak, idle phases that do not) has a high lag-1 coefficient but periodic,
    # not decaying, residuals -- there the measured correlations are the honest ones.
    r1 = float((r[:-1] * r[1:]).sum()) / denom
    if r1 > bound:
        phi = min(0.99, r1 + (1 + 3 * r1) / n)
        model = phi ** np.asarray(lags, dtype=np.float64)
        measured = float((r[:-step] * r[step:]).sum()) / denom
        if measured >= 0.5 * model[0]:
            acf = np.maximum(acf, model)
    return _hr_factor(n_troughs, acf, 0.0)


def trend(ts: np.ndarray, y: np.ndarray, min_correction: float = 1.0) -> Trend | None:
    """Mann-Kendall + Theil-Sen of ``y`` over ``ts`` (seconds); None with fewer than 4 finite points."""
    parts = _TrendParts.of(ts, y)
    return None if parts is None else parts.trend(min_correction)


@dataclass(frozen=True)
class _TrendParts:
    """What a ``Trend`` of one series is made of, save the autocorrelation correction (computed once, tested twice)."""

    n: int
    s: float
    var: float
    hamed_rao: float
    sen: numstats.TheilSlopes

    @classmethod
    def of(cls, ts: np.ndarray, y: np.ndarray) -> _TrendParts | None:
        ts = np.asarray(ts, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        keep = np.isfinite(ts) & np.isfinite(y)
        ts, y = ts[keep], y[keep]
        if ts.size < 4 or float(ts[-1] - ts[0]) <= 0:
            return None
        s, var, hamed_rao = _mk_parts(y, 0.05)
        t0 = float(ts[0])
        return cls(int(ts.size), s, var, hamed_rao, numstats.theilslopes(y, ts - t0))

    def trend(self, min_correction: float = 1.0) -> Trend:
        s, z, p, tau, corr = _mk_test(self.n, self.s, self.var, max(self.hamed_rao, min_correction))
        sen = self.sen
        return Trend(self.n, s, z, p, tau, corr, sen.slope, sen.intercept, sen.low_slope, sen.high_slope)


def window_count(n_samples: int) -> int:
    """How many trough windows for ``n_samples`` samples: ~5 samples each, clamped to [8, 48]."""
    return int(min(MAX_WINDOWS, max(MIN_WINDOWS, n_samples // SAMPLES_PER_WINDOW)))


def enough_data(series: Series) -> bool:
    s = series.valid()
    return len(s) >= MIN_SAMPLES and float(s.ts[-1] - s.ts[0]) >= MIN_SPAN_S


def _edges(t0: float, t1: float, windows: int) -> np.ndarray:
    return np.linspace(t0, t1, windows + 1)


def troughs(series: Series, windows: int | None = None) -> Series:
    """The lower envelope: the minimum of each of ``windows`` equal time windows, stamped at the window centre.

    Empty windows (the agent skipped ticks) are dropped rather than invented.
    """
    s = series.valid()
    if len(s) == 0:
        return Series(np.empty(0), np.empty(0))
    k = windows or window_count(len(s))
    edges = _edges(float(s.ts[0]), float(s.ts[-1]), k)
    return _reduce(s, edges, np.minimum)


def window_means(series: Series, edges: np.ndarray) -> np.ndarray:
    """Mean of ``series`` within each window of ``edges`` (NaN where a window has no sample)."""
    s = series.valid()
    out = np.full(edges.size - 1, np.nan)
    if len(s) == 0:
        return out
    idx = np.searchsorted(s.ts, edges, "left")
    idx[-1] = np.searchsorted(s.ts, edges[-1], "right")
    counts = np.diff(idx)
    csum = np.concatenate([[0.0], np.cumsum(s.values)])
    nz = counts > 0
    out[nz] = (csum[idx[1:]] - csum[idx[:-1]])[nz] / counts[nz]
    return out


def _reduce(s: Series, edges: np.ndarray, op: np.ufunc) -> Series:
    idx = np.searchsorted(s.ts, edges, "left")
    idx[-1] = s.ts.size
    starts = idx[:-1]
    nonempty = np.diff(idx) > 0
    if not nonempty.any():
        return Series(np.empty(0), np.empty(0))
    vals = op.reduceat(s.values, starts[nonempty])
    centres = 0.5 * (edges[:-1] + edges[1:])[nonempty]
    return Series(centres, vals)


def trough_edges(series: Series, windows: int | None = None) -> np.ndarray:
    """The window edges ``troughs`` uses for ``series`` (so load can be averaged over the same windows)."""
    s = series.valid()
    k = windows or window_count(len(s))
    return _edges(float(s.ts[0]), float(s.ts[-1]), k)


def trough_trend(series: Series) -> tuple[Series, Trend | None]:
    """Troughs of ``series`` and their trend, autocorrelation estimated from both the troughs and the dense series."""
    tr = troughs(series)
    parts = _TrendParts.of(tr.ts, tr.values)
    if parts is None:
        return tr, None
    first = parts.trend()
    spacing = float(numstats.median(np.diff(tr.ts)))
    corr = dense_correction(series, first.slope, first.intercept, float(tr.ts[0]), spacing, len(tr))
    return tr, parts.trend(min_correction=corr) if corr > first.correction else first


@dataclass(frozen=True)
class Plateau:
    """A ramp (or step) that stops: ``change_ts`` where it stops, the tail's slope vs the ramp's."""

    change_ts: float
    tail_points: int
    head_slope: float  # per second, least squares over the points before the change
    tail_slope: float  # per second, Theil-Sen over the tail
    sse_ratio: float  # SSE(ramp then flat) / SSE(one line): < 0.5 means ramp-then-flat explains the data much better


def plateau_after_change(ts: np.ndarray, y: np.ndarray) -> Plateau | None:
    """Warm-up / cache fill: rising, then flat. None when one straight line explains the data as well.

    Tries every split that leaves >= max(3, 25 %) of the points in the tail: a line before it, a
    constant after it. A split qualifies when that fits at least twice as well as one line AND the
    tail's own Sen slope is under a quarter of the ramp's (the growth stopped, it did not just
    wobble); the best-fitting qualifying split wins. A steady climb has the same slope on both
    sides of any split, and a staircase leak (several equal steps) fits one line about as well as
    ramp-then-flat, so neither is mistaken for a plateau.
    """
    ts = np.asarray(ts, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = y.size
    min_tail = max(3, math.ceil(0.25 * n))
    if n < min_tail + 3:
        return None
    sse_line = _line_sse(ts, y)
    if sse_line <= 0:
        return None
    best: Plateau | None = None
    best_sse = math.inf
    for k in range(3, n - min_tail + 1):
        tail = y[k:]
        sse = _line_sse(ts[:k], y[:k]) + float(((tail - tail.mean()) ** 2).sum())
        if sse >= 0.5 * sse_line or sse >= best_sse:
            continue
        head_slope = float(np.polyfit(ts[:k] - ts[0], y[:k], 1)[0])
        tail_slope = numstats.theil_slope(tail, ts[k:] - ts[k])
        if head_slope > 0 and tail_slope < 0.25 * head_slope:
            best_sse = sse
            best = Plateau(float(ts[k]), n - k, head_slope, tail_slope, sse / sse_line)
    return best


def _line_sse(x: np.ndarray, y: np.ndarray) -> float:
    if y.size < 3:
        return 0.0
    coef = np.polyfit(x - x[0], y, 1)
    resid = y - np.polyval(coef, x - x[0])
    return float((resid * resid).sum())


def largest_step_share(y: np.ndarray) -> float:
    """Share of the total rise (first to last trough) taken by the single biggest window-to-window step.

    Near 1: one jump (a cache filled, a model loaded), not a climb.
    """
    y = np.asarray(y, dtype=np.float64)
    if y.size < 2:
        return 1.0
    rise = float(y[-1] - y[0])
    if rise <= 0:
        return 1.0
    return float(min(1.0, np.max(np.diff(y)) / rise))


def spearman_test(a: np.ndarray, b: np.ndarray, min_points: int = 5) -> tuple[float, float, int]:
    """(rho, p, paired points) over the finite pairs; NaNs when either side is constant or under ``min_points``."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    keep = np.isfinite(a) & np.isfinite(b)
    n = int(keep.sum())
    if n < min_points or np.ptp(a[keep]) == 0 or np.ptp(b[keep]) == 0:
        return float("nan"), float("nan"), n
    res = numstats.spearmanr(a[keep], b[keep])
    return float(res.statistic), float(res.pvalue), n


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation, NaN when either side is constant or fewer than 5 paired points."""
    return spearman_test(a, b)[0]


def excerpt(series: Series, max_points: int = 50) -> list[list[float]]:
    """At most ``max_points`` [ts, value] pairs, evenly spaced, for a report's chart."""
    s = series.valid()
    if len(s) == 0:
        return []
    if len(s) > max_points:
        idx = np.unique(np.linspace(0, len(s) - 1, max_points).round().astype(int))
        s = Series(s.ts[idx], s.values[idx])
    return [[round(float(t), 3), float(v)] for t, v in zip(s.ts, s.values, strict=True)]


def excerpt_arrays(ts: np.ndarray, values: np.ndarray, max_points: int = 50) -> list[list[float]]:
    """``excerpt`` for two bare arrays (the finite pairs only): columns of a request or batch table."""
    ts, values = np.asarray(ts, dtype=np.float64), np.asarray(values, dtype=np.float64)
    keep = np.isfinite(ts) & np.isfinite(values)
    return excerpt(Series(ts[keep], values[keep]), max_points)


def edge_level(series: Series, which: str, share: float = 0.15) -> float:
    """Median of the first or last ``share`` of a series (at least 3 samples): a robust start/end level."""
    s = series.valid()
    if len(s) == 0:
        return float("nan")
    k = max(3, int(len(s) * share))
    part = s.values[:k] if which == "first" else s.values[-k:]
    return float(np.median(part))


# --------------------------------------------------------------------------- pressure (PSI)


def stall_percent(series: dict[str, Series], prefix: str) -> Series:
    """Percent of wall time stalled for one PSI line (``prefix`` e.g. ``psi.memory.some``).

    From the cumulative ``total_s`` counter when it has >= 2 samples (exact over each sample
    interval), else the kernel's ``avg10`` (an exponentially-decayed 10 s average).
    """
    total = series.get(f"{prefix}.total_s")
    if total is not None and len(total.valid()) >= 3:
        r = total.rate()
        return Series(r.ts, np.clip(r.values * 100.0, 0.0, 100.0)).valid()
    avg = series.get(f"{prefix}.avg10")
    return avg.valid() if avg is not None else Series(np.empty(0), np.empty(0))


def sustained_above(series: Series, threshold: float, min_samples: int = 3) -> tuple[bool, int]:
    """Whether at least ``min_samples`` samples are >= ``threshold`` (and how many are)."""
    s = series.valid()
    count = int((s.values >= threshold).sum()) if len(s) else 0
    return count >= min_samples, count


# --------------------------------------------------------------------------- load from requests


class LoadIndex:
    """Requests the service holds (arrival <= t < finish: queued or in service) and their tokens (prompt + output).

    Why from arrival, not from the start of inference: a queued request is held in memory too -- its
    connection, its parsed body, its task and its place in the queue -- so memory rises while a queue
    builds even when the requests in service cannot (one slot stays one request). Counting only those in
    service, a backlog in front of one slot left the leak rule no load to weigh the rise against, and the
    warm-up of a server taking 48 waiting requests (+5 MiB in 100 s) was called a leak. The engines' own
    gauges give the same measure (``EngineLoad``: running + waiting). Rows without an arrival time count
    from their start.

    Built once per rule (two sorts of the request table), then ``at(ts)`` costs a few binary
    searches per point: O((n + m) log n), so a million requests cost a sort, not a loop.
    """

    def __init__(self, requests: Table) -> None:
        self.available = bool(len(requests)) and "start" in requests and "finish" in requests
        self.has_tokens = False
        self._memo: dict[tuple[int, float, float, int], tuple[np.ndarray, str, np.ndarray]] = {}
        if not self.available:
            return
        start, finish = requests["start"], requests["finish"]
        if "arrival" in requests:
            arrival = requests["arrival"]
            start = np.where(np.isfinite(arrival) & ~(arrival > start), arrival, start)  # NaN start: arrival
        ok = np.isfinite(start) & np.isfinite(finish)
        start, finish = start[ok], finish[ok]
        self.available = bool(start.size)
        s_order = np.argsort(start, kind="stable")
        f_order = np.argsort(finish, kind="stable")
        self._starts, self._finishes = start[s_order], finish[f_order]
        tok = np.zeros(start.size)
        for col in ("prompt_tokens", "output_tokens"):
            if col in requests:
                tok = tok + np.nan_to_num(requests[col][ok])
        self.has_tokens = bool(np.any(tok > 0))
        self._cs = np.concatenate([[0.0], np.cumsum(tok[s_order])])
        self._cf = np.concatenate([[0.0], np.cumsum(tok[f_order])])

    def covers(self, t0: float, t1: float) -> bool:
        """Whether any request was held between ``t0`` and ``t1``."""
        return self.available and bool(self._starts[0] <= t1 and self._finishes[-1] >= t0)

    def at(self, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(requests held, their tokens or None without token counts) at each time of ``ts``."""
        ts = np.asarray(ts, dtype=np.float64)
        if not self.available:
            return np.zeros(ts.size), None
        si = np.searchsorted(self._starts, ts, "right")
        fi = np.searchsorted(self._finishes, ts, "right")
        count = (si - fi).astype(np.float64)
        tokens = (self._cs[si] - self._cf[fi]) if self.has_tokens else None
        return count, tokens

    def load(self, ts: np.ndarray, points: int = 8) -> tuple[str, np.ndarray]:
        """The load memory should follow -- tokens held when known, else requests held --
        averaged over the interval before each sample (``points`` instants spread over it).

        Why averaged: a 1 Hz memory sample reflects the requests of the last second, and a request
        shorter than the interval is mostly *between* samples; the instantaneous count would miss it.
        """
        ts = np.asarray(ts, dtype=np.float64)
        key = (ts.size, float(ts[0]), float(ts[-1]), points) if ts.size else None
        hit = self._memo.get(key) if key else None
        if hit is not None and np.array_equal(hit[0], ts):  # cgroups and processes share the agent's sample times
            return hit[1], hit[2]
        dt = float(np.median(np.diff(ts))) if ts.size >= 2 else 1.0
        grid = (ts[:, None] - dt * np.arange(points)[None, :] / points).ravel()
        count, tokens = self.at(grid)
        if tokens is not None:
            out = "tokens held (queued or in service)", tokens.reshape(ts.size, points).mean(axis=1)
        else:
            out = "requests held (queued or in service)", count.reshape(ts.size, points).mean(axis=1)
        if key:
            self._memo[key] = (ts, *out)
        return out


class EngineLoad:
    """Requests in the engine (running + waiting) from its own gauges, for a timeline without request rows.

    Why: an engine read from its /metrics alone (vLLM, TGI, llama.cpp's server) leaves no request rows, yet it
    says how many requests it holds -- ``requests_running`` and ``requests_waiting`` (vLLM's running/waiting,
    TGI's batch size/queue size, llama.cpp's processing/deferred). A waiting request is held in memory too (its
    prompt, its connection, its place in the scheduler), so memory that grows while a queue builds follows load;
    without this index the leak rule had no load to weigh the growth against and called a backlog a leak.
    Same interface as ``LoadIndex`` (``covers``, ``load``); each gauge holds its last value until the next sample.
    """

    NAME = "requests in the engine (running + waiting, its own gauges)"
    SIGNALS = ("requests_running", "requests_waiting")

    def __init__(self, timeline: Timeline) -> None:
        parts = [timeline.service[k].valid() for k in self.SIGNALS if k in timeline.service]
        self._parts = [p for p in parts if len(p)]
        self.available = len(self._parts) == len(self.SIGNALS)  # running alone misses the queue: not the load
        self.has_tokens = False

    def covers(self, t0: float, t1: float) -> bool:
        """Whether the gauges were sampled over some of ``t0``..``t1``."""
        if not self.available:
            return False
        return min(float(p.ts[0]) for p in self._parts) <= t1 and max(float(p.ts[-1]) for p in self._parts) >= t0

    def at(self, ts: np.ndarray) -> np.ndarray:
        """Requests in the engine at each time (each gauge's last sample at or before it; 0 before its first)."""
        ts = np.asarray(ts, dtype=np.float64)
        out = np.zeros(ts.size)
        for p in self._parts:
            i = np.searchsorted(p.ts, ts, "right") - 1
            out += np.where(i >= 0, p.values[np.clip(i, 0, None)], 0.0)
        return out

    def load(self, ts: np.ndarray, points: int = 8) -> tuple[str, np.ndarray]:
        """The load at each sample time (the gauges are already a level, not events: no averaging needed)."""
        return self.NAME, self.at(ts)


def load_index(timeline: Timeline) -> LoadIndex | EngineLoad | None:
    """The load memory should follow: the request rows when there are any, else the engine's own gauges, else None."""
    if len(timeline.requests):
        return LoadIndex(timeline.requests)
    engine = EngineLoad(timeline)
    return engine if engine.available else None


# --------------------------------------------------------------------------- whose memory: the service


@dataclass
class Scope:
    """The service's processes and cgroups in a timeline, and how they were identified."""

    pids: set[int] = field(default_factory=set)
    tracks: list[ProcessTrack] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)  # keys of timeline.cgroups, deepest first
    identified_by: str = "none"  # "watch scope (--pid/--cgroup)", "service records", "model holders", "watched cgroups", "none"

    @property
    def known(self) -> bool:
        return self.identified_by != "none"


def _record_pids(timeline: Timeline) -> set[int]:
    pids: set[int] = set()
    for table in (timeline.requests, timeline.batches, timeline.loader, timeline.torch):
        if len(table) and "pid" in table:
            col = table["pid"]
            pids.update(int(p) for p in np.unique(col[np.isfinite(col)]))
    pids.update(int(c.pid) for c in timeline.configs if c.pid is not None)
    pids.update(int(e.pid) for e in timeline.cuda_ooms if e.pid is not None)
    return pids


def in_cgroup(path: str | None, group: str) -> bool:
    """Whether cgroup ``path`` is ``group`` or below it (a limit on a parent applies to its children)."""
    if not path:
        return False
    return group == "/" or path == group or path.startswith(group.rstrip("/") + "/")


def service_scope(timeline: Timeline, ac: AnalysisContext | None = None) -> Scope:
    """Which processes and cgroups are the service, once per analysis (see ``_service_scope`` for the order)."""
    return shared(ac, timeline, "stats.service_scope", lambda: _service_scope(timeline))


def watched(timeline: Timeline) -> tuple[set[int], list[str]]:
    """(pids, cgroup keys of the timeline) the operator asked the agent to watch, over every watch scope recorded.

    A group is matched by its path as the samplers print it; one given by its mount path
    (``/sys/fs/cgroup/memory/x``) or its v2 path matches the watched key it ends with.
    """
    pids: set[int] = set()
    asked: set[str] = set()
    for ws in timeline.watch_scopes:
        pids.update(int(p) for p in (*ws.pids, *ws.resolved_pids))
        asked.update(str(g) for g in (*ws.cgroups, *ws.resolved_cgroups) if g)
    groups = [
        g
        for g in timeline.cgroups
        if g != "/" and any(a == g or a.rstrip("/").endswith(g.rstrip("/")) or g.endswith(a.rstrip("/")) for a in asked)
    ]
    return pids, groups


def _service_scope(timeline: Timeline) -> Scope:
    """Which processes and cgroups are the service, by the strongest evidence present:

    1. the operator's own ``--pid``/``--cgroup`` (``WatchScope`` records): nothing outranks being named;
    2. the pids that wrote service records (requests, batches, loader, configs...);
    3. the processes holding model files -- but when the operator watched cgroups, only holders inside
       them: a neighbour that happens to map a ``.bin`` is never promoted to the service;
    4. the watched cgroups themselves.
    """
    scope = Scope()
    tracks = list(timeline.processes.values())
    pids = _record_pids(timeline)
    groups = [g for g in timeline.cgroups if g != "/"]
    named_pids, named_groups = watched(timeline)
    if named_pids or named_groups:
        chosen = [t for t in tracks if t.pid in named_pids or any(in_cgroup(t.memory_cgroup, g) for g in named_groups)]
        scope.identified_by = "watch scope (--pid/--cgroup)"
        pids = {p for p in pids if any(t.pid == p for t in chosen)} | named_pids
        matched = list(named_groups)
        named_tracks = [t for t in chosen if t.pid in named_pids]
        matched += [g for g in groups if g not in matched and any(in_cgroup(t.memory_cgroup, g) for t in named_tracks)]
    else:
        chosen = [t for t in tracks if t.pid in pids]
        if chosen:
            scope.identified_by = "service records"
        else:
            chosen = [t for t in tracks if t.model_files]
            if chosen and groups:  # the operator watched groups: holders outside all of them are neighbours
                chosen = [t for t in chosen if any(in_cgroup(t.memory_cgroup, g) for g in groups)]
            if chosen:
                scope.identified_by = "model holders"
        matched = [g for g in groups if any(in_cgroup(t.memory_cgroup, g) for t in chosen)]
        if not matched and groups and not chosen:
            matched = groups  # the agent watched these because the operator named them (or their holders)
            scope.identified_by = "watched cgroups"
    scope.cgroups = sorted(matched, key=lambda g: g.count("/"), reverse=True)
    if scope.cgroups:  # everyone living in the service's groups belongs to it too (a supervisor, a sidecar)
        known = {id(t) for t in chosen}
        chosen += [t for t in tracks if id(t) not in known and any(in_cgroup(t.memory_cgroup, g) for g in scope.cgroups)]
    scope.tracks = chosen
    scope.pids = pids | {t.pid for t in chosen}
    return scope


@dataclass
class ServiceContext:
    """The service as one cgroup and its pids -- so stall and memory are *ours*, not the host's."""

    pids: set[int] = field(default_factory=set)
    cgroup: str | None = None
    how: str = ""  # how the cgroup was identified (for evidence)


def service_context(tl: Timeline, ac: AnalysisContext | None = None) -> ServiceContext:
    """The service as every rule family scopes it (``service_scope``: the pids named by the service's
    records, their watched cgroups); the deepest such cgroup is the one whose stall and memory are ours."""
    scope = service_scope(tl, ac)
    cgroup = scope.cgroups[0] if scope.cgroups else None
    return ServiceContext(set(scope.pids), cgroup, scope.identified_by if cgroup else "not identified")


def memory_series(tl: Timeline, ctx: ServiceContext | None = None) -> tuple[str, Series] | None:
    """The service's memory over time, best source first: cgroup anon > working set > usage, the serving
    processes' summed RSS, then host used (total - available). None when nothing was sampled."""
    ctx = ctx or service_context(tl)
    if ctx.cgroup is not None:
        group = tl.cgroups.get(ctx.cgroup, {})
        for key in ("stat.anon", "working_set", "usage"):
            s = group.get(key)
            if s is not None and len(s.valid()) >= 2:
                return f"cgroup {ctx.cgroup} {key}", s.valid()
    tracks = [t.series["rss"].valid() for t in tl.processes.values() if t.pid in ctx.pids and "rss" in t.series]
    tracks = [s for s in tracks if len(s) >= 2]
    if tracks:
        grid = np.unique(np.concatenate([s.ts for s in tracks]))
        total = np.zeros(grid.size)
        for s in tracks:
            total += np.interp(grid, s.ts, s.values, left=0.0, right=0.0)
        return "serving processes' RSS", Series(grid, total)
    total, avail = tl.host.get("memory.total"), tl.host.get("memory.available")
    if total is not None and avail is not None and len(avail.valid()) >= 2:
        a = avail.valid()
        t = np.interp(a.ts, total.valid().ts, total.valid().values) if len(total.valid()) else np.full(len(a), np.nan)
        return "host memory in use (total - available)", Series(a.ts, t - a.values)
    return None


def cgroup_limit(timeline: Timeline, path: str) -> float | None:
    """The group's memory limit (bytes), or the tightest watched ancestor's; None when unlimited/unknown."""
    best: float | None = None
    for group, series in timeline.cgroups.items():
        if not in_cgroup(path, group):
            continue
        lim = series.get("limit")
        value = lim.last() if lim is not None else float("nan")
        if math.isfinite(value) and 0 < value < UNLIMITED and (best is None or value < best):
            best = value
    return best


def host_total(timeline: Timeline) -> float | None:
    total = timeline.host.get("memory.total")
    value = total.last() if total is not None else float("nan")
    return value if math.isfinite(value) and value > 0 else None


def limit_for(timeline: Timeline, cgroup: str | None) -> tuple[float | None, str]:
    """(limit bytes, what it is): the cgroup's limit, else the host's MemTotal."""
    if cgroup:
        lim = cgroup_limit(timeline, cgroup)
        if lim is not None:
            return lim, f"cgroup {cgroup} limit"
    total = host_total(timeline)
    return (total, "host MemTotal") if total is not None else (None, "no limit known")


def track_cgroup(timeline: Timeline, track: ProcessTrack) -> str | None:
    """The deepest watched cgroup the process lives in, else its own memory cgroup path."""
    inside = [g for g in timeline.cgroups if in_cgroup(track.memory_cgroup, g)]
    return max(inside, key=lambda g: g.count("/")) if inside else track.memory_cgroup


def first_present(series: dict[str, Series], names: Iterable[str]) -> tuple[str, Series] | None:
    """The first of ``names`` that has enough data for a trend verdict."""
    for name in names:
        s = series.get(name)
        if s is not None and enough_data(s):
            return name, s.valid()
    return None
