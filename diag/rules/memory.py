"""Memory family: is the service leaking, or under ordinary (load-driven) pressure?

The question that separates them (ARCHITECTURE.md): does memory return to baseline when load
falls, or climb regardless of load? Both rules look at the same *candidates* and share one
assessment per candidate (``assess``, computed once per timeline): the service cgroups' working
set (else usage, else anon) decides when a service cgroup is watched -- it holds every process and
carries the limit -- and each serving process's RSS is assessed only to name the one that grows;
without a watched cgroup the processes themselves decide.

- **troughs**: the minimum of each ~5-sample window (at least 8, at most 48 windows), so the
  per-request sawtooth and GC cycles do not count as growth;
- **trend**: Mann-Kendall with the Hamed-Rao autocorrelation correction on the troughs (its factor
  also estimated from the dense series, see ``stats.dense_correction``), Bonferroni over the
  deciding candidates, p < 0.01 (a 1 % false alarm per analysis; on seeded autocorrelated series
  without a trend it fires about half that often, see ``stats``), and a positive Theil-Sen slope;
- **material**: at least 5 % of the limit per hour (at that rate a service at half its limit
  reaches it within ten hours -- inside one working day; the limit is the cgroup's, else the host's
  MemTotal) AND a rise over the recording of at least 5 % of the level or 1 % of the limit -- so an
  interpreter settling by 2 MiB is not a leak;
- **not warm-up**: no ramp-then-plateau (``stats.plateau_after_change``) and no single step that
  makes up more than 60 % of the rise (a cache filled once is not a climb);
- **not load**: when requests exist, the load in service (tokens, else requests) is averaged over
  the same windows; if load itself rose significantly, the troughs are regressed on it and the
  leak must persist in the residuals (at least half the slope, still significant);
- **not page cache**: a group's working set (usage minus *inactive* file pages) also counts the file
  pages the kernel moved to the active list -- a checkpoint read again and again under pressure climbs
  there and stays while nothing evicts it, yet the kernel reclaims it at will. When the group's anon
  and shmem (what it cannot reclaim without swap) are sampled, their troughs must carry at least half
  the working set's climb.

Scenario recordings are short (≤ 90 s), so nothing here asks for hours: 20 samples over 30 s is
the minimum, and every finding says how much data it rests on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from diag.rules import levels, numstats, stats
from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext, shared
from diag.rules.stall_signals import FAULTS_UP, PSI_FULL_UP, PSI_SOME_UP
from diag.rules.stats import EngineLoad, LoadIndex, Scope, Trend
from diag.timeline import Series, Timeline
from diag.units import format_bytes

MIB = float(1 << 20)
P_LEAK = 0.01  # Mann-Kendall (Hamed-Rao) p after Bonferroni over candidates
P_LOAD_RISING = 0.05
MATERIAL_RATE_OF_LIMIT_PER_H = 0.05  # growth >= 5 %/h of the limit: from half full to the limit in ten hours
MATERIAL_RISE_OF_LEVEL = 0.05
MATERIAL_RISE_OF_LIMIT = 0.01
MAX_STEP_SHARE = 0.6
LOAD_EDGE_SHARE = 0.15  # load at the start / end of the recording: the mean of the first / last 15 % of the windows
MIN_REGRESSION_POINTS = 4  # troughs paired with a window load: fewer cannot regress memory on load
RESIDUAL_SLOPE_SHARE = 0.5  # after regressing on load, the climb must keep at least half its slope
UNRECLAIMABLE_SLOPE_SHARE = 0.5  # anon + shmem troughs must climb at least half as fast as the working set's
P_LEAK_STRONG = 1e-3  # a trend this significant adds confidence
BIG_RISE_OF_LIMIT = 0.1  # a rise of 10 % of the limit over the recording ...
SOON_S = 86_400.0  # ... or the limit reached within a day at this rate: a leak that matters now
MANY_TROUGHS = 12  # troughs enough that the trend rests on more than the minimum
UNSCOPED_CEILING = 0.6  # a leak in a process not known to be the service: firm only about that process
CGROUP_SERIES = ("working_set", "usage", "stat.anon")
PROCESS_SERIES = ("rss", "uss", "pss")  # RSS first: it is fresh every sample, USS/PSS only every few seconds
PROCESS_MIN_SHARE = 0.10  # process candidates: at least 10 % of the biggest serving process
MAX_PROCESS_CANDIDATES = 8

# memory_pressure: the stall levels are every stall-reading rule's (``stall_signals``: PSI some >= 10 % is
# pressure; full >= 5 % with major faults >= 50/s is thrashing level); how near the limit counts is this rule's.
NEAR_LIMIT = levels.NEAR_LIMIT  # shared with the memory-pressure cause alert
LIMIT_EVENTS_NEAR = levels.LIMIT_EVENTS_NEAR
FOLLOWS_LOAD_RHO = 0.5
STATIC_RHO = 0.3
MIN_FOLLOW_SAMPLES = 5  # memory samples to correlate with load (and anon samples to prefer it over the working set)
MAJFAULT_PERCENTILE = 90  # major faults "pour in" when the 90th percentile of their rate reaches the floor
THRASHING_CEILING = 0.45  # stalls at thrashing level in pressure's own view: a suspect at most


@dataclass
class Candidate:
    label: str  # "cgroup /svc working_set", "process 1234 (python) rss"
    series: Series  # valid samples only
    limit: float | None
    limit_source: str
    cgroup: str | None
    scoped: bool  # belongs to the identified service (else: an unattributed big process)
    # A group's working set or usage: its anon + shmem, the part the kernel cannot reclaim without swap (None when
    # not sampled, or when the candidate is anon itself).
    unreclaimable: Series | None = None


@dataclass
class LoadCheck:
    name: str = ""
    observed: bool = False
    start: float = math.nan  # window-mean load, first / last 15 %
    end: float = math.nan
    trend: Trend | None = None
    rising: bool = False
    rho: float = math.nan  # Spearman of memory samples vs load at the same instants
    follows: bool = False  # rho >= FOLLOWS_LOAD_RHO: memory tracks the load, so the climb is regressed on it
    residual: Trend | None = None
    explains: bool = False


@dataclass
class Assessment:
    cand: Candidate
    troughs: Series
    trend: Trend | None
    p_adj: float = 1.0
    span_s: float = 0.0
    level: float = math.nan
    current: float = math.nan
    rise: float = 0.0  # slope x span
    material: bool = False
    plateau: stats.Plateau | None = None
    step_share: float = 1.0
    load: LoadCheck = field(default_factory=LoadCheck)
    leak: bool = False
    why_not: list[str] = field(default_factory=list)

    @property
    def slope(self) -> float:
        return self.trend.slope if self.trend else 0.0


def candidates(timeline: Timeline, scope: Scope) -> tuple[list[Candidate], list[Candidate]]:
    """(cgroup candidates, process candidates) with enough data for a trend test.

    When the service's cgroup is watched it *is* the service's memory (it holds every process and
    carries the limit): the verdict rests on it and the processes only say which one grows. Without
    a cgroup the processes are the candidates themselves.
    """
    groups: list[Candidate] = []
    for group in scope.cgroups:
        found = stats.first_present(timeline.cgroups[group], CGROUP_SERIES)
        if found:
            name, series = found
            limit, source = stats.limit_for(timeline, group)
            kept = _unreclaimable(timeline.cgroups[group]) if name != "stat.anon" else None
            groups.append(Candidate(f"cgroup {group} {name}", series, limit, source, group, True, kept))
    tracks = scope.tracks if scope.known else list(timeline.processes.values())
    found_tracks = [(t, f) for t in tracks if (f := stats.first_present(t.series, PROCESS_SERIES))]
    # Small processes (a supervisor, a sidecar) cannot carry a material leak of the service; testing them
    # only costs the real candidates power through the Bonferroni correction.
    sizes = [float(numstats.median(f[1].values)) for _, f in found_tracks]
    floor = PROCESS_MIN_SHARE * max(sizes) if sizes else 0.0
    ranked = sorted(zip(found_tracks, sizes, strict=True), key=lambda x: -x[1])[:MAX_PROCESS_CANDIDATES]
    procs: list[Candidate] = []
    for (track, found), size in ranked:
        if size >= floor:
            name, series = found
            group = stats.track_cgroup(timeline, track)
            limit, source = stats.limit_for(timeline, group if group in timeline.cgroups else None)
            label = f"process {track.pid} ({track.comm or '?'}) {name}"
            procs.append(Candidate(label, series, limit, source, group, scope.known))
    return groups, procs


def _unreclaimable(series: dict[str, Series]) -> Series | None:
    """A group's anon + shmem per sample (shmem counted as 0 where the kernel does not report it), or None."""
    anon = series.get("stat.anon")
    if anon is None or not stats.enough_data(anon):
        return None
    anon = anon.valid()
    shmem = series.get("stat.shmem")
    if shmem is None or not len(shmem.valid()):
        return anon
    sh = shmem.valid()
    extra = np.zeros(anon.ts.size)
    idx = np.searchsorted(sh.ts, anon.ts)
    hit = (idx < sh.ts.size) & (sh.ts[np.minimum(idx, sh.ts.size - 1)] == anon.ts)
    extra[hit] = sh.values[idx[hit]]
    return Series(anon.ts, anon.values + extra)


