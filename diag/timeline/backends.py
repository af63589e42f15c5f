"""The ``service:`` signals of recorded backend scrapes, computed as the Prometheus loader computes them.

Why here: the agent stores what it scraped from vLLM, TGI, llama.cpp or our tracker as raw families
(``BackendSample``: gauges, cumulative counters, histogram bucket deltas -- ``Timeline.backends``), and every
loader of records (the recorder, a bundle, the live window) builds its Timeline through the one builder,
which calls ``service_from_backends`` once the series are joined. The feeds -- which family fills which
signal, how, and in which order of preference -- are ``collectors.backends.FEEDS``, the table the Prometheus
loader queries by; the arithmetic mirrors PromQL's, so a host reads the same whether its numbers came
through Prometheus or through the agent:

- the evaluation times are a target's successful scrapes, the window ``W`` four scrape intervals (the
  Prometheus loader's rate window at one step per scrape);
- ``rate``: the increase of a counter over the samples in ``[t - W, t]`` (a decrease is a reset: the new
  value counts as increase, as ``rate()`` does) divided by the time between the first and last of them --
  ``rate()``'s extrapolation scales both by the same factor, so the per-second rate is the same;
- ``histogram``: per bucket, the deltas of the samples in the window except the first (exactly
  ``increase()``'s samples), summed over series and targets; then ``histogram_quantile``'s interpolation for
  p50 and p95 and ``increase(_sum) / increase(_count)`` for the mean;
- ``gauge``: the sum (or, for a ratio such as KV-cache usage, the max) of the series present at that scrape;
  ``ratio`` and ``sum_rate`` as their rates.

Several targets are summed after each is brought onto the union of their evaluation times (a target's value
at ``t`` is its latest at or before ``t``, if no older than its window). A value that PromQL would give as
NaN (no requests in the window, a ratio of zero rates) is absent here too.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from collectors import backends as bk
from diag.timeline import signals as sig
from diag.timeline.model import Series

WINDOW_SCRAPES = 4  # the rate window, in scrape intervals (the Prometheus loader's 4 x step at one step per scrape)
_QUANTILES = ((0.5, "p50"), (0.95, "p95"))

# Series names inside a target's group: what the BackendSample declaration makes of its fields.
UP, GAUGE, COUNTER, DELTA = "up", "gauge.", "counter.", "delta."


def _check_feeds() -> None:
    """Every feed names a signal of the vocabulary -- refused at import, so a typo cannot fill a series no rule reads."""
    service = sig.FILLED["service:"]
    for feed in bk.FEEDS:
        if feed.signal not in (sig.LATENCY_STEMS if feed.how == "histogram" else service):
            raise ValueError(f"collectors.backends: {feed.family.name} feeds {feed.signal!r}, not a service signal")


_check_feeds()


@dataclass
class _Hist:
    """One histogram series (one set of kept labels): its bucket, ``_sum`` and ``_count`` deltas."""

    buckets: dict[float, Series] = field(default_factory=dict)
    sum: Series | None = None
    count: Series | None = None


@dataclass
class _Target:
    """One scraped backend's series, sorted by family."""

    grid: np.ndarray  # the times of its successful scrapes
    window: float
    gauges: dict[str, list[tuple[dict[str, str], Series]]] = field(default_factory=lambda: defaultdict(list))
    counters: dict[str, list[tuple[dict[str, str], Series]]] = field(default_factory=lambda: defaultdict(list))
    hists: dict[str, dict[tuple[tuple[str, str], ...], _Hist]] = field(default_factory=lambda: defaultdict(dict))


def _target(series: Mapping[str, Series]) -> _Target | None:
    up = series.get(UP)
    if up is None or not len(up):
        return None
    grid = up.ts[up.values > 0]
    if grid.size == 0:
        return None
    spacing = float(np.median(np.diff(up.ts))) if up.ts.size > 1 else 1.0
    out = _Target(grid, WINDOW_SCRAPES * max(spacing, 1e-3))
    for name, s in series.items():
        if name.startswith(GAUGE) or name.startswith(COUNTER):
            parsed = bk.parse_series_key(name.split(".", 1)[1])
            if parsed is None:
                continue
            (out.gauges if name.startswith(GAUGE) else out.counters)[parsed[0]].append((parsed[1], s))
        elif name.startswith(DELTA):
            parsed = bk.parse_series_key(name[len(DELTA) :])
            if parsed is not None:
                _add_delta(out, parsed[0], parsed[1], s)
    return out


