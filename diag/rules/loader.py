"""Blocking loader refresh: does a model or registry reload sit on the request path?

The bug (ARCHITECTURE.md incident classes): a handler re-reads its checkpoint or registry on every
request -- or holds a lock / blocks the event loop while a refresh runs -- so requests wait for the
loader, not for a slot. More replicas do not help; moving the refresh off the request path does.

Evidence, from ``LoaderEvent`` rows and the request table:

- which loads were *on the path*: flagged ``in_request_path`` by the tracker, or whose
  [start, start + duration] overlaps some request's arrival -> start window (wait window);
- how often: on-path loads per request (about one per request is refresh-per-request);
- how much of the waiting they explain: seconds of queue wait covered by a running on-path load,
  over all queue wait (overlapping loads counted once);
- the bimodal latency it causes: requests whose wait overlapped a load vs those whose did not.

A background TTL refresh that merely coincides with a backlog a few times an hour is flagged
``in_request_path`` by the tracker too (it ran while requests waited); the rate and the share of
wait are what separate it from the bug, so such a timeline stays quiet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext
from diag.rules.stats import excerpt_arrays
from diag.rules.usl import covered_time
from diag.timeline import Table, Timeline
from diag.units import format_seconds

MIN_ON_PATH = 3  # fewer on-path loads is an anecdote, not a pattern
SHARE_QUIET = 0.05  # below this share of queue wait AND ...
RATE_QUIET = 0.1  # ... this many loads per request, the loads are background noise: stay quiet
RATE_PER_REQUEST = 0.5  # >= one load per two requests: a refresh in (nearly) every request
SHARE_MOST = 0.5  # on-path loads cover half the queue wait or more: the wait is mostly the loader's
SHARE_MATERIAL = 0.2  # a fifth or more: more slots or replicas would not remove it
BIMODAL_FACTOR = 2.0  # requests that waited on a load take twice as long end to end as the rest
MISSES_MOST = 0.8  # on-path loads that missed the cache: a refresh that re-reads, not a cache hit


@dataclass
class OnPath:
    """Loads matched against the requests' wait windows (arrival -> start, or -> finish if never started)."""

    ls: np.ndarray  # load start
    le: np.ndarray  # load end
    dur: np.ndarray  # load duration (0 where unknown)
    valid: np.ndarray  # requests with an arrival and a finish
    a: np.ndarray  # their arrivals
    w_end: np.ndarray  # and the end of their wait
    l_pid: np.ndarray
    r_pid: np.ndarray
    flagged: np.ndarray  # loads the tracker flagged as on the request path
    on_path: np.ndarray  # flagged, or overlapping some request's wait in the same process


def _match_loads(ld: Table, req: Table) -> OnPath | None:
    """Which loads sat on the request path: flagged by the tracker, or overlapping a wait window.

    Loads and requests are matched per process where both name one: worker A's reload does not block
    worker B's requests. Rows without a pid are matched against everything. None without a request
    that has both an arrival and a finish.
    """
    ls = ld["start"] if "start" in ld else ld["ts"]
    dur = np.nan_to_num(ld["duration_s"], nan=0.0) if "duration_s" in ld else np.zeros(len(ld))
    le = ls + dur
    arrival, start, finish = req["arrival"], req["start"], req["finish"]
    valid = np.isfinite(arrival) & np.isfinite(finish)
    if valid.sum() == 0:
        return None
    wait_end = np.where(np.isfinite(start), start, finish)  # a request that never started waited until it gave up
    a, w_end = arrival[valid], wait_end[valid]
    l_pid = ld["pid"] if "pid" in ld else np.full(len(ld), np.nan)
    r_pid = req["pid"][valid] if "pid" in req else np.full(a.size, np.nan)
    flagged = (ld["in_request_path"] > 0) if "in_request_path" in ld else np.zeros(len(ld), bool)
    overlaps = np.zeros(len(ld), bool)
    for lsel, rsel in _pid_groups(l_pid, r_pid):
        overlaps[lsel] = _overlaps_wait(ls[lsel], le[lsel], a[rsel], w_end[rsel])
    return OnPath(ls, le, dur, valid, a, w_end, l_pid, r_pid, flagged, flagged | overlaps)


def _loader_confidence(share: float, rate: float, bimodal: bool, miss_share: float, any_flagged: bool) -> float:
    """Mostly how much of the waiting the loads explain, then how often they run; the rest only corroborates.

    Why share first: a backlog that coincides with a background refresh has loads on the path too, but
    they explain little of the wait -- more slots would fix that one, and not this one.
    """
    conf = 0.3
    conf += 0.3 if share >= SHARE_MOST else 0.2 if share >= SHARE_MATERIAL else 0.1 if share >= SHARE_QUIET else 0.0
    conf += 0.2 if rate >= RATE_PER_REQUEST else 0.1 if rate >= RATE_QUIET else 0.0
    conf += 0.1 if bimodal else 0.0
    conf += 0.05 if np.isfinite(miss_share) and miss_share >= MISSES_MOST else 0.0
    conf += 0.05 if any_flagged else 0.0
    return min(conf, 0.95)


