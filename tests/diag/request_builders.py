"""Request-family test data: timelines built from real record dataclasses (``.to_dict()``), with request
timings from small simulations -- a FIFO queue in front of c inference slots (open loop, Poisson arrivals)
and a closed loop of clients -- and 1 Hz host/cgroup/process samples with seeded noise.

Why a module of its own: the queue/thrash, loader, batching and config tests all build their inputs
this way; test modules import from here, never from each other.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

import numpy as np

from collectors.records import CgroupSnapshot, HostSnapshot, ProcessSample, Psi, PsiLine, RequestTiming
from diag.rules.base import Finding
from diag.rules.engine import Analysis, analyze
from diag.timeline import timeline_from_records

T0 = 1_700_000_000.0
PID = 4242
D = 90.0  # seconds of a synthetic recording
CG = "/llmdiag/svc"
Row = tuple[float, float | None, float]  # arrival, start (None: never started), finish -- seconds after T0


# --------------------------------------------------------------------------- generators (shared)


def simulate_queue(
    rng: np.random.Generator,
    duration: float,
    rate: Callable[[float], float],
    slots: int,
    service: Callable[[np.random.Generator, float, int], float],
) -> list[Row]:
    """FIFO queue in front of ``slots`` inference slots; Poisson arrivals at ``rate(t)``;
    ``service(rng, start, busy)`` gives the inference seconds of a request starting with ``busy`` slots taken."""
    t = 0.0
    free = [0.0] * slots
    rows: list[Row] = []
    while True:
        t += rng.exponential(1.0 / rate(t))
        if t > duration:
            return rows
        slot_free = heapq.heappop(free)
        start = max(t, slot_free)
        busy = 1 + sum(1 for f in free if f > start)
        s = service(rng, start, busy)
        heapq.heappush(free, start + s)
        rows.append((t, start, start + s))


def simulate_clients(
    rng: np.random.Generator,
    duration: float,
    clients: Callable[[float], int],
    service: Callable[[np.random.Generator, int], float],
) -> list[Row]:
    """A closed loop: client k is active while k < clients(t) and sends its next request as the last one ends."""
    rows: list[Row] = []
    top = max(clients(x) for x in np.arange(0.0, duration, 0.5))
    for k in range(top):
        t = float(rng.uniform(0, 0.2))
        while t < duration:
            n = clients(t)
            if k >= n:
                t += 0.5
                continue
            s = service(rng, n)
            rows.append((t, t, t + s))
            t += s + float(rng.exponential(0.01))
    rows.sort()
    return rows


def lognormal(median: float, sigma: float = 0.25) -> Callable[..., float]:
    return lambda rng, *_: float(median * math.exp(rng.normal(0.0, sigma)))


def request_records(
    rows: Sequence[Row],
    prompts: Sequence[int] | None = None,
    outcomes: Sequence[str] | None = None,
    pid: int = PID,
) -> list[dict]:
    out = []
    for i, (a, s, f) in enumerate(rows):
        rec = RequestTiming(
            ts=T0 + f,
            arrival=T0 + a,
            start=None if s is None else T0 + s,
            finish=T0 + f,
            outcome=outcomes[i] if outcomes is not None else "ok",  # type: ignore[arg-type]
            route="/v1/completions",
            model="demo",
            prompt_tokens=int(prompts[i]) if prompts is not None else 120,
            output_tokens=16,
            pid=pid,
        )
        out.append(rec.to_dict())
    return out


def _psi(rng: np.random.Generator, level: float, totals: list[float]) -> Psi:
    some = max(0.0, level + rng.normal(0.0, 0.3))
    full = some * 0.5
    totals[0] += some * 1e4  # percent of 1 s, in microseconds
    totals[1] += full * 1e4
    return Psi(some=PsiLine(some, some, some, int(totals[0])), full=PsiLine(full, full, full, int(totals[1])))


def telemetry(
    rng: np.random.Generator,
    duration: float,
    *,
    stall: Callable[[float], float] = lambda t: 0.0,
    faults: Callable[[float], float] = lambda t: 0.5,
    host_stall: Callable[[float], float] | None = None,
    host_faults: Callable[[float], float] | None = None,
    usage: Callable[[float], float] | None = None,
    limit: int | None = 8 << 30,
    cgroup: bool = True,
    host: bool = True,
    process: bool = True,
    pid: int = PID,
) -> list[dict]:
    """1 Hz samples from t=-10 s to the end: host PSI/vmstat/meminfo, the service cgroup and its process.

    ``stall(t)`` is the service cgroup's memory PSI some % and ``faults(t)`` its major faults/s (host
    sees the same plus a little background unless ``host_*`` say otherwise); ``usage(t)`` its bytes.
    """
    out: list[dict] = []
    cg_major = host_major = refault = 0.0
    cg_tot, host_tot = [0.0, 0.0], [0.0, 0.0]
    for i in range(-10, int(duration) + 2):
        t = float(i)
        f = max(0.0, faults(t)) * rng.uniform(0.8, 1.2)
        cg_major += f
        hf = max(0.0, (host_faults or faults)(t)) * rng.uniform(0.8, 1.2) + rng.poisson(0.5)
        host_major += hf
        refault += 4 * hf
        used = (usage(t) if usage else (2 << 30)) + rng.normal(0, 8 << 20)
        if host:
            out.append(
                HostSnapshot(
                    ts=T0 + t,
                    psi={"memory": _psi(rng, (host_stall or stall)(t), host_tot)},
                    memory={"total": 24 << 30, "available": int((22 << 30) - used)},
                    vmstat={"pgmajfault": int(host_major), "workingset_refault_file": int(refault), "pswpin": 0, "pswpout": 0},
                ).to_dict()
            )
        if cgroup:
            out.append(
                CgroupSnapshot(
                    ts=T0 + t,
                    path=CG,
                    version="hybrid",
                    usage_bytes=int(used),
                    working_set_bytes=int(used * 0.9),
                    limit_bytes=limit,
                    stat={"pgmajfault": int(cg_major), "anon": int(used * 0.8)},
                    pressure=_psi(rng, stall(t), cg_tot),
                ).to_dict()
            )
        if process:
            out.append(
                ProcessSample(
                    ts=T0 + t, pid=pid, comm="python", start_time_s=1000.0, rss_bytes=int(used * 0.8),
                    major_faults=int(cg_major), memory_cgroup=CG,
                ).to_dict()
            )  # fmt: skip
    return out


def run(records: list[dict]) -> Analysis:
    return analyze(timeline_from_records(records))


def finding(analysis: Analysis, rule_id: str) -> Finding | None:
    return next((f for f in analysis.findings if f.rule == rule_id), None)


def confidence(analysis: Analysis, rule_id: str) -> float:
    f = finding(analysis, rule_id)
    return f.confidence if f is not None else 0.0


def not_evaluated(analysis: Analysis) -> dict[str, list[str]]:
    return {n["rule"]: n["missing"] for n in analysis.not_evaluated}


def assert_units(f: Finding) -> None:
    """Every numeric evidence item says what unit it is in; every item says what it is."""
    assert f.evidence
    for e in f.evidence:
        assert e.what
        if isinstance(e.value, (int, float)) and not isinstance(e.value, bool):
            assert e.unit is not None
        if e.series is not None:
            assert len(e.series) <= 50 and all(len(p) == 2 for p in e.series)


# --------------------------------------------------------------------------- scenarios