def _page_cache_climb(cand: Candidate, slope: float) -> str | None:
    """Why a climbing working set is page cache, not a leak -- or None when anon + shmem carry the climb (or are
    not sampled)."""
    if cand.unreclaimable is None:
        return None
    _, kept = stats.trough_trend(cand.unreclaimable)
    kept_slope = kept.slope if kept is not None else 0.0
    if kept_slope >= UNRECLAIMABLE_SLOPE_SHARE * slope:
        return None
    return (
        f"page cache, not a leak: anon + shmem troughs climb {_rate(max(kept_slope, 0.0))} of the working set's "
        f"{_rate(slope)} -- the rest is file pages the kernel can reclaim"
    )


def _load_check(
    cand: Candidate, tr: Series, raw_slope: float, edges: np.ndarray, load: LoadIndex | EngineLoad | None
) -> LoadCheck:
    """Did load rise with memory, and does the climb survive regressing the troughs on it?"""
    s = cand.series
    if load is None or not load.covers(float(s.ts[0]), float(s.ts[-1])):
        return LoadCheck()
    name, per_sample = load.load(s.ts)
    check = LoadCheck(name=name, observed=True)
    check.rho = stats.spearman(s.values, per_sample)
    wl = stats.window_means(Series(s.ts, per_sample), edges)
    wl_ts = 0.5 * (edges[:-1] + edges[1:])
    keep = np.isfinite(wl)
    k = max(2, int(LOAD_EDGE_SHARE * keep.sum()))
    check.start, check.end = float(np.mean(wl[keep][:k])), float(np.mean(wl[keep][-k:]))
    check.trend = stats.trend(wl_ts[keep], wl[keep])
    check.rising = bool(check.trend and check.trend.p < P_LOAD_RISING and check.trend.slope > 0)
    # Memory that tracks the load sample by sample may owe its climb to it even when the window loads are no
    # significant trend: a queue that builds in one step (flat, then dozens waiting) is one change point, which the
    # autocorrelation correction rightly refuses to call a trend -- yet it is the load the memory rose with.
    check.follows = math.isfinite(check.rho) and check.rho >= FOLLOWS_LOAD_RHO
    if check.rising or check.follows:
        # troughs are stamped at window centres, as are the window loads: pair them by centre
        lookup = dict(zip(np.round(wl_ts, 6), wl, strict=True))
        x = np.array([lookup.get(round(float(t), 6), np.nan) for t in tr.ts])
        ok = np.isfinite(x)
        if ok.sum() >= MIN_REGRESSION_POINTS and np.ptp(x[ok]) > 0:
            coef = np.polyfit(x[ok], tr.values[ok], 1)
            resid = tr.values[ok] - np.polyval(coef, x[ok])
            check.residual = stats.trend(tr.ts[ok], resid)
        res = check.residual
        persists = bool(res and res.p < P_LEAK and res.slope >= RESIDUAL_SLOPE_SHARE * max(raw_slope, 1e-12))
        check.explains = not persists
    return check


