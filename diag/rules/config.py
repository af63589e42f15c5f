"""Unsafe configuration: does the service's own configuration make the incident likely?

Why a rule: "four workers x 8 concurrent requests x 1.5 GiB each" against a 32 GiB limit is
arithmetic, and no sampler can see it -- only the ``ServiceConfig`` record a serving process writes
at start-up. Usually a *contributing* factor (the engine's causal weight for it is the lowest): the
confidence reaches 0.5 only when the arithmetic says the limit will be exceeded. Each risky setting
on its own (no timeouts, unbounded queue, per-worker preload ...) is listed with a small confidence.

An engine's context length is arithmetic too: llama.cpp reserves the KV cache for its whole ``n_ctx`` when the
context is created (2 x layers x n_ctx x the KV width x bytes per element), before any request. When that
reservation outweighs the model itself it is named as a risky setting with what it costs, and it is part of
the idle footprint the limit must hold, once per server (the settings and the model's dimensions come from
``collectors.engine_config``, which reads them from the server's command line and the GGUF header).

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
from diag.rules.requestload import analyse_requests
from diag.rules.stats import in_cgroup, limit_for, memory_series, service_context, watched
from diag.timeline import Series, Timeline
from diag.units import format_bytes

GIB = float(1 << 30)
HUGE_PROMPT_CAP = 100_000
MIN_BUCKETS_FOR_SLOPE = 10
MIN_LOAD_RANGE = 1.0  # requests in service must vary by one or more for a slope per request
MAX_SLOPE_BUCKETS = 2000  # Theil-Sen is O(n^2): beyond this many buckets, a stride keeps a day of them cheap
RISKS_CEILING = 0.45  # risky settings alone are a risk, not a cause: below 0.5 whatever their number
FAR_OVER_LIMIT = 1.5  # projected memory at 1.5x the limit or more adds confidence
NEAR_LIMIT = 0.9  # observed peak at >= 90 % of the limit corroborates the projection
UNBOUNDED_REACH = 4.0  # unbounded concurrency counts as "will exceed" when the limit falls within 4x the observed peak in flight


KV_DOMINATES = 1.0  # a KV cache reservation larger than the weights is the server's main memory cost


@dataclass
class KvCache:
    """What one server's context length reserves, and the arithmetic that says so."""

    n_ctx: int
    bytes: float
    formula: str
    weights: float | None


def kv_cache(s: dict[str, Any]) -> KvCache | None:
    """llama.cpp's KV cache for the configured ``n_ctx`` (None without the model's dimensions or a known cache type).

    Why from the settings and not from memory: the reservation is fixed when the context is created, so the
    settings give it exactly, for every server, whether or not it was sampled before it died.
    """
    n_ctx, n_layer = _num(s, "n_ctx"), _num(s, "n_layer")
    k_width, v_width = _num(s, "n_embd_k_gqa"), _num(s, "n_embd_v_gqa")
    if n_ctx == 0 and _num(s, "context_length"):
        n_ctx = _num(s, "context_length")  # 0 means the model's own context length
    widths = {
        "f32": 4.0,
        "f16": 2.0,
        "bf16": 2.0,
        "q8_0": 34 / 32,
        "q5_1": 24 / 32,
        "q5_0": 22 / 32,
        "q4_1": 20 / 32,
        "q4_0": 18 / 32,
    }
    k_bytes, v_bytes = widths.get(str(s.get("type_k", "f16"))), widths.get(str(s.get("type_v", "f16")))
    if not (n_ctx and n_layer and k_width and v_width and k_bytes and v_bytes):
        return None
    total = n_layer * n_ctx * (k_width * k_bytes + v_width * v_bytes)
    if k_width == v_width and k_bytes == v_bytes:
        formula = (
            f"KV cache {s.get('type_k', 'f16')} = 2 x {n_layer:.0f} layers x n_ctx {n_ctx:.0f} x {k_width:.0f} (KV width) "
            f"x {k_bytes:g} B = {format_bytes(total)}"
        )
    else:
        formula = (
            f"KV cache = {n_layer:.0f} layers x n_ctx {n_ctx:.0f} x ({k_width:.0f} x {k_bytes:g} B + {v_width:.0f} x "
            f"{v_bytes:g} B) = {format_bytes(total)}"
        )
    return KvCache(int(n_ctx), total, formula, _num(s, "weights_bytes"))


