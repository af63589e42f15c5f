"""Queue backlog vs thrashing: is latency waiting for a slot, or is each request itself slowing down?

The two look alike on an end-to-end latency chart and need opposite fixes (queueing theory: W = W_q + S):

- **queue backlog** (under-provisioned): queue wait W_q rises with load while the service time S
  (``inference_s``) stays flat; throughput rises then plateaus; memory stall signals stay quiet.
  Fix: bounded concurrency with a small queue and backpressure, scale out.
- **thrashing**: S itself inflates with concurrency, with a heavy tail; throughput *falls* as
  concurrency grows (USL kappa > 0); memory PSI and major faults / refaults rise. Fix: *lower*
  concurrency, guard memory, shrink the working set.

Both rules share one pass over the request table (``analyse_requests``): per request, the number of
requests in the system at its arrival (the load it met); low-load and high-load quartiles by that
number give the baseline and the loaded service time and queue wait; a time split (first fifth vs
the worst fifth) catches a service that slows over time at constant load. Memory-stall signals are
compared between the loaded/slow buckets and the calm ones (``memory_stall``), preferring the
service's own cgroup and processes over the host, so a neighbour's pressure is not read as ours.

Service helpers (``service_context``, ``memory_series``, ``excerpt``) live here too and are used by
the other request-family modules (loader, batching, config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from diag.rules import numstats
from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext, shared
from diag.rules.stats import edge_level, service_scope, stall_percent
from diag.rules.stats import excerpt as stats_excerpt
from diag.rules.usl import LoadCurve, UslFit, concurrency_levels, count_at, covered_time, fit_usl, load_curve
from diag.timeline import Series, Timeline

MIN_REQUESTS = 30  # started requests; below this a quartile is a handful of requests and medians are noise

# Service time "flat" vs "inflated", relative to its low-load baseline (diagnosis.md §4 table: flat < +20 %).
S_FLAT = 1.2
S_INFLATED = 1.5
# Queue wait counts as risen when the loaded median is at least this long (absolute and relative to S),
# and several times the calm median: a backlog of 20 ms in front of a 2 s service is not an incident.
W_MIN_S = 0.05
W_MIN_VS_S = 0.5
W_RISE = 4.0

# Short windows: the backlog is decided on per-request evidence when it is overwhelming -- at least
# MIN_REQUESTS started requests, OVERWHELM_SHARE of them waiting OVERWHELM_FACTOR x their own inference time,
# and someone waiting at every moment (gaps up to OVERWHELM_GAP_S).
OVERWHELM_FACTOR = 3.0
OVERWHELM_SHARE = 0.8
OVERWHELM_GAP_S = 0.01
OVERWHELM_COVER = 0.9  # the unbroken waiting stretch must cover 90 % of first arrival .. last start

# Memory-stall thresholds for *diagnosis* (not killing), a lower tier than the killers use (systemd-oomd
# acts at full avg10 > 60 % for 30 s): memory some avg10 > 10 % = pressure and full avg10 > 5 % =
# thrashing candidate. Counter rates must be both
# above a floor (a healthy warm service takes ~0 major faults/s) and several times the calm level.
PSI_SOME_UP = 10.0  # percent
PSI_FULL_UP = 5.0  # percent
FAULTS_UP = 50.0  # major faults per second
REFAULTS_UP = 200.0  # pages refaulted per second
SWAP_UP = 100.0  # pages swapped in+out per second
RATE_FACTOR = 3.0
NO_STALL_CAP = 0.2  # thrashing without a memory stall stays below the suspect level (0.3): it is not thrashing
RATE_ALWAYS = 10.0  # a rate at 10x its floor is a stall even when the whole recording was already stalling

# What ``thrashing`` can stand on: any one memory-stall signal, host-wide or per cgroup or per process.
STALL_SIGNALS: tuple[str, ...] = (
    "cgroup:psi.memory.some.avg10",
    "cgroup:psi.memory.full.avg10",
    "cgroup:stat.pgmajfault",
    "cgroup:stat.workingset_refault_file",
    "cgroup:stat.workingset_refault_anon",
    "process:major_faults",
    "host:psi.memory.some.avg10",
    "host:psi.memory.full.avg10",
    "host:vmstat.pgmajfault",
    "host:vmstat.workingset_refault_file",
    "host:vmstat.workingset_refault_anon",
    "host:vmstat.workingset_refault",
    "host:vmstat.pswpin",
)


# --------------------------------------------------------------------------- the service


@dataclass
class ServiceContext:
    """Which processes and which cgroup serve the requests -- so stall and memory are *ours*, not the host's."""

    pids: set[int] = field(default_factory=set)
    cgroup: str | None = None
    how: str = ""  # how the cgroup was identified (for evidence)