def assess(cand: Candidate, n_candidates: int, load: LoadIndex | EngineLoad | None) -> Assessment:
    """Everything both rules want to know about one candidate's troughs."""
    s = cand.series
    edges = stats.trough_edges(s)
    tr, tr_trend = stats.trough_trend(s)
    a = Assessment(cand, tr, tr_trend)
    a.current = float(s.values[-1])
    a.level = float(numstats.median(tr.values)) if len(tr) else math.nan
    a.span_s = float(tr.ts[-1] - tr.ts[0]) if len(tr) >= 2 else 0.0
    if a.trend is None:
        a.why_not.append("too few troughs for a trend test")
        return a
    a.p_adj = min(1.0, a.trend.p * max(1, n_candidates))
    a.rise = a.trend.slope * a.span_s
    a.load = _load_check(cand, tr, a.trend.slope, edges, load)
    significant = a.p_adj < P_LEAK and a.trend.slope > 0
    if not significant:
        a.why_not.append(f"troughs flat: Sen slope {_rate(a.trend.slope)}, p={a.p_adj:.2g}")
        return a
    per_h = a.trend.slope * 3600.0
    if cand.limit:
        a.material = per_h >= MATERIAL_RATE_OF_LIMIT_PER_H * cand.limit and (
            a.rise >= MATERIAL_RISE_OF_LEVEL * a.level or a.rise >= MATERIAL_RISE_OF_LIMIT * cand.limit
        )
    else:
        a.material = a.rise >= 2 * MATERIAL_RISE_OF_LEVEL * a.level
    if not a.material:
        a.why_not.append(f"growth too small to matter: {format_bytes(a.rise)} over {a.span_s:.0f} s ({_rate(a.trend.slope)})")
    a.plateau = stats.plateau_after_change(tr.ts, tr.values)
    if a.plateau:
        a.why_not.append(
            f"warm-up: growth stopped at {a.plateau.change_ts:.0f} and stayed flat for {a.plateau.tail_points} windows"
        )
    cache = _page_cache_climb(cand, a.trend.slope)
    if cache:
        a.why_not.append(cache)
    a.step_share = stats.largest_step_share(tr.values)
    if a.step_share > MAX_STEP_SHARE:
        a.why_not.append(f"one step, not a climb: {a.step_share:.0%} of the rise in a single window")
    if a.load.explains:
        a.why_not.append(
            f"explained by load: {a.load.name} rose {a.load.start:.3g} -> {a.load.end:.3g}"
            " and the slope vanishes after regressing on it"
        )
    a.leak = not a.why_not
    return a


