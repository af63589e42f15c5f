"""Memory-family test data: synthetic timelines built from real record shapes (``to_dict()`` then
``timeline_from_records``, the path a flight recorder takes), with seeded numpy noise, never straight lines.

Why a module of its own: the leak/pressure, OOM and placement tests all build their inputs this way;
test modules import from here, never from each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from collectors.records import CgroupSnapshot, HostSnapshot, ProcessSample, Psi, PsiLine, RequestTiming
from diag.timeline import Timeline, timeline_from_records

MIB = 1 << 20
GIB = 1 << 30
T0 = 1_700_000_000.0
SVC = "/svc"
HOST_TOTAL = 24 * GIB


# --------------------------------------------------------------------------- builders (shared with the other memory-family tests)


def seconds(n: int = 90, dt: float = 1.0) -> np.ndarray:
    return T0 + np.arange(n) * dt


def _psi_lines(pct: np.ndarray, dt: np.ndarray) -> list[PsiLine]:
    """PSI lines whose cumulative total grows by pct % of each interval and whose avg10 is ~pct."""
    total = np.cumsum(pct / 100.0 * dt) * 1e6  # dt[0] is 0: the counter starts at 0
    return [PsiLine(float(p), float(p), float(p), int(t)) for p, t in zip(pct, total, strict=True)]


def _psi(some: np.ndarray | None, full: np.ndarray | None, ts: np.ndarray) -> list[Psi | None]:
    dt = np.diff(ts, prepend=ts[0])
    s = _psi_lines(some, dt) if some is not None else [None] * ts.size
    f = _psi_lines(full, dt) if full is not None else [None] * ts.size
    return [Psi(a, b) if (a or b) else None for a, b in zip(s, f, strict=True)]


def host_records(
    ts: np.ndarray,
    available: np.ndarray | None = None,
    mem_some: np.ndarray | None = None,
    mem_full: np.ndarray | None = None,
    io_some: np.ndarray | None = None,
    vmstat: dict[str, np.ndarray] | None = None,
    total: int = HOST_TOTAL,
) -> list[dict[str, Any]]:
    available = available if available is not None else np.full(ts.size, 18.0 * GIB)
    zeros = np.zeros(ts.size)
    mem = _psi(mem_some if mem_some is not None else zeros, mem_full if mem_full is not None else zeros, ts)
    io = _psi(io_some if io_some is not None else zeros, zeros, ts)
    out = []
    for i, t in enumerate(ts):
        snap = HostSnapshot(
            ts=float(t),
            psi={"memory": mem[i], "io": io[i]},
            memory={"total": total, "available": int(available[i])},
            vmstat={k: int(v[i]) for k, v in (vmstat or {}).items()},
        )
        out.append(snap.to_dict())
    return out


def cgroup_records(
    ts: np.ndarray,
    usage: np.ndarray,
    limit: int | None = 2 * GIB,
    path: str = SVC,
    psi_some: np.ndarray | None = None,
    psi_full: np.ndarray | None = None,
    events: dict[str, np.ndarray] | None = None,
    stat: dict[str, np.ndarray] | None = None,
    inactive_file: int = 20 * MIB,
    with_psi: bool = True,
) -> list[dict[str, Any]]:
    """One group's snapshots; ``with_psi=False`` is a plain v1 group (no cgroup2 twin to read PSI from)."""
    zeros = np.zeros(ts.size)
    pressure = _psi(psi_some if psi_some is not None else zeros, psi_full if psi_full is not None else zeros, ts)
    if not with_psi:
        pressure = [None] * ts.size
    out = []
    for i, t in enumerate(ts):
        u = int(usage[i]) + inactive_file
        snap = CgroupSnapshot(
            ts=float(t),
            path=path,
            version="hybrid",
            usage_bytes=u,
            working_set_bytes=u - inactive_file,
            limit_bytes=limit,
            events={k: int(v[i]) for k, v in (events or {}).items()},
            stat={"inactive_file": inactive_file, **{k: int(v[i]) for k, v in (stat or {}).items()}},
            pressure=pressure[i],
        )
        out.append(snap.to_dict())
    return out