def _engine_kv(tl: Timeline, cgroup: str | None = None) -> list[tuple[int | None, KvCache]]:
    """Each engine server's KV reservation, from its latest configuration (one per pid).

    ``cgroup``: the group whose limit the reservations are weighed against -- only servers seen living in it (or
    below it), or named by the operator (``--pid``), count. The agent reads the configuration of every engine
    process it sees on the host; another job's server in another group does not draw on this group's limit, and
    a server never seen inside the group cannot be said to."""
    latest: dict[int | None, dict[str, Any]] = {}
    for cfg in tl.configs:
        if cfg.settings.get("engine"):
            latest[cfg.pid] = dict(cfg.settings)
    if cgroup is not None:
        inside = {t.pid for t in tl.processes.values() if in_cgroup(t.memory_cgroup, cgroup)} | watched(tl)[0]
        latest = {pid: s for pid, s in latest.items() if pid is None or pid in inside}
    return [(pid, kv) for pid, s in latest.items() if (kv := kv_cache(s)) is not None]


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
    if keep.sum() < MIN_BUCKETS_FOR_SLOPE or np.ptp(c.n_service[keep]) < MIN_LOAD_RANGE:
        return None
    n, y = c.n_service[keep], m[keep]
    if keep.sum() > MAX_SLOPE_BUCKETS:
        step = int(keep.sum() // MAX_SLOPE_BUCKETS) + 1
        n, y = n[::step], y[::step]
    res = numstats.theilslopes(y, n)
    if not (np.isfinite(res.slope) and res.low_slope > 0):  # the 95 % interval must exclude zero
        return None
    return Footprint(float(res.slope), float(res.intercept), mem[0], int(keep.sum()), float(c.n_service.max()))


@dataclass
class Projection:
    """The memory arithmetic of a configuration: what its full configured load needs against the limit."""

    limit: float | None
    limit_src: str
    fp: Footprint | None
    copies: int  # resident copies of the weights (workers with per-worker preload, else one)
    weights_total: float | None
    idle: float  # the footprint with no request in flight (weights included)
    kv_total: float = 0.0  # engine servers' KV cache reservations, part of ``idle`` (none measured from requests)
    kv_servers: int = 0
    projected: float | None = None  # memory at full configured concurrency (or the idle footprint when that alone is over)
    reach: float | None = None  # in-flight requests at which an unbounded service hits the limit
    exceeds: bool = False


def _risky_settings(s: dict[str, Any], workers: int, preload: str) -> list[Issue]:
    """Each setting judged on its own, as a checklist: a major one can cause an incident, a minor one only worsens it.

    Why apart from the arithmetic: these hold whatever the load was, so they are reported even when the
    records are too thin to estimate memory per request.
    """
    issues: list[Issue] = []
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
    kv = kv_cache(s)
    if kv is not None and kv.weights and kv.bytes > KV_DOMINATES * kv.weights:
        issues.append(
            Issue(
                f"n_ctx {kv.n_ctx}: {kv.formula} per server, {kv.bytes / kv.weights:.1f} x the weights "
                f"({format_bytes(kv.weights)}), reserved whether or not any request uses that context",
                True,
            )
        )
    return issues


def _project(tl: Timeline, ac: AnalysisContext | None, s: dict[str, Any], workers: int, preload: str) -> Projection:
    """Weights plus workers x concurrency x memory per request, against the limit.

    Why the idle footprint first: when the weights alone do not fit, no load is needed to exceed the
    limit; with unbounded concurrency there is no "full load", so the answer is how many requests in
    flight reach the limit, judged against what the records saw.
    """
    limit, limit_src = _limit(tl, ac)
    fp = _footprint(tl, ac)
    weights = _num(s, "weights_bytes")
    copies = workers if preload == "per-worker" else 1
    weights_total = weights * copies if weights else None
    p = Projection(limit, limit_src, fp, copies, weights_total, idle=weights_total or 0.0)
    if fp is not None:
        # A shared mmap's weights are page cache, not anon: add them to an anon-based idle footprint.
        # Private per-worker copies are anon already, so the intercept includes them.
        shared_file = preload != "per-worker" and fp.source.endswith("stat.anon")
        p.idle = fp.idle + (weights_total or 0.0) if shared_file else max(fp.idle, weights_total or 0.0)
    else:
        # No footprint measured from requests: an engine's KV reservations are known from its settings alone,
        # anonymous memory each server holds from start-up, beside the weights (one shared mmap'd file).
        kv = _engine_kv(tl, service_context(tl, ac).cgroup)
        p.kv_total, p.kv_servers = sum(k.bytes for _, k in kv), len(kv)
        p.idle += p.kv_total
    conc = _num(s, "max_concurrency")
    if limit and p.idle >= limit:
        p.exceeds, p.projected = True, p.idle  # the idle footprint (weights) alone does not fit
    elif limit and fp is not None:
        if conc is not None:
            p.projected = p.idle + fp.per_request * workers * conc
            p.exceeds = p.projected > limit
        elif "max_concurrency" in s and s["max_concurrency"] is None:
            p.reach = (limit - p.idle) / fp.per_request
            p.exceeds = p.reach <= UNBOUNDED_REACH * max(fp.peak_in_flight, 1.0)
    return p


def _confidence(issues: list[Issue], p: Projection, corroborated: bool) -> float:
    """Risky settings alone stay below 0.5 (a risk, not a cause); the arithmetic exceeding the limit reaches it.

    ``corroborated``: memory came near the limit, or something was OOM-killed, in the window.
    """
    majors = sum(i.major for i in issues)
    conf = (0.25 + 0.05 * (majors - 1) if majors else 0.15) if issues else 0.0
    conf = min(conf, RISKS_CEILING)
    if p.exceeds:
        conf = 0.6
        conf += 0.1 if corroborated else 0.0
        conf += 0.1 if p.projected and p.limit and p.projected >= FAR_OVER_LIMIT * p.limit else 0.0
    return conf


def _evidence(
    s: dict[str, Any], workers: int, issues: list[Issue], p: Projection, mem: tuple[str, Series] | None, peak: float
) -> list[Evidence]:
    """The settings as configured, then the arithmetic's terms in the order it adds them up, then what was observed."""
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
    if p.weights_total:
        evidence.append(
            Evidence(f"model weights resident ({p.copies} cop{'y' if p.copies == 1 else 'ies'})", int(p.weights_total), "bytes")
        )
    if p.kv_total:
        evidence.append(Evidence(f"KV cache reserved by n_ctx ({p.kv_servers} server(s))", int(p.kv_total), "bytes"))
    if p.limit:
        evidence.append(Evidence(p.limit_src, int(p.limit), "bytes"))
    else:
        evidence.append(Evidence("memory limit", None, "bytes"))
    fp = p.fp
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
    if p.projected is not None:
        evidence.append(Evidence("projected memory at full configured concurrency", int(p.projected), "bytes"))
    if p.reach is not None:
        evidence.append(Evidence("requests in flight at which memory reaches the limit", round(p.reach, 1), "requests"))
    if np.isfinite(peak):
        evidence.append(Evidence(f"observed peak ({mem[0] if mem else ''})", int(peak), "bytes"))
    return evidence


def _headline(issues: list[Issue], p: Projection) -> str:
    """The one number that matters: what exceeds the limit and by how much, else how many settings are risky."""
    limit = p.limit
    if p.exceeds and p.projected is not None and limit and p.projected == p.idle and p.kv_total:
        return (
            f"the model weights and the KV cache n_ctx reserves ({format_bytes(p.idle)}, {format_bytes(p.kv_total)} of it "
            f"KV for {p.kv_servers} server(s)) alone exceed the {format_bytes(limit)} limit"
        )
    if p.exceeds and p.projected is not None and limit and p.projected == p.idle:
        return f"the idle footprint with the model weights ({p.idle / GIB:.2f} GiB) alone exceeds the {limit / GIB:.2f} GiB limit"
    if p.exceeds and p.projected and limit:
        return f"at full load memory reaches {p.projected / GIB:.2f} GiB against a {limit / GIB:.2f} GiB limit"
    if p.exceeds and p.reach is not None and limit:
        return f"with unbounded concurrency memory reaches the {limit / GIB:.2f} GiB limit at ~{p.reach:.0f} requests in flight"
    return f"{len(issues)} risky setting(s)"


@rule("config.unsafe", "unsafe_config", needs=("config",))
def unsafe_config(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """workers x concurrency x per-request memory vs the limit; unbounded queue/concurrency/prompts; no timeouts or guard."""
    if not tl.configs:
        return None
    cfg = tl.configs[-1]
    s = dict(cfg.settings)
    workers = int(_num(s, "workers") or 1)
    preload = str(s.get("preload") or "")
    issues = _risky_settings(s, workers, preload)
    p = _project(tl, ac, s, workers, preload)
    if not issues and not p.exceeds:
        return None

    mem = memory_series(tl, service_context(tl, ac))
    peak = float(np.nanmax(mem[1].values)) if mem is not None and len(mem[1]) else math.nan
    near = bool(p.limit and np.isfinite(peak) and peak >= NEAR_LIMIT * p.limit)
    conf = _confidence(issues, p, bool(near or tl.ooms or tl.cuda_ooms))
    rules_out = [] if p.exceeds else ["the arithmetic does not put full load over the limit: a risk, not a cause"]
    if p.fp is None:
        rules_out.append(
            "per-request memory could not be estimated from the records (too little load variation or no memory series)"
        )
    remediation = [
        "size workers x max_concurrency x per-request memory (+ weights) to fit under the memory limit with headroom",
        "bound concurrency and the queue, with queue and request timeouts, and reject the excess with 429 + Retry-After",
        "add a memory guard (503 when memory or PSI is high) and cap prompt tokens",
    ]
    kv = kv_cache(s)
    if kv is not None and ((kv.weights and kv.bytes > KV_DOMINATES * kv.weights) or (p.exceeds and p.kv_total)):
        remediation.insert(
            0,
            "set n_ctx to the longest context the requests need (or quantise the KV cache to q8_0, about half the bytes: "
            "llama-cpp-python --type_k 8, --type_v 8 with flash attention): "
            "the KV cache is reserved for all of it in every server at start-up",
        )
    if preload == "per-worker" and workers > 1:
        remediation.append("load the model once and share it (preload before forking, or mmap one file) instead of per worker")
    return Finding(
        cls="unsafe_config",
        rule="config.unsafe",
        confidence=conf,
        summary=f"Configuration of {cfg.service or 'the service'}: {_headline(issues, p)}"
        + (f"; {'; '.join(i.text for i in issues[:3])}" if issues else ""),
        evidence=_evidence(s, workers, issues, p, mem, peak),
        rules_out=rules_out,
        remediation=remediation,
        start=tl.start,
        end=tl.end,
    )
