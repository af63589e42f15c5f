"""Queue backlog vs thrashing: is latency waiting for a slot, or is each request itself slowing down?

The two look alike on an end-to-end latency chart and need opposite fixes (queueing theory: W = W_q + S):

- **queue backlog** (under-provisioned): queue wait W_q rises with load while the service time S
  (``inference_s``) stays flat; throughput rises then plateaus; memory stall signals stay quiet.
  Fix: bounded concurrency with a small queue and backpressure, scale out.
- **thrashing**: S itself inflates with concurrency, with a heavy tail; throughput *falls* as
  concurrency grows (USL kappa > 0); memory PSI and major faults / refaults rise. Fix: *lower*
  concurrency, guard memory, shrink the working set.

Both rules read one pass over the request table (``requestload.analyse_requests``: the load each
request met, low- and high-load quartiles, the load curve) and compare the service's memory-stall
signals between its loaded/slow and calm buckets (``stall_signals.memory_stall``), preferring the
service's own cgroup and processes over the host, so a neighbour's pressure is not read as ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext
from diag.rules.requestload import (
    MIN_REQUESTS,
    OVERWHELM_FACTOR,
    OVERWHELM_SHARE,
    S_FLAT,
    S_INFLATED,
    S_SEVERE,
    W_MIN_S,
    W_MIN_VS_S,
    W_RISE,
    W_RISE_MARGIN_S,
    WAIT_DOMINATES,
    RequestLoad,
    analyse_requests,
    too_few_requests,
)
from diag.rules.stall_signals import STALL_SIGNALS, StallSignal, memory_stall
from diag.rules.stats import excerpt_arrays, service_context
from diag.rules.usl import covered_time
from diag.timeline import Timeline
from diag.units import format_seconds

# Short windows: the backlog is decided on per-request evidence when it is overwhelming (``requestload``'s
# OVERWHELM_SHARE of the started requests waiting OVERWHELM_FACTOR x their own inference time) and someone
# was waiting at every moment: gaps of at most OVERWHELM_GAP_S over OVERWHELM_COVER of the window.
OVERWHELM_GAP_S = 0.01
OVERWHELM_COVER = 0.9  # the unbroken waiting stretch must cover 90 % of first arrival .. last start
NO_STALL_CAP = 0.2  # thrashing without a memory stall stays below the suspect level (0.3): it is not thrashing
NOT_INFLATED_CAP = 0.4  # throughput falls but each request is not slower (under S_INFLATED): a suspect at most
S_SLOWED = 2.0  # a backlog whose service time also doubled is at least partly a symptom ...
DOMINANT_WAIT_GAIN = 0.15
PLATEAU_SHARE = 0.8  # goodput in the busiest buckets >= 80 % of the p90: throughput plateaus, as a backlog's does
SHED_SHARE = 0.01  # requests refused or timed out in the queue: >= 1 % of them (and at least one) is shedding
LOADER_OWNS_WAIT = 0.6  # on-path loads cover >= 60 % of the queue wait: the wait is the loader's ...
LOADER_CEILING = 0.4  # ... and a backlog a suspect at most: more capacity would not remove it
LOADER_PART_OF_WAIT = 0.3  # >= 30 %: partly the loader's
LITTLE_TOLERANCE = 0.2  # L and lambda*W further apart than 20 %: records dropped or truncated
TAU_RISING = 0.2  # Kendall tau of inference time on load met: rising with load
HEAVY_TAIL = 3.0  # p99 / median inference time at high load


# --------------------------------------------------------------------------- evidence


def _stall_summary(signals: list[StallSignal], most: int = 4) -> str:
    return ", ".join(f"{s.label()} {s.hi:.3g} {s.unit}" for s in signals[:most])


def _loader_wait_share(tl: Timeline) -> float | None:
    """Share of all queue wait spent while an on-path loader ran; None without loader events."""
    ld, req = tl.loader, tl.requests
    if not len(ld) or "in_request_path" not in ld:
        return None
    on_path = ld["in_request_path"] > 0
    if not on_path.any():
        return 0.0
    ls = ld["start"][on_path]
    le = ls + ld["duration_s"][on_path]
    has = np.isfinite(req["start"])
    total = float(np.nansum(req["queue_wait_s"][has]))
    if total <= 0:
        return 0.0
    return float(covered_time(ls, le, req["arrival"][has], req["start"][has]).sum() / total)


# --------------------------------------------------------------------------- the rules


def _basis(load: RequestLoad) -> Evidence:
    return Evidence("requests analysed (started / all)", f"{load.started} / {load.total}", "requests", load.t_first, load.t_last)


def _wait_series(load: RequestLoad) -> Evidence | None:
    c = load.curve
    if c is None:
        return None
    return Evidence(
        "requests in system (time-averaged per bucket)",
        round(load.load_high, 2),
        "requests",
        float(c.edges[0]),
        float(c.edges[-1]),
        excerpt_arrays(c.centers, c.n_system),
    )


@dataclass
class Overwhelming:
    """The per-request evidence that decides a backlog without any calm period to compare against."""

    n: int
    share: float  # of started requests whose queue wait >= OVERWHELM_FACTOR x their inference time
    wait_median: float
    inference_median: float
    t0: float
    t1: float
    stalled: list[StallSignal]


def _never_empty(arrival: np.ndarray, start: np.ndarray) -> tuple[bool, float, float]:
    """Whether someone was waiting (arrival <= t < start) without a break over ``OVERWHELM_COVER`` of the time from
    the first arrival to the last start -- the ramp-up (the first clients find the slot free) aside."""
    waited = start - arrival > 0
    a, b = arrival[waited], start[waited]
    if a.size < 2:
        return False, math.nan, math.nan
    order = np.argsort(a, kind="stable")
    a, b = a[order], b[order]
    reach = np.maximum.accumulate(b)
    breaks = np.flatnonzero(a[1:] - reach[:-1] > OVERWHELM_GAP_S)  # a new stretch starts after each break
    firsts = np.concatenate([[0], breaks + 1])
    lasts = np.concatenate([breaks, [a.size - 1]])
    lengths = reach[lasts] - a[firsts]
    i = int(np.argmax(lengths))
    span = float(np.max(start) - np.min(arrival))
    ok = span > 0 and float(lengths[i]) >= OVERWHELM_COVER * span
    return bool(ok), float(a[firsts[i]]), float(reach[lasts[i]])


def overwhelming_check(tl: Timeline, ac: AnalysisContext | None = None) -> Overwhelming | None:
    """>= ``MIN_REQUESTS`` started requests, >= 80 % of them waiting >= 3x their own inference time, and the queue
    never empty over the window: a backlog whatever the window's length (seconds are enough)."""
    req = tl.requests
    if not len(req) or "start" not in req:
        return None
    started = np.isfinite(req["start"]) & np.isfinite(req["arrival"]) & np.isfinite(req["finish"])
    n = int(started.sum())
    if n < MIN_REQUESTS:
        return None
    w, s = req["queue_wait_s"][started], req["inference_s"][started]
    share = float(np.mean(w >= OVERWHELM_FACTOR * np.maximum(s, 1e-3)))
    if share < OVERWHELM_SHARE:
        return None
    never_empty, t0, t1 = _never_empty(req["arrival"][started], req["start"][started])
    if not never_empty:
        return None
    stall = [x for x in memory_stall(tl, service_context(tl, ac), None) if x.up and x.service]
    return Overwhelming(n, share, float(np.median(w)), float(np.median(s)), t0, t1, stall)