def process_records(
    ts: np.ndarray,
    pid: int,
    rss: np.ndarray,
    uss: np.ndarray | None = None,
    pss: np.ndarray | None = None,
    model_files: Sequence[str] = (),
    cgroup: str | None = SVC,
    comm: str = "python",
    start_time_s: float = 1000.0,
) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(ts):
        sample = ProcessSample(
            ts=float(t),
            pid=pid,
            comm=comm,
            cmdline=f"{comm} -m serve",
            start_time_s=start_time_s + pid,
            rss_bytes=int(rss[i]),
            uss_bytes=int(uss[i]) if uss is not None else None,
            pss_bytes=int(pss[i]) if pss is not None else None,
            memory_cgroup=cgroup,
            model_files=list(model_files),
        )
        out.append(sample.to_dict())
    return out


def request_records(
    rng: np.random.Generator,
    t_start: float,
    t_end: float,
    rate: float | np.ndarray,
    service_s: float = 0.5,
    pid: int = 4242,
    slots: int | None = None,
) -> list[dict[str, Any]]:
    """Poisson arrivals (``rate`` per second, or one rate per second of the window), lognormal service times.

    ``slots`` limits requests in service (a queue forms in front of them, FIFO) -- the queue-backlog shape.
    """
    arrivals: list[float] = []
    n_sec = int(t_end - t_start)
    rates = np.broadcast_to(np.asarray(rate, dtype=float), (n_sec,))
    for sec in range(n_sec):
        k = rng.poisson(rates[sec])
        arrivals += list(t_start + sec + np.sort(rng.random(k)))
    out = []
    free_at = [t_start] * (slots or 0)
    for a in arrivals:
        dur = float(rng.lognormal(math.log(service_s), 0.3))
        if slots:
            i = int(np.argmin(free_at))
            start = max(a, free_at[i])
            free_at[i] = start + dur
        else:
            start = a
        prompt = int(rng.integers(100, 400))
        rec = RequestTiming(
            ts=start + dur, arrival=a, start=start, finish=start + dur, prompt_tokens=prompt, output_tokens=64, pid=pid
        )
        out.append(rec.to_dict())
    return out


def in_service(reqs: list[dict[str, Any]], ts: np.ndarray) -> np.ndarray:
    """Requests in service at each sample time, by brute force (independent of the code under test)."""
    return _open_at(reqs, ts, "start")


def held(reqs: list[dict[str, Any]], ts: np.ndarray) -> np.ndarray:
    """Requests held at each sample time (arrived, not finished: queued or in service), by brute force."""
    return _open_at(reqs, ts, "arrival")


def _open_at(reqs: list[dict[str, Any]], ts: np.ndarray, begins: str) -> np.ndarray:
    """How many requests had begun (their ``begins`` time) and not finished at each time of ``ts``."""
    if not reqs:
        return np.zeros(ts.size)
    begin = np.array([r[begins] for r in reqs])
    finish = np.array([r["finish"] for r in reqs])
    return ((begin[None, :] <= ts[:, None]) & (finish[None, :] > ts[:, None])).sum(axis=1).astype(float)


def build(*parts: list[dict[str, Any]]) -> Timeline:
    return timeline_from_records([r for part in parts for r in part])


def ar1(rng: np.random.Generator, n: int, sd: float, phi: float = 0.7) -> np.ndarray:
    """Autocorrelated noise: what a memory gauge's jitter really looks like."""
    e = rng.normal(0.0, sd * math.sqrt(1 - phi * phi), n)
    out = np.empty(n)
    out[0] = rng.normal(0.0, sd)
    for i in range(1, n):
        out[i] = phi * out[i - 1] + e[i]
    return out