def service_context(tl: Timeline, ac: AnalysisContext | None = None) -> ServiceContext:
    """The service as every rule family scopes it (``stats.service_scope``: the pids named by the service's
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


def excerpt(ts: np.ndarray, values: np.ndarray, points: int = 50) -> list[list[float]]:
    """At most ``points`` [ts, value] pairs for a report chart: ``stats.excerpt`` for two bare arrays."""
    ts, values = np.asarray(ts, dtype=np.float64), np.asarray(values, dtype=np.float64)
    keep = np.isfinite(ts) & np.isfinite(values)
    return stats_excerpt(Series(ts[keep], values[keep]), points)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


# --------------------------------------------------------------------------- one pass over the requests


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
        if self.fit is not None and self.fit.retrograde and self.x_top < 0.9 * self.x_peak:
            return True
        return self.n_top > self.n_at_peak and self.x_top < 0.8 * self.x_peak

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


def _median(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else math.nan


def _kendall(x: np.ndarray, y: np.ndarray) -> float:
    if x.size > 20000:  # O(n log^2 n) anyway, but a stride keeps a million rows well under a second
        step = x.size // 20000 + 1
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
    origin = float(np.min(arrival[valid]))
    load = count_at(arrival[started] - origin, arrival[valid] - origin, finish[valid] - origin)
    s = req["inference_s"][started]
    w = req["queue_wait_s"][started]
    arr = arrival[started]
    q = max(5, n // 4)
    order = np.lexsort((arr, load))  # by load met, ties by time
    low, high = order[:q], order[-q:]
    by_start = np.argsort(start[started], kind="stable")
    fifths = [s[part] for part in np.array_split(by_start, 5)]
    medians = [_median(f) for f in fifths]
    curve = load_curve(req, tl.start, tl.end)
    fit = None
    x_peak = x_top = n_at_peak = n_top = math.nan
    loaded_share = math.nan
    little_l = little_lw = math.nan
    if curve is not None and len(curve) >= 2:
        active = curve.n_system > 0.05
        fit = fit_usl(curve.n_service[active], curve.throughput[active])
        lv, lx, _ = concurrency_levels(curve.n_service[active], curve.throughput[active], min_buckets=2)
        if lv.size < 2:
            lv, lx, _ = concurrency_levels(curve.n_service[active], curve.throughput[active], min_buckets=1)
        if lv.size:
            i_peak = int(np.argmax(lx))
            x_peak, n_at_peak = float(lx[i_peak]), float(lv[i_peak])
            x_top, n_top = float(lx[-1]), float(lv[-1])
        if active.sum() >= 4:
            busy = curve.n_system[active] >= np.quantile(curve.n_system[active], 0.75)
            p90 = float(np.quantile(curve.throughput[active], 0.9))
            loaded_share = float(np.mean(curve.throughput[active][busy]) / p90) if p90 > 0 else math.nan
        span = float(curve.edges[-1] - curve.edges[0])
        little_l = float(np.mean(curve.n_system))
        little_lw = float(valid.sum() / span * np.mean(finish[valid] - arrival[valid])) if span > 0 else math.nan
    outcomes: dict[str, int] = {}
    if "outcome" in req:
        values, counts = np.unique(req["outcome"].astype(str), return_counts=True)
        outcomes = {str(v): int(c) for v, c in zip(values, counts, strict=True)}
    s_high_vals = s[high]
    return RequestLoad(
        started=n,
        total=int(valid.sum()),
        t_first=origin,
        t_last=float(np.max(finish[valid])),
        load_low=_median(load[low]),
        load_high=_median(load[high]),
        s_base=_median(s[low]),
        s_high=_median(s_high_vals),
        s_high_p99=float(np.quantile(s_high_vals[np.isfinite(s_high_vals)], 0.99))
        if np.isfinite(s_high_vals).any()
        else math.nan,
        s_early=medians[0],
        s_worst=float(np.nanmax(medians)),
        w_low=_median(w[low]),
        w_high=_median(w[high]),
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


# --------------------------------------------------------------------------- memory stall


@dataclass
class StallSignal:
    """One memory-stall signal compared between the loaded/slow buckets and the calm ones."""

    scope: str  # "cgroup <path>", "serving processes", "host"
    name: str
    unit: str
    hi: float
    lo: float
    up: bool
    service: bool  # the service's own cgroup/processes (vs host-wide)
    series: Series

    def label(self) -> str:
        return f"{self.scope} {self.name}"


def _rate_sum(series: list[Series]) -> Series | None:
    """Per-second rate of the sum of cumulative counters (each differenced on its own, then summed on a grid)."""
    rates = [s.rate().valid() for s in series]
    rates = [r for r in rates if len(r)]
    if not rates:
        return None
    if len(rates) == 1:
        return rates[0]
    grid = np.unique(np.concatenate([r.ts for r in rates]))
    total = np.zeros(grid.size)
    for r in rates:
        total += np.interp(grid, r.ts, r.values)
    return Series(grid, total)


def stall_candidates(tl: Timeline, ctx: ServiceContext) -> list[tuple[str, str, str, str, Series, bool]]:
    """(scope, name, unit, kind, series, is_service) for every stall signal present."""
    out: list[tuple[str, str, str, str, Series, bool]] = []

    def add_group(scope: str, get: dict[str, Series], prefix: str, service: bool) -> None:
        for kind, line in (("psi_some", "psi.memory.some"), ("psi_full", "psi.memory.full")):
            s = stall_percent(get, line)  # exact from total_s where sampled, else avg10
            if len(s) >= 2:
                out.append((scope, f"{line} stall", "%", kind, s, service))
        faults = get.get(f"{prefix}pgmajfault")
        if faults is not None:
            r = _rate_sum([faults])
            if r is not None:
                out.append((scope, f"{prefix}pgmajfault rate", "faults/s", "faults", r, service))
        refault_keys = [f"{prefix}workingset_refault_file", f"{prefix}workingset_refault_anon"]
        refaults = [get[k] for k in refault_keys if k in get] or [get[k] for k in (f"{prefix}workingset_refault",) if k in get]
        r = _rate_sum(refaults)
        if r is not None:
            out.append((scope, f"{prefix}workingset_refault rate", "pages/s", "refaults", r, service))
        swaps = [get[k] for k in (f"{prefix}pswpin", f"{prefix}pswpout") if k in get]
        r = _rate_sum(swaps)
        if r is not None:
            out.append((scope, f"{prefix}pswpin+pswpout rate", "pages/s", "swap", r, service))

    if ctx.cgroup is not None:
        add_group(f"cgroup {ctx.cgroup}", tl.cgroups.get(ctx.cgroup, {}), "stat.", True)
    else:
        for path, group in tl.cgroups.items():  # service not identified: these are context, not ours
            add_group(f"cgroup {path} (not known to be the service's)", group, "stat.", False)
    procs = [t.series["major_faults"] for t in tl.processes.values() if t.pid in ctx.pids and "major_faults" in t.series]
    r = _rate_sum(procs)
    if r is not None:
        out.append(("serving processes", "major fault rate", "faults/s", "faults", r, True))
    add_group("host", tl.host, "vmstat.", False)
    return out


def _threshold(kind: str) -> float:
    return {"psi_some": PSI_SOME_UP, "psi_full": PSI_FULL_UP, "faults": FAULTS_UP, "refaults": REFAULTS_UP, "swap": SWAP_UP}[kind]


def memory_stall(tl: Timeline, ctx: ServiceContext, load: RequestLoad | None) -> list[StallSignal]:
    """Each stall signal's level in the loaded/slow buckets (``hi``) vs the calm reference (``lo``).

    ``hi`` is the larger of the medians over the top-quartile buckets by requests in system and by
    mean service time (a service can slow at constant load); ``lo`` is the smallest of the
    bottom-quartile medians, the signal's own 10th percentile over the timeline and the median of its
    first 15 % (the calm before the incident, when the recording has it -- in a squeezed cgroup the
    loaded and the "calm" buckets may both be stalling). PSI is "up" on its absolute level; counter
    rates must also be ``RATE_FACTOR`` times the calm level, unless they reach ``RATE_ALWAYS`` times their floor.
    """
    out = []
    curve = load.curve if load is not None else None
    masks: list[tuple[np.ndarray, np.ndarray]] = []
    if curve is not None and len(curve) >= 8:
        for key in (curve.n_system, curve.s_mean):
            fin = np.isfinite(key)
            if fin.sum() >= 8 and np.ptp(key[fin]) > 0:
                q25, q75 = np.quantile(key[fin], [0.25, 0.75])
                masks.append((fin & (key >= q75), fin & (key <= q25)))
    for scope, name, unit, kind, series, service in stall_candidates(tl, ctx):
        his, los = [], []
        if masks and curve is not None:
            at = np.interp(curve.centers, series.ts, series.values, left=np.nan, right=np.nan)
            for hi_mask, lo_mask in masks:
                h, lo_ = at[hi_mask], at[lo_mask]
                if np.isfinite(h).sum() >= 2:
                    his.append(float(np.nanmedian(h)))
                if np.isfinite(lo_).sum() >= 2:
                    los.append(float(np.nanmedian(lo_)))
        window = series.window(tl.start, tl.end).valid()
        vals = window.values if len(window) else series.values
        if not his:
            his.append(float(np.quantile(vals, 0.9)))
        los.append(float(np.quantile(vals, 0.1)))
        los.append(edge_level(window if len(window) else series, "first"))  # the calm before the incident, if recorded
        hi, lo = max(his), min(los)
        threshold = _threshold(kind)
        if kind.startswith("psi"):
            up = hi >= threshold
        else:  # several times the calm level -- or so high that no calm level excuses it
            up = hi >= max(threshold, RATE_FACTOR * lo) or hi >= RATE_ALWAYS * threshold
        out.append(StallSignal(scope, name, unit, hi, lo, bool(up), service, series))
    return out


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
        excerpt(c.centers, c.n_system),
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
            f"(median wait {ms(ov.wait_median)} vs {ms(ov.inference_median)} inference) and the queue never emptied "
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
    w_rose = load.w_high >= max(W_MIN_S, W_MIN_VS_S * load.s_base) and load.w_high >= W_RISE * load.w_low + 0.02
    if not w_rose:
        return overwhelming_backlog(tl, ac)  # a short, uniformly overloaded window has no calm quartile to compare
    infl = load.s_inflation
    ctx = service_context(tl, ac)
    stall = memory_stall(tl, ctx, load)
    # Judge the service's own stall signals when it has them: host-wide stalls while the service's cgroup
    # stays calm are a neighbour's (placement.noisy_neighbour), not evidence against a backlog here.
    own = [s for s in stall if s.service]
    stall = own or stall
    stalled = [s for s in stall if s.up]
    loader_share = _loader_wait_share(tl)
    conf = 0.45
    conf += 0.2 if infl < S_FLAT else (0.1 if infl < S_INFLATED else (-0.2 if infl >= 2 else 0.0))
    if stall:
        conf += -0.25 if stalled else 0.1
    plateau = np.isfinite(load.x_loaded_share) and load.x_loaded_share >= 0.8 and not load.retrograde
    if plateau:
        conf += 0.1
    if load.retrograde:
        conf -= 0.1
    shed = sum(load.outcomes.get(k, 0) for k in ("rejected", "queue_timeout"))
    if shed >= max(1, 0.01 * load.total):
        conf += 0.05
    if loader_share is not None and loader_share >= 0.6:
        conf = min(conf, 0.4)  # the wait *is* the loader: more capacity would not remove it
    elif loader_share is not None and loader_share >= 0.3:
        conf -= 0.15
    evidence = [
        Evidence("median queue wait, high-load quartile", round(load.w_high, 4), "s", load.high_start, load.high_end),
        Evidence("median queue wait, low-load quartile", round(load.w_low, 4), "s"),
        Evidence("p95 queue wait, high-load quartile", round(load.w_high_p95, 4), "s", load.high_start, load.high_end),
        Evidence("median inference time, low-load quartile (baseline)", round(load.s_base, 4), "s"),
        Evidence("median inference time, high-load quartile", round(load.s_high, 4), "s", load.high_start, load.high_end),
        Evidence("inference time inflation (worst of by-load and by-time)", round(infl, 2), "x"),
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
            f"not thrashing: inference time flat at {ms(load.s_high)} ({infl:.2f}x its baseline {ms(load.s_base)}) "
            f"while queue wait rose to {ms(load.w_high)}"
        )
    if stall and not stalled:
        rules_out.append(f"no memory stall: {_stall_summary(stall)} at the busiest times")
    elif stalled:
        rules_out.append(f"memory does stall ({_stall_summary(stalled)}): thrashing may be part of this")
    elif not stall:
        rules_out.append("memory stall not evaluated (no PSI / fault / refault signals recorded)")
    if loader_share is not None:
        rules_out.append(
            f"{'not' if loader_share < 0.3 else 'partly'} a blocking loader: on-path loads cover "
            f"{loader_share:.0%} of the queue wait"
        )
    if np.isfinite(load.little_error) and load.little_error > 0.2:
        rules_out.append(f"telemetry inconsistent: Little's law off by {load.little_error:.0%} (dropped or truncated records?)")
    return Finding(
        cls="queue_backlog",
        rule="requests.queue_backlog",
        confidence=conf,
        summary=(
            f"Requests wait {ms(load.w_high)} for a slot at high load (vs {ms(load.w_low)} at low load) while inference "
            + (
                f"stays at {ms(load.s_high)} ({infl:.2f}x baseline): too little capacity, not a slower service"
                if infl < S_INFLATED
                else f"also slowed {infl:.1f}x to {ms(load.s_high)}: the queue is at least partly a symptom"
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


def _thrash_evidence(load: RequestLoad, stall: list[StallSignal], tail: float) -> list[Evidence]:
    """The numbers behind a thrashing finding: inference inflation, goodput vs concurrency, the USL fit, the stalls."""
    infl = load.s_inflation
    evidence = [
        Evidence("median inference time, low-load quartile (baseline)", round(load.s_base, 4), "s"),
        Evidence("median inference time, high-load quartile", round(load.s_high, 4), "s", load.high_start, load.high_end),
        Evidence("median inference time, first fifth vs worst fifth by time", f"{load.s_early:.4g} vs {load.s_worst:.4g}", "s"),
        Evidence("inference time inflation (worst of by-load and by-time)", round(infl, 2), "x"),
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
                excerpt(s.series.ts, s.series.values),
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
    stall = memory_stall(tl, ctx, load)
    service_up = [s for s in stall if s.up and s.service]
    host_up = [s for s in stall if s.up and not s.service]
    service_seen = any(s.service for s in stall)
    neighbour = bool(host_up) and service_seen and not service_up
    stall_ok = bool(service_up) or (bool(host_up) and not service_seen)
    conf = 0.0
    if infl >= S_INFLATED:
        conf += 0.3 + (0.1 if infl >= 3 else 0.0)
    if load.tau_s >= 0.2:
        conf += 0.05
    if stall_ok:
        conf += 0.3
    if load.retrograde:
        conf += 0.15
    tail = load.s_high_p99 / load.s_high if load.s_high > 0 else math.nan
    if np.isfinite(tail) and tail >= 3:
        conf += 0.05
    if not stall_ok:  # a slowdown without any memory stall is CPU or batch contention: a note, not a suspect
        conf = min(conf, NO_STALL_CAP)
    if infl < S_INFLATED:
        conf = min(conf, 0.4)
    evidence = _thrash_evidence(load, stall, tail)
    rules_out = []
    if infl >= S_INFLATED:
        rules_out.append(
            f"not a plain queue backlog: inference time itself rose {infl:.1f}x "
            f"({ms(load.s_base)} -> {ms(max(load.s_high, load.s_worst))})"
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
            f"Each request slows as concurrency grows: inference {ms(load.s_base)} -> {ms(max(load.s_high, load.s_worst))} "
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
