"""A gate run over time, as plain series for the HTML report's charts: the load asked and sent, the latency
quantiles, the memory PSI and the target's memory, with each step's window to mark its boundaries.

Why here and not in the page: what is drawn is the gate's own arithmetic (the client's requests bucketed by
their scheduled time, the step each second belongs to, which processes are the target), testable without any
rendering; the page only draws these arrays. Client times are the loop's monotonic clock; every series here is
in wall-clock seconds (``StepLoad.wall``) so it lines up with the host agent's samples.

Latency buckets hold the requests *scheduled* in them (the arrival the load asked for), the same origin the
criteria measure from, so a backlog shows where it was built, not where it drained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from diag.gate.criteria import quantile
from diag.gate.runner import GateReport
from diag.timeline import Series, Timeline
from diag.timeline.signals import PROC_RSS

MAX_BUCKETS = 240  # per run: one point per second for a 4-minute gate, coarser beyond
PSI_SOME = "psi.memory.some.avg10"
PSI_FULL = "psi.memory.full.avg10"


@dataclass(frozen=True)
class StepWindow:
    """One step's wall-clock window and outcome: its boundaries on every chart, its row in the caption."""

    name: str
    start: float
    end: float
    load_end: float
    state: str  # PASS, FAIL or INTERRUPTED
    rate: float | None  # requests/s asked (open loop); None for a closed-loop step


@dataclass
class RunSeries:
    """Everything the charts draw, in wall-clock seconds. Empty arrays when a part was not observed."""

    steps: list[StepWindow]
    bucket_s: float
    t: np.ndarray  # bucket starts
    asked_rps: np.ndarray  # the spec's rate in the bucket (NaN for closed-loop steps and between steps)
    sent_rps: np.ndarray  # requests the generator sent, per second
    ok_rps: np.ndarray  # requests that succeeded, by their scheduled time, per second
    e2e_p50_s: np.ndarray
    e2e_p99_s: np.ndarray
    ttft_p99_s: np.ndarray
    psi: dict[str, Series] = field(default_factory=dict)  # label -> memory PSI some/full avg10 (percent)
    memory: dict[str, Series] = field(default_factory=dict)  # label -> bytes (target processes, cgroups, host)
    memory_limits: dict[str, Series] = field(default_factory=dict)  # label -> bytes (a cgroup's limit)
    memory_scope: str = ""  # what "the target's memory" is here: the watched processes, cgroups, or the host

    @property
    def span(self) -> tuple[float, float]:
        return (self.steps[0].start, self.steps[-1].end) if self.steps else (0.0, 0.0)


def step_windows(report: GateReport) -> list[StepWindow]:
    out = []
    for s in report.steps:
        state = "INTERRUPTED" if s.load.interrupted else ("PASS" if s.passed else "FAIL")
        start, end = s.window
        out.append(StepWindow(s.step.name, start, end, s.load.wall(s.load.load_end), state, s.step.rate))
    return out


def bucket_width(span_s: float) -> float:
    """One second, or the whole seconds that keep a long run within ``MAX_BUCKETS`` points."""
    return float(max(1, math.ceil(span_s / MAX_BUCKETS)))


def _client(report: GateReport, t0: float, width: float, n: int) -> dict[str, np.ndarray]:
    sent = np.zeros(n)
    ok = np.zeros(n)
    e2e: list[list[float]] = [[] for _ in range(n)]
    ttft: list[list[float]] = [[] for _ in range(n)]
    asked = np.full(n, np.nan)
    for s in report.steps:
        load = s.load
        if s.step.rate is not None:
            lo = max(0, int((load.wall0 - t0) // width))
            hi = min(n, math.ceil((load.wall(load.load_end) - t0) / width))
            asked[lo:hi] = s.step.rate
        for r in load.results:
            i = int((load.wall(r.scheduled) - t0) // width)
            if not 0 <= i < n:
                continue
            sent[i] += 1
            if r.ok:
                ok[i] += 1
                e2e[i].append(r.e2e_s)
                if (first := r.ttft_s) is not None:
                    ttft[i].append(first)

    def q(groups: list[list[float]], p: float) -> np.ndarray:
        return np.array([quantile(g, p) if g else np.nan for g in groups])

    return {"asked": asked, "sent": sent / width, "ok": ok / width, "p50": q(e2e, 0.5), "p99": q(e2e, 0.99),
            "ttft99": q(ttft, 0.99)}  # fmt: skip


def _window(s: Series | None, start: float, end: float) -> Series | None:
    if s is None:
        return None
    w = s.window(start, end).valid()
    return w if len(w) else None


def _host_side(tl: Timeline | None, start: float, end: float, pids: Sequence[int],
               cgroups: Sequence[str]) -> tuple[dict[str, Series], dict[str, Series], dict[str, Series], str]:  # fmt: skip
    """(PSI, memory, memory limits, scope) over [start, end]: the watched cgroups' and processes' when named, the
    host's PSI always (a cgroup's own PSI beside it), the host's memory in use only when nothing was named."""
    psi: dict[str, Series] = {}
    memory: dict[str, Series] = {}
    limits: dict[str, Series] = {}
    if tl is None:
        return psi, memory, limits, ""
    for key, label in ((PSI_SOME, "host memory some"), (PSI_FULL, "host memory full")):
        if (w := _window(tl.host.get(key), start, end)) is not None:
            psi[label] = w
    for path in cgroups:
        series = tl.cgroups.get(path, {})
        if (w := _window(series.get(PSI_SOME), start, end)) is not None:
            psi[f"{path} memory some"] = w
        if (w := _window(series.get("usage"), start, end)) is not None:
            memory[f"{path} usage"] = w
        if (w := _window(series.get("limit"), start, end)) is not None:
            limits[f"{path} limit"] = w
    for track in tl.processes.values():
        if track.pid in pids and (w := _window(track.series.get(PROC_RSS), start, end)) is not None:
            memory[f"pid {track.pid} ({track.comm or '?'}) RSS"] = w
    if memory:
        return psi, memory, limits, "the watched " + ("cgroups and processes" if cgroups and pids else
                                                      "cgroups" if cgroups else "processes")  # fmt: skip
    total, avail = _window(tl.host.get("memory.total"), start, end), _window(tl.host.get("memory.available"), start, end)
    if total is not None and avail is not None:
        memory["host used (total - available)"] = Series(avail.ts, np.interp(avail.ts, total.ts, total.values) - avail.values)
        limits["host total"] = total
        return psi, memory, limits, "the host (no --pid or --cgroup named, or none of them was sampled)"
    return psi, memory, limits, ""


def run_series(report: GateReport, tl: Timeline | None, pids: Sequence[int] = (), cgroups: Sequence[str] = ()) -> RunSeries:
    """The run's series from its report (the client's side) and the Timeline of its window (the host's side)."""
    steps = step_windows(report)
    if not steps:
        empty = np.empty(0)
        return RunSeries([], 1.0, empty, empty, empty, empty, empty, empty, empty)
    start, end = steps[0].start, steps[-1].end
    width = bucket_width(end - start)
    n = max(1, math.ceil((end - start) / width))
    c = _client(report, start, width, n)
    psi, memory, limits, scope = _host_side(tl, start - width, end + width, pids, cgroups)
    return RunSeries(steps, width, start + np.arange(n) * width, c["asked"], c["sent"], c["ok"], c["p50"], c["p99"],
                     c["ttft99"], psi, memory, limits, scope)  # fmt: skip
