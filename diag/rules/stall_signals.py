"""Memory-stall signals of the service: which are recorded, and are they up when the service is loaded or slow?

Three rules judge thrashing from the same signals -- per request (``requests.thrashing``, and the
backlog rule that must rule thrashing out), from stalls alone (``stalls.thrashing``) and from
histograms (``aggregated.queue_vs_thrash``) -- so the list of signals, their thresholds and the
loaded-vs-calm comparison live here, once. The service's own cgroup and processes come first; host
signals are context (a neighbour's pressure is not ours).

Thresholds are for *diagnosis*, a lower tier than the ones that kill: systemd-oomd acts on a cgroup
at memory PSI full > 60 % for 30 s (its ``DefaultMemoryPressureLimit`` and
``DefaultMemoryPressureDurationSec`` defaults, oomd.conf(5)); Android's lmkd reports medium pressure
at PSI some of 70 ms per second (7 %; 200 ms on low-RAM devices) and critical at full of 700 ms per
second (its ``ro.lmk.psi_partial_stall_ms`` / ``psi_complete_stall_ms`` defaults). Here memory PSI
some >= 10 % is pressure, and full >= 5 % is a thrashing candidate: the kernel's PSI documentation
(Documentation/accounting/psi.rst) calls a workload that spends extended time with *every* task
stalled on memory thrashing, and the scenario recordings of real thrashing peak at 50-74 % full
while the healthy, queue and batching ones stay at 0. Counter rates must be both above a floor (a
healthy warm service takes ~0 major faults per second) and several times their calm level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from diag.rules import levels
from diag.rules.stats import ServiceContext, edge_level, stall_percent
from diag.rules.usl import LoadCurve
from diag.timeline import Series, Timeline

# PSI some/full (percent of wall time) and page-in floors (per second): shared with the cause alerts
PSI_SOME_UP, PSI_FULL_UP, FAULTS_UP, REFAULTS_UP, SWAP_UP = (
    levels.PSI_SOME_UP,
    levels.PSI_FULL_UP,
    levels.FAULTS_UP,
    levels.REFAULTS_UP,
    levels.SWAP_UP,
)
RATE_FACTOR = 3.0  # a counter rate is up at this many times its calm level (and above its floor)
RATE_ALWAYS = 10.0  # a rate at 10x its floor is a stall even when the whole recording was already stalling
CALM_QUANTILE = 0.1  # the signal's own low level over the window, one of the calm references
LOADED_QUANTILE = 0.9  # without a load curve, the signal's high level stands for "loaded"

# What a thrashing rule can stand on: any one memory-stall signal, host-wide or per cgroup or per process.
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
PAGE_INS = ("faults", "refaults", "swap")  # the counter kinds: pages read (back) in
FLOORS: dict[str, float] = {
    "psi_some": PSI_SOME_UP,
    "psi_full": PSI_FULL_UP,
    "faults": FAULTS_UP,
    "refaults": REFAULTS_UP,
    "swap": SWAP_UP,
}


class StallCandidate(NamedTuple):
    """One recorded memory-stall signal: where it comes from, what it is, and whether it is the service's own."""

    scope: str  # "cgroup <path>", "serving processes", "host"
    name: str
    unit: str
    kind: str  # a key of FLOORS
    series: Series  # percent for PSI, a per-second rate for counters
    service: bool  # the service's own cgroup/processes (vs host-wide or a group not known to be the service's)


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


def stall_candidates(tl: Timeline, ctx: ServiceContext) -> list[StallCandidate]:
    """Every stall signal present: the service's cgroup (else every watched group, as context), its processes, the host."""
    out: list[StallCandidate] = []

    def add_group(scope: str, get: dict[str, Series], prefix: str, service: bool) -> None:
        for kind, line in (("psi_some", "psi.memory.some"), ("psi_full", "psi.memory.full")):
            s = stall_percent(get, line)  # exact from total_s where sampled, else avg10
            if len(s) >= 2:
                out.append(StallCandidate(scope, f"{line} stall", "%", kind, s, service))
        faults = get.get(f"{prefix}pgmajfault")
        if faults is not None:
            r = _rate_sum([faults])
            if r is not None:
                out.append(StallCandidate(scope, f"{prefix}pgmajfault rate", "faults/s", "faults", r, service))
        refault_keys = [f"{prefix}workingset_refault_file", f"{prefix}workingset_refault_anon"]
        refaults = [get[k] for k in refault_keys if k in get] or [get[k] for k in (f"{prefix}workingset_refault",) if k in get]
        r = _rate_sum(refaults)
        if r is not None:
            out.append(StallCandidate(scope, f"{prefix}workingset_refault rate", "pages/s", "refaults", r, service))
        swaps = [get[k] for k in (f"{prefix}pswpin", f"{prefix}pswpout") if k in get]
        r = _rate_sum(swaps)
        if r is not None:
            out.append(StallCandidate(scope, f"{prefix}pswpin+pswpout rate", "pages/s", "swap", r, service))

    if ctx.cgroup is not None:
        add_group(f"cgroup {ctx.cgroup}", tl.cgroups.get(ctx.cgroup, {}), "stat.", True)
    else:
        for path, group in tl.cgroups.items():  # service not identified: these are context, not ours
            add_group(f"cgroup {path} (not known to be the service's)", group, "stat.", False)
    procs = [t.series["major_faults"] for t in tl.processes.values() if t.pid in ctx.pids and "major_faults" in t.series]
    r = _rate_sum(procs)
    if r is not None:
        out.append(StallCandidate("serving processes", "major fault rate", "faults/s", "faults", r, True))
    add_group("host", tl.host, "vmstat.", False)
    return out


def memory_stall(tl: Timeline, ctx: ServiceContext, curve: LoadCurve | None) -> list[StallSignal]:
    """Each stall signal's level in the loaded/slow buckets (``hi``) vs the calm reference (``lo``).

    ``hi`` is the larger of the medians over the top-quartile buckets of ``curve`` by requests in
    system and by mean service time (a service can slow at constant load); ``lo`` is the smallest of
    the bottom-quartile medians, the signal's own 10th percentile over the timeline and the median of
    its first 15 % (the calm before the incident, when the recording has it -- in a squeezed cgroup the
    loaded and the "calm" buckets may both be stalling). Without a curve, ``hi`` is the signal's 90th
    percentile. PSI is "up" on its absolute level; counter rates must also be ``RATE_FACTOR`` times the
    calm level, unless they reach ``RATE_ALWAYS`` times their floor.
    """
    out = []
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
            his.append(float(np.quantile(vals, LOADED_QUANTILE)))
        los.append(float(np.quantile(vals, CALM_QUANTILE)))
        los.append(edge_level(window if len(window) else series, "first"))  # the calm before the incident, if recorded
        hi, lo = max(his), min(los)
        out.append(StallSignal(scope, name, unit, hi, lo, _is_up(kind, hi, lo), service, series))
    return out


def _is_up(kind: str, hi: float, lo: float) -> bool:
    """PSI is up on its level alone; a rate must be several times its calm level -- or so high no calm level excuses it."""
    floor = FLOORS[kind]
    if kind.startswith("psi"):
        return bool(hi >= floor)
    return bool(hi >= max(floor, RATE_FACTOR * lo) or hi >= RATE_ALWAYS * floor)