def _add_delta(out: _Target, sample: str, labels: dict[str, str], s: Series) -> None:
    for suffix in ("_bucket", "_sum", "_count"):
        if sample.endswith(suffix) and sample[: -len(suffix)] in bk.FAMILIES:
            family = sample[: -len(suffix)]
            break
    else:
        return
    le_text = labels.pop("le", None)
    hist = out.hists[family].setdefault(tuple(sorted(labels.items())), _Hist())
    if suffix == "_bucket":
        le = _float(le_text)
        if le is not None:
            hist.buckets[le] = s
    elif suffix == "_sum":
        hist.sum = s
    else:
        hist.count = s


def _float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) else value


def _selected(feed: bk.Feed, labels: Mapping[str, str]) -> bool:
    return all(labels.get(label) in values for label, values in feed.select)


# --------------------------------------------------------------------------- windowed arithmetic


def _first_in_window(grid: np.ndarray, ts: np.ndarray, window: float) -> np.ndarray:
    """For each evaluation time, the index in ``ts`` of its first sample inside ``[t - W, t]`` (Prometheus 2's range:
    closed at both ends, so four scrape intervals hold five scrapes; 3.x leaves the start out, which real scrape
    jitter blurs anyway)."""
    return np.searchsorted(ts, grid - window * (1 - 1e-9), side="left")