def service(
    rng: np.random.Generator,
    memory: np.ndarray,
    ts: np.ndarray,
    reqs: list[dict[str, Any]] | None = None,
    limit: int | None = 2 * GIB,
    **cgroup_kw: Any,
) -> Timeline:
    """Host + the service cgroup + one worker (whose RSS is most of the group) + its requests."""
    worker_rss = memory - 60 * MIB + rng.normal(0, 1 * MIB, ts.size)
    return build(
        host_records(ts),
        cgroup_records(ts, memory, limit=limit, **cgroup_kw),
        process_records(ts, 4242, worker_rss, uss=worker_rss - 30 * MIB, pss=worker_rss - 20 * MIB),
        process_records(ts, 4200, np.full(ts.size, 40.0 * MIB) + rng.normal(0, 0.2 * MIB, ts.size), comm="uvicorn"),
        reqs or [],
    )


# --------------------------------------------------------------------------- scenarios


def leak_timeline(seed: int = 1, rate_mib_s: float = 2.0, with_requests: bool = True, n: int = 90) -> Timeline:
    rng = np.random.default_rng(seed)
    ts = seconds(n)
    reqs = request_records(rng, T0, T0 + n, 4.0) if with_requests else []
    load = in_service(reqs, ts)
    mem = 500 * MIB + rate_mib_s * MIB * (ts - T0) + 25 * MIB * load + ar1(rng, n, 4 * MIB)
    return service(rng, mem, ts, reqs)


def pressure_timeline(seed: int = 2, n: int = 90) -> Timeline:
    """Two load bursts; memory rides on the requests in service up to ~95 % of a 1 GiB limit, then returns."""
    rng = np.random.default_rng(seed)
    ts = seconds(n)
    sec = np.arange(n)
    rate = np.where(((sec >= 15) & (sec < 35)) | ((sec >= 55) & (sec < 75)), 14.0, 0.5)
    reqs = request_records(rng, T0, T0 + n, rate)
    load = in_service(reqs, ts)
    mem = np.minimum(400 * MIB + 85 * MIB * load + ar1(rng, n, 4 * MIB), 1000 * MIB)
    near = mem >= 0.9 * GIB
    psi = np.where(near, rng.uniform(12, 30, n), rng.uniform(0, 1, n))
    failcnt = np.cumsum(near * rng.integers(5, 50, n))
    return service(rng, mem, ts, reqs, limit=GIB, psi_some=psi, events={"max": failcnt, "oom_kill": np.zeros(n)})


def healthy_timeline(seed: int = 3, n: int = 90) -> Timeline:
    rng = np.random.default_rng(seed)
    ts = seconds(n)
    reqs = request_records(rng, T0, T0 + n, 3.0)
    mem = 600 * MIB + 10 * MIB * in_service(reqs, ts) + ar1(rng, n, 3 * MIB)
    return service(rng, mem, ts, reqs, psi_some=rng.uniform(0, 0.5, n))


def warmup_timeline(seed: int = 4, n: int = 90) -> Timeline:
    """A cache filling: fast climb, then flat -- not a leak."""
    rng = np.random.default_rng(seed)
    ts = seconds(n)
    reqs = request_records(rng, T0, T0 + n, 3.0)
    fill = 350 * MIB * (1 - np.exp(-(ts - T0) / 12.0))
    mem = 400 * MIB + fill + 10 * MIB * in_service(reqs, ts) + ar1(rng, n, 3 * MIB)
    return service(rng, mem, ts, reqs)


def load_ramp_timeline(seed: int = 5, n: int = 90) -> Timeline:
    """Traffic ramps from 1 to 12 requests/s and memory follows the requests in service: pressure-shaped, not a leak."""
    rng = np.random.default_rng(seed)
    ts = seconds(n)
    reqs = request_records(rng, T0, T0 + n, np.linspace(1.0, 12.0, n))
    mem = 400 * MIB + 60 * MIB * in_service(reqs, ts) + ar1(rng, n, 4 * MIB)
    return service(rng, mem, ts, reqs)


# --------------------------------------------------------------------------- memory_leak