def overwhelming_backlog(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | None:
    ov = overwhelming_check(tl, ac)
    if ov is None:
        return None
    conf = 0.7 if not ov.stalled else 0.45  # memory stalls too: the wait may be a thrashing service's
    evidence = [
        Evidence(f"requests waiting >= {OVERWHELM_FACTOR:g}x their inference time", round(ov.share, 3), f"ratio of {ov.n}",
                 ov.t0, ov.t1),
        Evidence("median queue wait", round(ov.wait_median, 4), "s", ov.t0, ov.t1),
        Evidence("median inference time", round(ov.inference_median, 4), "s", ov.t0, ov.t1),
        Evidence("queue empty at any moment between the first wait and the last start", "never", "", ov.t0, ov.t1),
    ]  # fmt: skip
    for x in ov.stalled[:2]:
        evidence.append(Evidence(f"{x.label()} (loaded vs calm)", f"{x.hi:.3g} vs {x.lo:.3g}", x.unit))
    return Finding(
        cls="queue_backlog",
        rule="requests.queue_backlog",
        confidence=conf,
        summary=(
            f"{ov.share:.0%} of {ov.n} requests waited >= {OVERWHELM_FACTOR:g}x their inference time "
            f"(median wait {format_seconds(ov.wait_median)} vs {format_seconds(ov.inference_median)} inference) "
            "and the queue never emptied "
            f"in {ov.t1 - ov.t0:.0f} s: more work arrives than the slots serve"
        ),
        evidence=evidence,
        rules_out=[
            "judged on per-request evidence alone: the window holds no calm period to compare with",
            *([f"memory stalls too ({_stall_summary(ov.stalled)}): check thrashing"] if ov.stalled else []),
        ],
        remediation=[
            "bound concurrency and keep the queue small; reject the excess early with 429 + Retry-After (backpressure)",
            "scale out (more replicas/workers within the memory budget) or rate-limit the heaviest clients",
        ],
        start=ov.t0,
        end=ov.t1,
    )


@rule("requests.queue_backlog", "queue_backlog", needs=("requests",))
def queue_backlog(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Queue wait rises with load while inference time stays flat and memory does not stall."""
    load = analyse_requests(tl, ac)
    if load is None:
        return too_few_requests(tl)
    w_rose = load.w_high >= max(W_MIN_S, W_MIN_VS_S * load.s_base) and load.w_high >= W_RISE * load.w_low + W_RISE_MARGIN_S
    if not w_rose:
        return overwhelming_backlog(tl, ac)  # a short, uniformly overloaded window has no calm quartile to compare
    infl = load.s_inflation
    ctx = service_context(tl, ac)
    stall = memory_stall(tl, ctx, load.curve)
    # Judge the service's own stall signals when it has them: host-wide stalls while the service's cgroup
    # stays calm are a neighbour's (placement.noisy_neighbour), not evidence against a backlog here.
    own = [s for s in stall if s.service]
    stall = own or stall
    stalled = [s for s in stall if s.up]
    loader_share = _loader_wait_share(tl)
    dominant = load.s_high > 0 and load.w_high >= WAIT_DOMINATES * load.s_high and infl < S_SEVERE and not stalled
    conf = 0.45
    slowed = -0.2 if infl >= S_SLOWED and not dominant else 0.0
    conf += 0.2 if infl < S_FLAT else (0.1 if infl < S_INFLATED else slowed)
    if dominant:
        conf += DOMINANT_WAIT_GAIN
    if stall:
        conf += -0.25 if stalled else 0.1
    plateau = np.isfinite(load.x_loaded_share) and load.x_loaded_share >= PLATEAU_SHARE and not load.retrograde
    if plateau:
        conf += 0.1
    if load.retrograde:
        conf -= 0.1
    shed = sum(load.outcomes.get(k, 0) for k in ("rejected", "queue_timeout"))
    if shed >= max(1, SHED_SHARE * load.total):
        conf += 0.05
    if loader_share is not None and loader_share >= LOADER_OWNS_WAIT:
        conf = min(conf, LOADER_CEILING)  # the wait *is* the loader: more capacity would not remove it
    elif loader_share is not None and loader_share >= LOADER_PART_OF_WAIT:
        conf -= 0.15
    evidence = [
        Evidence("median queue wait, high-load quartile", round(load.w_high, 4), "s", load.high_start, load.high_end),
        Evidence("median queue wait, low-load quartile", round(load.w_low, 4), "s"),
        Evidence("p95 queue wait, high-load quartile", round(load.w_high_p95, 4), "s", load.high_start, load.high_end),
        Evidence("median inference time, low-load quartile (baseline)", round(load.s_base, 4), "s"),
        Evidence("median inference time, high-load quartile", round(load.s_high, 4), "s", load.high_start, load.high_end),
        Evidence("inference time inflation (worst of by-load and by-time)", round(infl, 2), "x"),
        *_wait_over_service(load),
        Evidence(
            "requests in system met at arrival, low / high quartile", f"{load.load_low:.0f} / {load.load_high:.0f}", "requests"
        ),
        Evidence("Kendall tau, queue wait vs load met", round(load.tau_w, 3), "tau"),
        _basis(load),
    ]
    if np.isfinite(load.x_loaded_share):
        evidence.append(Evidence("goodput in the busiest buckets / p90 goodput", round(load.x_loaded_share, 2), "ratio"))
    if np.isfinite(load.little_error):
        evidence.append(Evidence("Little's law: L vs lambda*W relative difference", round(load.little_error, 3), "ratio"))
    if shed:
        evidence.append(Evidence("requests rejected or timed out in the queue", shed, "requests"))
    wait = _wait_series(load)
    if wait:
        evidence.append(wait)
    for s in stall[:4]:
        evidence.append(Evidence(f"{s.label()} (loaded vs calm)", f"{s.hi:.3g} vs {s.lo:.3g}", s.unit))
    rules_out = []
    if infl < S_INFLATED:
        rules_out.append(
            f"not thrashing: inference time flat at {format_seconds(load.s_high)} "
            f"({infl:.2f}x its baseline {format_seconds(load.s_base)}) "
            f"while queue wait rose to {format_seconds(load.w_high)}"
        )
    if stall and not stalled:
        rules_out.append(f"no memory stall: {_stall_summary(stall)} at the busiest times")
    elif stalled:
        rules_out.append(f"memory does stall ({_stall_summary(stalled)}): thrashing may be part of this")
    elif not stall:
        rules_out.append("memory stall not evaluated (no PSI / fault / refault signals recorded)")
    if loader_share is not None:
        rules_out.append(
            f"{'not' if loader_share < LOADER_PART_OF_WAIT else 'partly'} a blocking loader: on-path loads cover "
            f"{loader_share:.0%} of the queue wait"
        )
    if np.isfinite(load.little_error) and load.little_error > LITTLE_TOLERANCE:
        rules_out.append(f"telemetry inconsistent: Little's law off by {load.little_error:.0%} (dropped or truncated records?)")
    return Finding(
        cls="queue_backlog",
        rule="requests.queue_backlog",
        confidence=conf,
        summary=(
            f"Requests wait {format_seconds(load.w_high)} for a slot at high load "
            f"(vs {format_seconds(load.w_low)} at low load) while inference "
            + (
                f"stays at {format_seconds(load.s_high)} ({infl:.2f}x baseline): too little capacity, not a slower service"
                if infl < S_INFLATED
                else f"also slowed {infl:.1f}x to {format_seconds(load.s_high)}, but the wait is "
                f"{load.w_high / load.s_high:.0f}x the inference time: too little capacity, with a contributing slowdown"
                if dominant
                else f"also slowed {infl:.1f}x to {format_seconds(load.s_high)}: the queue is at least partly a symptom"
            )
        ),
        evidence=evidence,
        rules_out=rules_out,
        remediation=[
            "bound concurrency and keep the queue small; reject the excess early with 429 + Retry-After (backpressure)",
            "use separate queue-wait and inference timeouts so queued requests fail fast instead of timing out late",
            "scale out (more replicas/workers within the memory budget) or rate-limit the heaviest clients",
        ],
        start=load.high_start,
        end=load.high_end,
    )


def _wait_over_service(load: RequestLoad) -> list[Evidence]:
    """The high-load quartile's queue wait over its inference time, where there was inference time to divide by:
    both the backlog's and the thrash's evidence show it, since it is the figure that tells the two apart."""
    if load.s_high <= 0:
        return []
    ratio = round(load.w_high / load.s_high, 1)
    what = "median queue wait / median inference time, high-load quartile"
    return [Evidence(what, ratio, "x", load.high_start, load.high_end)]


def _thrash_evidence(load: RequestLoad, stall: list[StallSignal], tail: float) -> list[Evidence]:
    """The numbers behind a thrashing finding: inference inflation, goodput vs concurrency, the USL fit, the stalls."""
    infl = load.s_inflation
    evidence = [
        Evidence("median inference time, low-load quartile (baseline)", round(load.s_base, 4), "s"),
        Evidence("median inference time, high-load quartile", round(load.s_high, 4), "s", load.high_start, load.high_end),
        Evidence("median inference time, first fifth vs worst fifth by time", f"{load.s_early:.4g} vs {load.s_worst:.4g}", "s"),
        Evidence("inference time inflation (worst of by-load and by-time)", round(infl, 2), "x"),
        *_wait_over_service(load),
        Evidence("p99 / median inference time, high-load quartile", round(tail, 2) if np.isfinite(tail) else None, "ratio"),
        Evidence("Kendall tau, inference time vs load met", round(load.tau_s, 3), "tau"),
        Evidence("median queue wait, high-load quartile", round(load.w_high, 4), "s", load.high_start, load.high_end),
        _basis(load),
    ]
    if np.isfinite(load.x_peak):
        evidence.append(
            Evidence("peak goodput / at concurrency", f"{load.x_peak:.3g} / {load.n_at_peak:.1f}", "req/s / requests")
        )
        evidence.append(
            Evidence("goodput at the highest concurrency seen", f"{load.x_top:.3g} at {load.n_top:.1f}", "req/s at requests")
        )
    if load.fit is not None:
        f = load.fit
        evidence.append(Evidence("USL sigma (contention)", round(f.sigma, 4), ""))
        evidence.append(Evidence("USL kappa (coherency)", round(f.kappa, 6), ""))
        evidence.append(
            Evidence(
                "USL N* (concurrency of peak throughput)", round(f.n_star, 2) if math.isfinite(f.n_star) else "inf", "requests"
            )
        )
        evidence.append(
            Evidence(
                "USL fit R^2 over concurrency levels",
                round(f.r2, 3),
                "",
                series=[[round(float(n), 3), float(x)] for n, x in zip(f.levels[:50], f.level_x[:50], strict=True)],
            )
        )
    for s in stall:
        evidence.append(
            Evidence(
                f"{s.label()} (loaded vs calm)",
                f"{s.hi:.3g} vs {s.lo:.3g}",
                s.unit,
                float(s.series.ts[0]),
                float(s.series.ts[-1]),
                excerpt_arrays(s.series.ts, s.series.values),
            )
        )
    return evidence


@rule("requests.thrashing", "thrashing", needs=("requests",), needs_any=STALL_SIGNALS)
def thrashing(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Inference time inflates with concurrency, throughput falls, and memory stalls (PSI, major faults, refaults)."""
    load = analyse_requests(tl, ac)
    if load is None:
        return None
    infl = load.s_inflation
    if infl < S_INFLATED and not load.retrograde:
        return None
    ctx = service_context(tl, ac)
    stall = memory_stall(tl, ctx, load.curve)
    service_up = [s for s in stall if s.up and s.service]
    host_up = [s for s in stall if s.up and not s.service]
    service_seen = any(s.service for s in stall)
    neighbour = bool(host_up) and service_seen and not service_up
    stall_ok = bool(service_up) or (bool(host_up) and not service_seen)
    conf = 0.0
    if infl >= S_INFLATED:
        conf += 0.3 + (0.1 if infl >= S_SEVERE else 0.0)
    if load.tau_s >= TAU_RISING:
        conf += 0.05
    if stall_ok:
        conf += 0.3
    if load.retrograde:
        conf += 0.15
    tail = load.s_high_p99 / load.s_high if load.s_high > 0 else math.nan
    if np.isfinite(tail) and tail >= HEAVY_TAIL:
        conf += 0.05
    if not stall_ok:  # a slowdown without any memory stall is CPU or batch contention: a note, not a suspect
        conf = min(conf, NO_STALL_CAP)
    if infl < S_INFLATED:
        conf = min(conf, NOT_INFLATED_CAP)
    evidence = _thrash_evidence(load, stall, tail)
    rules_out = []
    if infl >= S_INFLATED:
        rules_out.append(
            f"not a plain queue backlog: inference time itself rose {infl:.1f}x "
            f"({format_seconds(load.s_base)} -> {format_seconds(max(load.s_high, load.s_worst))})"
        )
    if service_up:
        rules_out.append(f"not a noisy neighbour: the service's own {_stall_summary(service_up)} rose")
    elif neighbour:
        rules_out.append(
            f"not this service thrashing: host memory stalls ({_stall_summary(host_up)}) but the service's own "
            "signals stay calm -- look at a noisy neighbour"
        )
    elif not stall_ok:
        rules_out.append(
            f"no memory stall at the slow times ({_stall_summary(stall)}): the slowdown is CPU or batch contention, not thrashing"
        )
    n_star = load.fit.n_star if load.fit is not None and math.isfinite(load.fit.n_star) else None
    lower_to = f" (~{n_star:.0f} in flight, the USL peak)" if n_star else ""
    summary_stall = _stall_summary(service_up or host_up, 2) if stall_ok else "no memory stall"
    return Finding(
        cls="thrashing",
        rule="requests.thrashing",
        confidence=conf,
        summary=(
            f"Each request slows as concurrency grows: inference {format_seconds(load.s_base)} -> "
            f"{format_seconds(max(load.s_high, load.s_worst))} "
            f"({infl:.1f}x){', throughput falls' if load.retrograde else ''}; memory stall: {summary_stall}"
        ),
        evidence=evidence,
        rules_out=rules_out,
        remediation=[
            f"lower max concurrency{lower_to}: past the peak every extra request slows all the others",
            "add a memory guard (reject new work with 503 when memory PSI or usage is high) and shed load",
            "shrink the working set: fix RSS growth, share one model copy (preload once, mmap), cap prompt/batch tokens",
        ],
        start=load.high_start,
        end=load.high_end,
    )