def _last_at(grid: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """For each evaluation time, the index in ``ts`` of its last sample at or before it (-1: none)."""
    return np.searchsorted(ts, grid, side="right") - 1


def _counter_rate(t: _Target, s: Series) -> np.ndarray:
    """Per-second increase over the window at each evaluation time (NaN with fewer than two samples)."""
    v = s.values
    if v.size < 2:
        return np.full(t.grid.size, np.nan)
    dv = np.diff(v)
    cum = np.concatenate(([v[0]], v[0] + np.cumsum(np.where(dv >= 0, dv, v[1:]))))  # a reset: the new value is new
    return _rate_of(t.grid, s.ts, cum, t.window)


def _rate_of(grid: np.ndarray, ts: np.ndarray, cum: np.ndarray, window: float) -> np.ndarray:
    j0 = _first_in_window(grid, ts, window)
    j1 = _last_at(grid, ts)
    ok = (j1 > j0) & (j1 >= 0)
    out = np.full(grid.size, np.nan)
    a, b = j0[ok], j1[ok]
    out[ok] = (cum[b] - cum[a]) / (ts[b] - ts[a])
    return out


def _delta_increase(t: _Target, s: Series | None) -> np.ndarray:
    """Increase over the window of a delta series (absent points are zero deltas), excluding the window's first sample.

    NaN where the window holds fewer than two scrapes (PromQL's ``increase()`` has no value there either).
    """
    grid = t.grid
    d = np.zeros(grid.size)
    if s is not None and len(s):
        idx = np.searchsorted(grid, s.ts)
        keep = (idx < grid.size) & (grid[np.minimum(idx, grid.size - 1)] == s.ts)
        np.add.at(d, idx[keep], s.values[keep])
    cum = np.cumsum(d)
    j0 = _first_in_window(grid, grid, t.window)
    i = np.arange(grid.size)
    out = np.full(grid.size, np.nan)
    ok = i > j0
    out[ok] = cum[i[ok]] - cum[j0[ok]]
    return out


def _span(t: _Target) -> np.ndarray:
    """Seconds between the first and last scrape of each window (the denominator of a rate of deltas)."""
    j0 = _first_in_window(t.grid, t.grid, t.window)
    span = t.grid - t.grid[np.minimum(j0, t.grid.size - 1)]
    return np.where(span > 0, span, np.nan)


def _nanmax(arrays: list[np.ndarray]) -> np.ndarray:
    """The largest where any is a number, NaN where none is (PromQL's ``max``)."""
    stacked = np.vstack(arrays)
    present = ~np.isnan(stacked)
    out = np.where(present, stacked, -np.inf).max(axis=0)
    return np.where(present.any(axis=0), out, np.nan)


def _nansum(arrays: list[np.ndarray]) -> np.ndarray:
    """Sum where any is a number, NaN where none is (PromQL's ``sum`` over the series that have a value)."""
    stacked = np.vstack(arrays)
    present = ~np.isnan(stacked)
    out = np.where(present, stacked, 0.0).sum(axis=0)
    return np.where(present.any(axis=0), out, np.nan)


def bucket_quantile(q: float, les: np.ndarray, cumulative: np.ndarray) -> np.ndarray:
    """PromQL's ``histogram_quantile`` over many steps at once.

    ``les``: the sorted upper bounds, the last +Inf; ``cumulative``: (buckets x steps) cumulative counts.
    The bucket holding the rank is interpolated linearly; a rank in the +Inf bucket gives the highest finite
    bound; no observations, or fewer than two buckets, give NaN.
    """
    n_le, n = cumulative.shape
    out = np.full(n, np.nan)
    if n_le < 2 or not math.isinf(les[-1]):
        return out
    total = cumulative[-1]
    has = total > 0
    rank = q * total
    finite = cumulative[:-1]
    reached = finite >= rank
    b = np.where(reached.any(axis=0), reached.argmax(axis=0), n_le - 1)
    cols = np.arange(n)
    in_inf = b == n_le - 1
    out[has & in_inf] = les[-2]
    inner = has & ~in_inf
    bi, ci = b[inner], cols[inner]
    end = les[bi]
    start = np.where(bi > 0, les[np.maximum(bi - 1, 0)], 0.0)
    below = np.where(bi > 0, cumulative[np.maximum(bi - 1, 0), ci], 0.0)
    count = cumulative[bi, ci] - below
    r = rank[ci] - below
    with np.errstate(divide="ignore", invalid="ignore"):
        value = start + (end - start) * np.where(count > 0, r / count, 0.0)
    value = np.where((bi == 0) & (les[0] <= 0), les[0], value)
    out[inner] = value
    return out


# --------------------------------------------------------------------------- one feed over one target


def _gauge(feed: bk.Feed, t: _Target) -> np.ndarray | None:
    parts = []
    for labels, s in t.gauges.get(feed.family.name, ()):
        if not _selected(feed, labels):
            continue
        at = np.full(t.grid.size, np.nan)
        idx = np.searchsorted(s.ts, t.grid)
        hit = (idx < s.ts.size) & (s.ts[np.minimum(idx, s.ts.size - 1)] == t.grid)
        at[hit] = s.values[idx[hit]]
        parts.append(at)
    if not parts:
        return None
    return _nanmax(parts) if feed.combine == "max" else _nansum(parts)


def _counter(feed: bk.Feed, family: bk.Family, t: _Target) -> np.ndarray | None:
    parts = [_counter_rate(t, s) for labels, s in t.counters.get(family.name, ()) if _selected(feed, labels)]
    return _nansum(parts) if parts else None


def _hists(feed: bk.Feed, t: _Target) -> list[_Hist]:
    return [h for labels, h in t.hists.get(feed.family.name, {}).items() if _selected(feed, dict(labels))]


def _histogram(feed: bk.Feed, t: _Target) -> dict[str, np.ndarray] | None:
    """Per-step increases: ``le:<bound>`` per bucket (not cumulative), ``sum`` and ``count``."""
    hists = _hists(feed, t)
    if not hists:
        return None
    out: dict[str, list[np.ndarray]] = defaultdict(list)
    for h in hists:
        for le, s in h.buckets.items():
            out[f"le:{le!r}"].append(_delta_increase(t, s))
        out["sum"].append(_delta_increase(t, h.sum))
        out["count"].append(_delta_increase(t, h.count))
    return {k: _nansum(v) for k, v in out.items()}


def _on(grid: np.ndarray, t: _Target, values: np.ndarray) -> np.ndarray:
    """A target's values brought onto ``grid``: its latest at or before each time, if within its window."""
    if grid is t.grid or (grid.size == t.grid.size and np.array_equal(grid, t.grid)):
        return values
    idx = _last_at(grid, t.grid)
    ok = idx >= 0
    out = np.full(grid.size, np.nan)
    src = idx[ok]
    fresh = grid[ok] - t.grid[src] <= t.window
    vals = values[src]
    out[np.flatnonzero(ok)[fresh]] = vals[fresh]
    return out


def _combined(
    targets: list[_Target], per_target: list[np.ndarray | None], combine: str = "sum"
) -> tuple[np.ndarray, np.ndarray] | None:
    used = [(t, v) for t, v in zip(targets, per_target, strict=True) if v is not None]
    if not used:
        return None
    if len(used) == 1:
        return used[0][0].grid, used[0][1]
    grid = np.unique(np.concatenate([t.grid for t, _ in used]))
    aligned = [_on(grid, t, v) for t, v in used]
    return grid, _nanmax(aligned) if combine == "max" else _nansum(aligned)


def _series(grid: np.ndarray, values: np.ndarray) -> Series | None:
    keep = np.isfinite(values)
    return Series(grid[keep].copy(), values[keep].copy()) if keep.any() else None


def _fill(feed: bk.Feed, targets: list[_Target]) -> dict[str, Series]:
    """The series one feed gives (empty when its family has no data in any target)."""
    out: dict[str, Series] = {}
    if feed.how == "gauge":
        got = _combined(targets, [_gauge(feed, t) for t in targets], feed.combine)
        if got is not None and (s := _series(*got)) is not None:
            out[feed.signal] = s
    elif feed.how == "rate":
        got = _combined(targets, [_counter(feed, feed.family, t) for t in targets])
        if got is not None and (s := _series(*got)) is not None:
            out[feed.signal] = s
    elif feed.how == "ratio":
        assert feed.per is not None
        top = _combined(targets, [_counter(feed, feed.family, t) for t in targets])
        bottom = _combined(targets, [_counter(feed, feed.per, t) for t in targets])
        if top is not None and bottom is not None and np.array_equal(top[0], bottom[0]):
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(bottom[1] > 0, top[1] / bottom[1], np.nan)
            if (s := _series(top[0], ratio)) is not None:
                out[feed.signal] = s
    elif feed.how == "sum_rate":
        per = [_histogram(feed, t) for t in targets]
        rates = [None if h is None else h["sum"] / _span(t) for t, h in zip(targets, per, strict=True)]
        got = _combined(targets, rates)
        if got is not None and (s := _series(*got)) is not None:
            out[feed.signal] = s
    else:
        out.update(_latency(feed, targets))
    return out


def _latency(feed: bk.Feed, targets: list[_Target]) -> dict[str, Series]:
    per = [_histogram(feed, t) for t in targets]
    names = sorted({k for h in per if h is not None for k in h if k.startswith("le:")})
    if not names:
        return {}
    inf = f"le:{math.inf!r}"
    if inf not in names:  # deltas are per bucket: the +Inf bucket's own share was zero throughout
        names.append(inf)
    parts: dict[str, tuple[np.ndarray, np.ndarray] | None] = {}
    for key in [*names, "sum", "count"]:
        parts[key] = _combined(targets, [None if h is None else h.get(key, np.zeros(t.grid.size) * np.nan)
                                         for t, h in zip(targets, per, strict=True)])  # fmt: skip
    grid = next(p[0] for p in parts.values() if p is not None)
    les = np.array([float(k[3:]) for k in names])
    order = np.argsort(les, kind="stable")
    les = les[order]
    counts = np.vstack([np.nan_to_num(parts[names[i]][1]) if parts[names[i]] is not None else np.zeros(grid.size)
                        for i in order])  # fmt: skip
    cumulative = np.cumsum(counts, axis=0)
    measured = np.zeros(grid.size, dtype=bool)  # a window of at least two scrapes (PromQL has no value otherwise)
    for key in names:
        p = parts[key]
        if p is not None:
            measured |= ~np.isnan(p[1])
    out: dict[str, Series] = {}
    for q, stat in _QUANTILES:
        values = np.where(measured, bucket_quantile(q, les, cumulative), np.nan)
        if (s := _series(grid, values)) is not None:
            out[sig.latency(feed.signal, stat)] = s
    total_sum, total_count = parts["sum"], parts["count"]
    if out and total_sum is not None and total_count is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            mean = np.where(total_count[1] > 0, total_sum[1] / total_count[1], np.nan)
        if (s := _series(grid, mean)) is not None:
            out[sig.latency(feed.signal, "mean")] = s
    return out


def service_from_backends(backends: Mapping[str, Mapping[str, Series]]) -> dict[str, Series]:
    """Every ``service:`` signal the recorded scrapes can fill: per signal, its first feed (in ``FEEDS`` order) with data."""
    targets = [t for series in backends.values() if (t := _target(series)) is not None]
    if not targets:
        return {}
    out: dict[str, Series] = {}
    for signal in bk.signals():
        for feed in bk.feeds_of(signal):
            got = _fill(feed, targets)
            if got:
                for key, series in got.items():
                    out.setdefault(key, series)
                break
    return out
