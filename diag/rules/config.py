"""Unsafe configuration: does the service's own configuration make the incident likely?

Why a rule: "four workers x 8 concurrent requests x 1.5 GiB each" against a 32 GiB limit is
arithmetic, and no sampler can see it -- only the ``ServiceConfig`` record a serving process writes
at start-up. Usually a *contributing* factor (the engine's causal weight for it is the lowest): the
confidence reaches 0.5 only when the arithmetic says the limit will be exceeded. Each risky setting
on its own (no timeouts, unbounded queue, per-worker preload ...) is listed with a small confidence.

Per-request memory comes from the records when they allow it: the Theil-Sen slope of the service's
memory against requests in flight (per time bucket) -- bytes per in-flight request, and its intercept
as the idle footprint. Weights come from ``weights_bytes`` (times workers with per-worker preload).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from diag.rules import numstats
from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext
from diag.rules.requests import analyse_requests, memory_series, service_context
from diag.rules.stats import limit_for
from diag.timeline import Timeline

GIB = float(1 << 30)
HUGE_PROMPT_CAP = 100_000
MIN_BUCKETS_FOR_SLOPE = 10
NEAR_LIMIT = 0.9  # observed peak at >= 90 % of the limit corroborates the projection
UNBOUNDED_REACH = 4.0  # unbounded concurrency counts as "will exceed" when the limit falls within 4x the observed peak in flight


@dataclass
class Issue:
    text: str
    major: bool


@dataclass
class Footprint:
    """Per-request memory and idle footprint estimated from the records (bytes)."""

    per_request: float
    idle: float
    source: str
    buckets: int
    peak_in_flight: float


def _num(settings: dict[str, Any], key: str) -> float | None:
    v = settings.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _limit(tl: Timeline, ac: AnalysisContext | None = None) -> tuple[float | None, str]:
    """The service cgroup's limit (or its tightest watched ancestor's), else host MemTotal -- as the memory family reads it."""
    return limit_for(tl, service_context(tl, ac).cgroup)


def _footprint(tl: Timeline, ac: AnalysisContext | None = None) -> Footprint | None:
    """Theil-Sen slope of service memory vs time-averaged requests in service, per load bucket."""
    load = analyse_requests(tl, ac) if len(tl.requests) else None
    mem = memory_series(tl, service_context(tl, ac))
    if load is None or load.curve is None or mem is None:
        return None
    c = load.curve
    m = np.interp(c.centers, mem[1].ts, mem[1].values, left=np.nan, right=np.nan)
    keep = np.isfinite(m) & np.isfinite(c.n_service)
    if keep.sum() < MIN_BUCKETS_FOR_SLOPE or np.ptp(c.n_service[keep]) < 1.0:
        return None
    n, y = c.n_service[keep], m[keep]
    if keep.sum() > 2000:  # Theil-Sen is O(n^2): a stride keeps a day of buckets cheap
        step = int(keep.sum() // 2000) + 1
        n, y = n[::step], y[::step]
    res = numstats.theilslopes(y, n)
    if not (np.isfinite(res.slope) and res.low_slope > 0):  # the 95 % interval must exclude zero
        return None
    return Footprint(float(res.slope), float(res.intercept), mem[0], int(keep.sum()), float(c.n_service.max()))


@rule("config.unsafe", "unsafe_config", needs=("config",))
def unsafe_config(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """workers x concurrency x per-request memory vs the limit; unbounded queue/concurrency/prompts; no timeouts or guard."""
    if not tl.configs:
        return None
    cfg = tl.configs[-1]
    s = dict(cfg.settings)
    workers = int(_num(s, "workers") or 1)
    issues: list[Issue] = []
    conc = _num(s, "max_concurrency")
    if "max_concurrency" in s and s["max_concurrency"] is None:
        issues.append(Issue("max_concurrency is unbounded: nothing stops memory growing with load", True))
    if "queue_size" in s:
        if s["queue_size"] is None:
            issues.append(Issue("queue_size is unbounded: a backlog grows latency and memory without limit", True))
        elif _num(s, "queue_size") == 0:
            issues.append(Issue("queue_size is 0: every burst above max_concurrency is rejected outright", False))
    no_timeouts = [k for k in ("queue_timeout_s", "request_timeout_s") if k in s and s[k] is None]
    if len(no_timeouts) == 2:
        issues.append(Issue("no queue or request timeout: stuck requests hold slots and memory forever", True))
    elif no_timeouts:
        issues.append(Issue(f"{no_timeouts[0]} is unset", False))
    preload = str(s.get("preload") or "")
    weights = _num(s, "weights_bytes")
    if preload == "per-worker" and workers > 1:
        extra = f" ({workers} x {weights / GIB:.2f} GiB)" if weights else ""
        issues.append(Issue(f"preload per worker with {workers} workers: {workers} copies of the model{extra}", True))
    if "max_prompt_tokens" in s and (s["max_prompt_tokens"] is None or (_num(s, "max_prompt_tokens") or 0) >= HUGE_PROMPT_CAP):
        issues.append(Issue("prompts are unbounded (max_prompt_tokens unset or huge)", True))
    if "memory_guard" in s and s["memory_guard"] in (None, False):
        issues.append(Issue("no memory guard: new work is admitted however full memory is", False))
    if str(s.get("refresh") or "") == "every-request":
        issues.append(Issue("refresh=every-request: the model is re-read inside every request", True))
    if str(s.get("batching") or "") == "requests":
        issues.append(Issue("batching by request count, not by a token budget", False))

    limit, limit_src = _limit(tl, ac)
    fp = _footprint(tl, ac)
    copies = workers if preload == "per-worker" else 1
    weights_total = weights * copies if weights else None
    projected = None
    exceeds = False
    reach = None  # in-flight requests at which an unbounded service hits the limit
    idle = weights_total or 0.0
    if fp is not None:
        # A shared mmap's weights are page cache, not anon: add them to an anon-based idle footprint.
        # Private per-worker copies are anon already, so the intercept includes them.
        shared_file = preload != "per-worker" and fp.source.endswith("stat.anon")
        idle = fp.idle + (weights_total or 0.0) if shared_file else max(fp.idle, weights_total or 0.0)
    if limit and idle >= limit:
        exceeds, projected = True, idle  # the idle footprint (weights) alone does not fit
    elif limit and fp is not None:
        if conc is not None:
            projected = idle + fp.per_request * workers * conc
            exceeds = projected > limit
        elif "max_concurrency" in s and s["max_concurrency"] is None:
            reach = (limit - idle) / fp.per_request
            exceeds = reach <= UNBOUNDED_REACH * max(fp.peak_in_flight, 1.0)
    if not issues and not exceeds:
        return None

    mem = memory_series(tl, service_context(tl, ac))
    peak = float(np.nanmax(mem[1].values)) if mem is not None and len(mem[1]) else math.nan
    near = bool(limit and np.isfinite(peak) and peak >= NEAR_LIMIT * limit)
    majors = sum(i.major for i in issues)
    conf = (0.25 + 0.05 * (majors - 1) if majors else 0.15) if issues else 0.0
    conf = min(conf, 0.45)
    if exceeds:
        conf = 0.6
        conf += 0.1 if (near or tl.ooms or tl.cuda_ooms) else 0.0
        conf += 0.1 if projected and limit and projected >= 1.5 * limit else 0.0
    evidence = [Evidence("workers", workers, "processes")]
    for key in ("max_concurrency", "queue_size", "queue_timeout_s", "request_timeout_s", "max_prompt_tokens", "memory_guard"):
        if key in s:
            unit = "s" if key.endswith("_s") else "tokens" if key == "max_prompt_tokens" else ""
            evidence.append(
                Evidence(
                    f"{key} (per worker)" if key == "max_concurrency" else key, "unbounded" if s[key] is None else s[key], unit
                )
            )
    for key in ("preload", "refresh", "batching"):
        if key in s:
            evidence.append(Evidence(key, str(s[key]), ""))
    for issue in issues:
        evidence.append(Evidence("risky setting" if issue.major else "minor setting", issue.text, ""))
    if weights_total:
        evidence.append(
            Evidence(f"model weights resident ({copies} cop{'y' if copies == 1 else 'ies'})", int(weights_total), "bytes")
        )
    if limit:
        evidence.append(Evidence(limit_src, int(limit), "bytes"))
    else:
        evidence.append(Evidence("memory limit", None, "bytes"))
    if fp is not None:
        evidence.append(
            Evidence(
                f"memory per in-flight request (Theil-Sen slope of {fp.source} on requests in service)",
                int(fp.per_request),
                "bytes/request",
            )
        )
        evidence.append(Evidence("idle footprint (slope intercept)", int(fp.idle), "bytes"))
        evidence.append(Evidence("load buckets the slope rests on", fp.buckets, "buckets"))
    if projected is not None:
        evidence.append(Evidence("projected memory at full configured concurrency", int(projected), "bytes"))
    if reach is not None:
        evidence.append(Evidence("requests in flight at which memory reaches the limit", round(reach, 1), "requests"))
    if np.isfinite(peak):
        evidence.append(Evidence(f"observed peak ({mem[0] if mem else ''})", int(peak), "bytes"))
    if exceeds and projected is not None and limit and projected == idle:
        head = f"the idle footprint with the model weights ({idle / GIB:.2f} GiB) alone exceeds the {limit / GIB:.2f} GiB limit"
    elif exceeds and projected and limit:
        head = f"at full load memory reaches {projected / GIB:.2f} GiB against a {limit / GIB:.2f} GiB limit"
    elif exceeds and reach is not None and limit:
        head = f"with unbounded concurrency memory reaches the {limit / GIB:.2f} GiB limit at ~{reach:.0f} requests in flight"
    else:
        head = f"{len(issues)} risky setting(s)"
    rules_out = [] if exceeds else ["the arithmetic does not put full load over the limit: a risk, not a cause"]
    if fp is None:
        rules_out.append(
            "per-request memory could not be estimated from the records (too little load variation or no memory series)"
        )
    remediation = [
        "size workers x max_concurrency x per-request memory (+ weights) to fit under the memory limit with headroom",
        "bound concurrency and the queue, with queue and request timeouts, and reject the excess with 429 + Retry-After",
        "add a memory guard (503 when memory or PSI is high) and cap prompt tokens",
    ]
    if preload == "per-worker" and workers > 1:
        remediation.append("load the model once and share it (preload before forking, or mmap one file) instead of per worker")
    return Finding(
        cls="unsafe_config",
        rule="config.unsafe",
        confidence=conf,
        summary=f"Configuration of {cfg.service or 'the service'}: {head}"
        + (f"; {'; '.join(i.text for i in issues[:3])}" if issues else ""),
        evidence=evidence,
        rules_out=rules_out,
        remediation=remediation,
        start=tl.start,
        end=tl.end,
    )