@dataclass
class ServiceMemory:
    scope: Scope
    decisive: list[Assessment]  # what the verdict rests on: the service's cgroups, else its processes
    attribution: list[Candidate] | None = None  # the processes to assess when the cgroups decide (None: decisive)
    _processes: list[Assessment] | None = field(default=None, repr=False)

    @property
    def processes(self) -> list[Assessment]:
        """Per-process assessments (for attribution when the cgroups decide), made on first use.

        Why lazily: only a leak found in a cgroup asks which process grows, and assessing every
        process on every analysis was most of the live diagnosis's cost (``diag collect
        --diagnose-every``). ``assess`` is a pure function of the candidate, so the answer is the same.
        """
        if self._processes is None:
            procs = self.attribution
            self._processes = self.decisive if procs is None else [assess(c, 1, None) for c in procs]  # no load check
        return self._processes


def assess_service(timeline: Timeline, ac: AnalysisContext | None = None) -> ServiceMemory:
    """Assess every candidate once per analysis (both rules of this module ask; the answer is the same)."""
    return shared(ac, timeline, "memory.assess_service", lambda: _assess_service(timeline, ac))


def _assess_service(timeline: Timeline, ac: AnalysisContext | None) -> ServiceMemory:
    scope = stats.service_scope(timeline, ac)
    groups, procs = candidates(timeline, scope)
    load = stats.load_index(timeline)
    if groups:
        decisive = [assess(c, len(groups), load) for c in groups]
        return ServiceMemory(scope, decisive, procs)
    decisive = [assess(c, len(procs), load) for c in procs]
    return ServiceMemory(scope, decisive)