@rule("loader.blocking_refresh", "blocking_loader_refresh", needs=("loader", "requests"))
def blocking_loader_refresh(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Model/registry loads run inside requests' arrival -> start windows, often enough to explain the waiting."""
    ld, req = tl.loader, tl.requests
    if not len(ld) or not len(req):
        return None
    m = _match_loads(ld, req)
    if m is None:
        return None
    ls, le, dur, valid, a, w_end, on_path = m.ls, m.le, m.dur, m.valid, m.a, m.w_end, m.on_path
    finish = req["finish"]
    n_on = int(on_path.sum())
    warmup = int((~on_path & (le <= a.min())).sum())
    if n_on < MIN_ON_PATH:
        return None

    n_req = int(valid.sum())
    rate = n_on / n_req
    waits = np.clip(w_end - a, 0.0, None)
    covered = np.zeros(a.size)
    for lsel, rsel in _pid_groups(m.l_pid, m.r_pid):
        pick = lsel & on_path
        covered[rsel] = covered_time(ls[pick], le[pick], a[rsel], w_end[rsel])
    total_wait = float(waits.sum())
    share = float(covered.sum() / total_wait) if total_wait > 0 else 0.0
    if share < SHARE_QUIET and rate < RATE_QUIET:
        return None
    e2e = np.clip(finish[valid] - a, 0.0, None)
    e2e_share = float(covered.sum() / e2e.sum()) if e2e.sum() > 0 else 0.0
    hit = covered > 0
    e2e_hit = float(np.median(e2e[hit])) if hit.any() else math.nan
    e2e_clear = float(np.median(e2e[~hit])) if (~hit).any() else math.nan
    bimodal = hit.any() and (~hit).any() and e2e_clear > 0 and e2e_hit >= BIMODAL_FACTOR * e2e_clear
    misses = ld["cache_hit"][on_path] if "cache_hit" in ld else np.full(n_on, np.nan)
    known = np.isfinite(misses)
    miss_share = float(np.mean(misses[known] == 0)) if known.any() else math.nan
    bytes_on = ld["bytes_read"][on_path] if "bytes_read" in ld else np.full(n_on, np.nan)
    bytes_total = float(np.nansum(bytes_on)) if np.isfinite(bytes_on).any() else math.nan

    conf = _loader_confidence(share, rate, bool(bimodal), miss_share, bool(m.flagged[on_path].any()))

    t_on = ls[on_path]
    evidence = [
        Evidence("loads on the request path", n_on, "loads", float(t_on.min()), float(le[on_path].max())),
        Evidence("start-up loads before the first request (not counted)", warmup, "loads"),
        Evidence("on-path loads per request", round(rate, 3), "loads/request"),
        Evidence("share of all queue wait spent while an on-path load ran", round(share, 3), "ratio"),
        Evidence("share of end-to-end latency spent inside on-path loads", round(e2e_share, 3), "ratio"),
        Evidence("median on-path load duration", round(float(np.median(dur[on_path])), 4), "s"),
        Evidence("total on-path load time", round(float(dur[on_path].sum()), 3), "s"),
        Evidence("requests whose wait overlapped a load", int(hit.sum()), "requests"),
        Evidence("median e2e, requests that waited on a load vs the rest", _pair(e2e_hit, e2e_clear), "s"),
        Evidence("requests analysed", n_req, "requests", float(a.min()), float(finish[valid].max())),
        Evidence(
            "on-path load durations over time",
            round(float(np.max(dur[on_path])), 4),
            "s",
            series=excerpt_arrays(t_on, dur[on_path]),
        ),
    ]
    if np.isfinite(bytes_total):
        evidence.append(Evidence("bytes read by on-path loads", int(bytes_total), "bytes"))
    if np.isfinite(miss_share):
        evidence.append(Evidence("on-path loads that missed the cache", round(miss_share, 3), "ratio"))
    rules_out = []
    if share >= SHARE_MATERIAL:
        rules_out.append(
            f"not a capacity backlog: {share:.0%} of the queue wait is loader time, so more slots or replicas would not remove it"
        )
    if rate >= RATE_PER_REQUEST:
        rules_out.append(f"not an occasional background refresh: {rate:.2f} loads per request")
    return Finding(
        cls="blocking_loader_refresh",
        rule="loader.blocking_refresh",
        confidence=conf,
        summary=(
            f"{n_on} model/registry loads ran on the request path ({rate:.2f} per request, median "
            f"{format_seconds(float(np.median(dur[on_path])))} each), covering {share:.0%} of all queue wait"
        ),
        evidence=evidence,
        rules_out=rules_out,
        remediation=[
            "serve from a cache with a TTL and refresh it in the background instead of re-reading on every request",
            "preload the model once at start-up (before accepting traffic) and swap new versions in atomically",
            "never run blocking file I/O on the event loop: move loads to a worker thread outside the request path",
        ],
        start=float(t_on.min()),
        end=float(le[on_path].max()),
    )


def _pair(a: float, b: float) -> str:
    return " vs ".join("n/a" if math.isnan(v) else f"{v:.4g}" for v in (a, b))


def _pid_groups(l_pid: np.ndarray, r_pid: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(loader mask, request mask) pairs: one per process named on both sides, else everything with everything."""
    shared = np.intersect1d(l_pid[np.isfinite(l_pid)], r_pid[np.isfinite(r_pid)])
    if shared.size == 0 or np.isnan(l_pid).any() or np.isnan(r_pid).any():
        return [(np.ones(l_pid.size, bool), np.ones(r_pid.size, bool))]
    return [(l_pid == p, r_pid == p) for p in shared]


def _overlaps_wait(ls: np.ndarray, le: np.ndarray, arrival: np.ndarray, wait_end: np.ndarray) -> np.ndarray:
    """Whether each load [ls, le] overlaps some request's wait window [arrival, wait_end] (prefix max over arrivals)."""
    if arrival.size == 0:
        return np.zeros(ls.size, bool)
    order = np.argsort(arrival, kind="stable")
    a_sorted, wmax = arrival[order], np.maximum.accumulate(wait_end[order])
    idx = np.searchsorted(a_sorted, le, "left") - 1
    return (idx >= 0) & (wmax[np.clip(idx, 0, None)] > ls)