def _longest_memory_series(timeline: Timeline, scope: Scope) -> str:
    """What the service's longest memory series holds, in the terms the leak test needs (samples, span)."""
    found = [timeline.cgroups[g].get(k) for g in scope.cgroups for k in CGROUP_SERIES]
    tracks = scope.tracks if scope.known else list(timeline.processes.values())
    found += [t.series.get(k) for t in tracks for k in PROCESS_SERIES]
    spans = [(len(v), float(v.ts[-1] - v.ts[0])) for s in found if s is not None and len(v := s.valid()) >= 1]
    if not spans:
        return "no memory series of the service"
    n, span = max(spans, key=lambda x: (x[1], x[0]))
    return f"{n} memory samples over {span:.0f} s"


def _rate(slope_per_s: float) -> str:
    return f"{slope_per_s / MIB * 60:.2f} MiB/min"


def _leak_confidence(a: Assessment) -> float:
    conf = 0.6
    if a.p_adj < P_LEAK_STRONG:
        conf += 0.1
    if a.load.observed:
        conf += 0.1 if not a.load.rising else 0.05  # flat/falling load: the cleanest case
    else:
        conf -= 0.05
    if a.cand.limit and (a.rise >= BIG_RISE_OF_LIMIT * a.cand.limit or (a.cand.limit - a.current) / a.slope < SOON_S):
        conf += 0.05
    if len(a.troughs) >= MANY_TROUGHS:
        conf += 0.05
    if not a.cand.scoped:
        conf = min(conf, UNSCOPED_CEILING)
    return min(conf, 0.95)


@rule(
    "memory.leak",
    "memory_leak",
    needs_any=("cgroup:working_set", "cgroup:usage", "cgroup:stat.anon", "process:rss", "process:uss"),
)
def memory_leak(timeline: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Rising troughs of the service's memory, significant under autocorrelation, material, not load, not warm-up."""
    mem = assess_service(timeline, ac)
    scope = mem.scope
    if not mem.decisive:  # memory was sampled, but no series is long enough for a trend to mean anything
        return TooLittleData(
            _longest_memory_series(timeline, scope),
            f"one memory series with {stats.MIN_SAMPLES} samples over {stats.MIN_SPAN_S:.0f} s",
        )
    leaks = [a for a in mem.decisive if a.leak]
    if not leaks:
        return None
    best = max(leaks, key=lambda a: (_leak_confidence(a), a.slope / (a.cand.limit or a.level or 1.0)))
    conf = _leak_confidence(best)
    tr, s = best.troughs, best.cand.series
    start, end = float(s.ts[0]), float(s.ts[-1])
    ev = [
        Evidence(f"trough slope of {best.cand.label} (Theil-Sen)", round(best.slope, 1), "bytes/s", start, end),
        Evidence("trough slope", round(best.slope * 60 / MIB, 3), "MiB/min", start, end),
        Evidence("Mann-Kendall p (Hamed-Rao, Bonferroni over candidates)", float(f"{best.p_adj:.3g}"), "", start, end),
        Evidence("rise of the troughs over the recording", round(best.rise), "bytes", float(tr.ts[0]), float(tr.ts[-1])),
        Evidence("troughs (minimum per window)", len(tr), "windows", start, end, stats.excerpt(tr)),
        Evidence("data behind the verdict", f"{len(s)} samples over {end - start:.0f} s", "", start, end),
    ]
    eta = None
    avail = timeline.host.get("memory.available")
    if best.cand.limit and best.cand.limit_source.startswith("cgroup"):
        eta = max(0.0, (best.cand.limit - best.current) / best.slope)
        ev.append(
            Evidence(f"time to the limit ({best.cand.limit_source}, {format_bytes(best.cand.limit)})", round(eta), "s", end, end)
        )
    elif avail is not None and len(avail.valid()):
        # no cgroup limit: the host runs out when MemAvailable is used up
        eta = max(0.0, avail.last() / best.slope)
        ev.append(Evidence(f"time to exhaust host MemAvailable ({format_bytes(avail.last())})", round(eta), "s", end, end))
    also = [a.cand.label for a in leaks if a is not best]
    if also:
        ev.append(Evidence("also climbing", ", ".join(also), "", start, end))
    growing = [a for a in mem.processes if a is not best and a.trend is not None and a.slope > 0 and a.p_adj < P_LEAK]
    culprit = max(growing, key=lambda a: a.slope) if growing else None
    if culprit is not None:
        share = culprit.slope / best.slope if best.slope > 0 else 0.0
        ev.append(
            Evidence(
                f"fastest-growing process: {culprit.cand.label}",
                round(culprit.slope * 60 / MIB, 3),
                "MiB/min",
                float(culprit.cand.series.ts[0]),
                float(culprit.cand.series.ts[-1]),
                stats.excerpt(culprit.troughs),
            )
        )
    rules_out = []
    if best.load.observed:
        ev.append(
            Evidence(
                f"{best.load.name}, window mean at start -> end", f"{best.load.start:.3g} -> {best.load.end:.3g}", "", start, end
            )
        )
        if not (best.load.rising or best.load.follows):
            rules_out.append(
                f"memory_pressure: memory does not return to baseline when load falls -- {best.load.name} "
                f"{best.load.start:.3g} -> {best.load.end:.3g} (flat or falling) while the troughs rose {format_bytes(best.rise)}"
            )
        else:
            res = best.load.residual
            rules_out.append(
                f"memory_pressure: {'load rose too' if best.load.rising else 'memory tracks the load'}, but the climb "
                f"persists after regressing on {best.load.name} "
                f"(residual slope {_rate(res.slope if res else 0.0)}, p={res.p if res else 1.0:.2g})"
            )
    else:
        rules_out.append("memory_pressure: not checked against load -- no request records or engine load gauges in the window")
    rules_out.append(f"warm-up/cache fill: no ramp-then-plateau; largest single step {best.step_share:.0%} of the rise")
    where = best.cand.label if best.cand.scoped else f"{best.cand.label} (not identified as the service: {scope.identified_by})"
    summary = f"{where} climbs {_rate(best.slope)} regardless of load (p={best.p_adj:.2g})"
    if culprit is not None:
        summary += f"; {culprit.cand.label.rsplit(' ', 1)[0]} accounts for {min(share, 1.0):.0%} of it"
    if eta is not None:
        summary += f"; at this rate memory runs out in {eta / 60:.0f} min"
    return Finding(
        "memory_leak",
        "memory.leak",
        conf,
        summary,
        ev,
        rules_out,
        [
            "Restart the leaking process on a schedule or when it crosses a memory guard, as a stop-gap.",
            "Find what grows: compare two heap snapshots (tracemalloc, memray, torch.cuda.memory_snapshot) minutes apart.",
            "Look for per-request state kept past the request: unbounded caches, lists of past results, KV caches not freed.",
            "Set memory.high below the limit so the kernel reclaims and the alert fires before the OOM killer does.",
        ],
        start,
        end,
    )


# --------------------------------------------------------------------------- pressure


@dataclass
class _Pressure:
    where: str
    indicators: list[str]
    evidence: list[Evidence]
    mem: Series | None
    limit: float | None
    thrash: bool
    follow: Series | None = None  # the memory that should follow load: anon when known (page cache does not track requests)


def _cgroup_pressure(timeline: Timeline, group: str) -> _Pressure:
    cg = timeline.cgroups[group]
    ind: list[str] = []
    ev: list[Evidence] = []
    some = stats.stall_percent(cg, "psi.memory.some")
    full = stats.stall_percent(cg, "psi.memory.full")
    if len(some):
        hit, n = stats.sustained_above(some, PSI_SOME_UP)
        ev.append(
            Evidence(
                f"{group} memory PSI some, max",
                round(float(some.values.max()), 2),
                "%",
                float(some.ts[0]),
                float(some.ts[-1]),
                stats.excerpt(some),
            )
        )
        if hit:
            ind.append(f"memory PSI some >= {PSI_SOME_UP:.0f} % in {n} samples (max {float(some.values.max()):.1f} %)")
    mem_name, mem = next(((n, cg[n].valid()) for n in ("working_set", "usage") if n in cg and len(cg[n].valid())), ("", None))
    limit, _source = stats.limit_for(timeline, group)
    has_limit = stats.cgroup_limit(timeline, group) is not None
    if mem is not None and has_limit and limit:
        ratio = Series(mem.ts, mem.values / limit)
        hit, n = stats.sustained_above(ratio, NEAR_LIMIT)
        ev.append(
            Evidence(
                f"{group} {mem_name} / limit, max",
                round(float(ratio.values.max()), 3),
                "ratio",
                float(mem.ts[0]),
                float(mem.ts[-1]),
            )
        )
        if hit:
            ind.append(f"{mem_name} >= {NEAR_LIMIT:.0%} of the {format_bytes(limit)} limit in {n} samples")
    # Hitting the limit is routine for a group that streams files (page cache fills up to it, then is
    # reclaimed): count limit events only when the working set itself is close to the limit.
    close = mem is not None and has_limit and bool(limit) and float(mem.values.max()) >= LIMIT_EVENTS_NEAR * limit
    for key, what in (
        ("events.max", "limit hits (failcnt / memory.events max)"),
        ("events.high", "memory.high throttling events"),
    ):
        if key in cg and close:
            inc = cg[key].increase()
            if inc > 0:
                ind.append(f"{what} +{inc:.0f}")
                ev.append(Evidence(f"{group} {what}", inc, "events", float(cg[key].ts[0]), float(cg[key].ts[-1])))
    majflt = cg.get("stat.pgmajfault") or timeline.host.get("vmstat.pgmajfault")
    thrash = _thrashing(full, majflt)
    anon = cg.get("stat.anon")
    follow = anon.valid() if anon is not None and len(anon.valid()) >= MIN_FOLLOW_SAMPLES else mem
    return _Pressure(f"cgroup {group}", ind, ev, mem, limit if has_limit else None, thrash, follow)


def _host_pressure(timeline: Timeline) -> _Pressure | None:
    host = timeline.host
    total, avail = host.get("memory.total"), host.get("memory.available")
    ind: list[str] = []
    ev: list[Evidence] = []
    some = stats.stall_percent(host, "psi.memory.some")
    full = stats.stall_percent(host, "psi.memory.full")
    if len(some):
        hit, n = stats.sustained_above(some, PSI_SOME_UP)
        ev.append(
            Evidence(
                "host memory PSI some, max",
                round(float(some.values.max()), 2),
                "%",
                float(some.ts[0]),
                float(some.ts[-1]),
                stats.excerpt(some),
            )
        )
        if hit:
            ind.append(f"host memory PSI some >= {PSI_SOME_UP:.0f} % in {n} samples")
    mem = None
    limit = stats.host_total(timeline)
    if avail is not None and total is not None and limit:
        a = avail.valid()
        mem = Series(a.ts, limit - a.values)
        ratio = Series(mem.ts, mem.values / limit)
        hit, n = stats.sustained_above(ratio, NEAR_LIMIT)
        ev.append(
            Evidence(
                "host memory in use (MemTotal - MemAvailable) / MemTotal, max",
                round(float(ratio.values.max()), 3),
                "ratio",
                float(a.ts[0]),
                float(a.ts[-1]),
            )
        )
        if hit:
            ind.append(f"host MemAvailable under {1 - NEAR_LIMIT:.0%} of MemTotal in {n} samples")
    if mem is None and not len(some):
        return None
    thrash = _thrashing(full, host.get("vmstat.pgmajfault"))
    return _Pressure("the host (no service cgroup watched)", ind, ev, mem, limit, thrash, mem)


def _thrashing(full: Series, majflt: Series | None) -> bool:
    """Stalls at thrashing level (PSI full >= 5 % sustained) with major faults pouring in: more than ordinary pressure."""
    if not len(full) or not stats.sustained_above(full, PSI_FULL_UP)[0] or majflt is None:
        return False
    r = majflt.rate().valid()
    return bool(len(r) and float(np.percentile(r.values, MAJFAULT_PERCENTILE)) >= FAULTS_UP)


@rule(
    "memory.pressure",
    "memory_pressure",
    needs_any=(
        "cgroup:working_set",
        "cgroup:usage",
        "cgroup:psi.memory.some.avg10",
        "host:memory.available",
        "host:psi.memory.some.avg10",
    ),
)
def memory_pressure(timeline: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Memory high or stalling, following load and returning to baseline: capacity, not a leak."""
    mem = assess_service(timeline, ac)
    scope, assessments = mem.scope, mem.decisive
    if any(a.leak for a in assessments):
        return None  # rising troughs regardless of load: the leak rule's finding, not ordinary pressure
    views = [_cgroup_pressure(timeline, g) for g in scope.cgroups] if scope.cgroups else []
    if not views:
        host = _host_pressure(timeline)
        views = [host] if host else []
    views = [v for v in views if v.indicators]
    if not views:
        return None
    view = max(views, key=lambda v: len(v.indicators))
    load = stats.load_index(timeline)
    conf = 0.45 + 0.1 * (len(view.indicators) - 1)
    ev = list(view.evidence)
    notes: list[str] = []
    rho = math.nan
    follow = view.follow
    if (
        load is not None
        and follow is not None
        and len(follow) >= MIN_FOLLOW_SAMPLES
        and load.covers(float(follow.ts[0]), float(follow.ts[-1]))
    ):
        name, per_sample = load.load(follow.ts)
        rho = stats.spearman(follow.values, per_sample)
        ev.append(
            Evidence(
                f"correlation of memory with {name} (Spearman)",
                round(rho, 3) if math.isfinite(rho) else None,
                "rho",
                float(follow.ts[0]),
                float(follow.ts[-1]),
            )
        )
        if math.isfinite(rho) and rho >= FOLLOWS_LOAD_RHO:
            conf += 0.2
            notes.append(f"memory follows {name} (rho={rho:.2f})")
        elif not math.isfinite(rho) or rho < STATIC_RHO:
            conf -= 0.05
            notes.append(f"memory does not follow load (rho={rho:.2f}): the baseline itself is high")
    elif len(view.indicators) >= 2:
        conf += 0.05
    flat = [a for a in assessments if a.trend is not None and a.cand.scoped]
    if flat:
        a = min(flat, key=lambda x: x.p_adj)
        conf += 0.05
        ev.append(
            Evidence(
                f"trough slope of {a.cand.label} (Mann-Kendall p={a.p_adj:.2g})",
                round(a.slope * 3600 / MIB, 2),
                "MiB/h",
                float(a.troughs.ts[0]),
                float(a.troughs.ts[-1]),
                stats.excerpt(a.troughs),
            )
        )
    if view.mem is not None and len(view.mem):
        base, peak = float(np.percentile(view.mem.values, 5)), float(view.mem.values.max())
        ev.append(
            Evidence(
                "memory baseline (p5) -> peak",
                f"{format_bytes(base)} -> {format_bytes(peak)}",
                "",
                float(view.mem.ts[0]),
                float(view.mem.ts[-1]),
            )
        )
    rules_out = []
    if flat:
        a = min(flat, key=lambda x: x.p_adj)
        why = "; ".join(a.why_not) or "no rising troughs"
        rules_out.append(f"memory_leak: {why}")
    yielded: set[str] = set()
    if view.thrash:  # its own evidence: stalls this deep are more than ordinary pressure, whatever the thrashing rules say
        conf = min(conf, THRASHING_CEILING)
        notes.append("stalls are at thrashing level (PSI full >= 5 % with major faults): see the thrashing finding")
        yielded.add("thrashing")
    conf = min(conf, 0.9)
    start, end = (
        (float(view.mem.ts[0]), float(view.mem.ts[-1]))
        if view.mem is not None and len(view.mem)
        else (timeline.start, timeline.end)
    )
    summary = f"Memory pressure on {view.where}: " + "; ".join(view.indicators + notes)
    return Finding(
        "memory_pressure",
        "memory.pressure",
        conf,
        summary,
        ev,
        rules_out,
        [
            "Bound concurrency (and tokens in flight) so peak memory stays under the limit; a small queue with backpressure.",
            "Turn on the memory guard: answer 503 above ~85-90 % of the limit instead of letting the OOM killer decide.",
            "Cap prompt length and batch tokens; per-request memory scales with them.",
            "If the baseline itself is high, give the service more memory or fewer model copies (one shared, mmapped copy).",
        ],
        start,
        end,
        yielded_to=yielded,
    )
