"""memory_leak and memory_pressure on synthetic timelines built from real record shapes, plus the shared statistics.

Every timeline goes through the records' ``to_dict()`` and ``timeline_from_records`` -- the same path
a flight recorder takes -- with seeded numpy noise (never straight lines). Each rule must fire on
its own signature, stay quiet on healthy data and on the neighbouring classes' signatures, and be
*not evaluated* (through ``analyze()``) when its signals are absent. The builders here are reused by
the OOM and placement tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from scipy import stats as sps

from collectors.records import CgroupSnapshot, HostSnapshot, ProcessSample, Psi, PsiLine, RequestTiming, ServiceConfig
from diag.rules import stats
from diag.rules.base import TooLittleData
from diag.rules.engine import analyze
from diag.rules.memory import memory_leak, memory_pressure
from diag.timeline import Series, Table, Timeline, timeline_from_records

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
    if not reqs:
        return np.zeros(ts.size)
    start = np.array([r["start"] for r in reqs])
    finish = np.array([r["finish"] for r in reqs])
    return ((start[None, :] <= ts[:, None]) & (finish[None, :] > ts[:, None])).sum(axis=1).astype(float)


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


def test_leak_fires_with_slope_p_value_and_time_to_limit() -> None:
    tl = leak_timeline()
    f = memory_leak(tl)
    assert f is not None and f.cls == "memory_leak" and f.confidence >= 0.8
    by_unit = {e.unit: e for e in f.evidence}
    # 2 MiB/s injected; the Sen slope of the troughs recovers it within 20 %
    assert by_unit["MiB/min"].value == pytest.approx(120.0, rel=0.2)
    assert by_unit["bytes/s"].value == pytest.approx(2 * MIB, rel=0.2)
    p = next(e for e in f.evidence if e.what.startswith("Mann-Kendall"))
    assert p.value < 1e-3
    eta = next(e for e in f.evidence if e.what.startswith("time to the limit"))
    assert eta.unit == "s" and 300 < eta.value < 1200  # (2 GiB - ~680 MiB) / 2 MiB/s ~ 680 s
    troughs = next(e for e in f.evidence if e.unit == "windows")
    assert troughs.series and len(troughs.series) <= 50
    assert any(r.startswith("memory_pressure") for r in f.rules_out)
    assert (
        "cgroup /svc" in f.summary and "process 4242 (python) accounts for" in f.summary
    )  # the group decides, the worker is named
    assert analyze(tl).primary == "memory_leak"


def test_leak_without_requests_is_less_sure_but_still_found() -> None:
    with_load = memory_leak(leak_timeline(seed=7))
    without = memory_leak(leak_timeline(seed=7, with_requests=False))
    assert with_load is not None and without is not None
    assert 0.5 <= without.confidence < with_load.confidence
    assert any("not checked against load" in r for r in without.rules_out)


def test_staircase_leak_is_a_leak() -> None:
    rng = np.random.default_rng(11)
    n = 90
    ts = seconds(n)
    reqs = request_records(rng, T0, T0 + n, 3.0)
    steps = np.floor((ts - T0) / 15.0) * 40 * MIB  # +40 MiB every 15 s, six steps
    mem = 500 * MIB + steps + 10 * MIB * in_service(reqs, ts) + ar1(rng, n, 3 * MIB)
    f = memory_leak(service(rng, mem, ts, reqs))
    assert f is not None and f.confidence >= 0.5


@pytest.mark.parametrize(
    "make",
    [healthy_timeline, warmup_timeline, load_ramp_timeline, pressure_timeline],
    ids=["healthy", "warmup", "ramp", "pressure"],
)
def test_leak_quiet_on_other_shapes(make: Any) -> None:
    f = memory_leak(make())
    assert f is None or f.confidence < 0.5


def test_leak_rule_not_fooled_by_autocorrelated_noise() -> None:
    """Strongly autocorrelated wander (phi 0.95) around a flat level: the Hamed-Rao trough test must stay quiet."""
    fired = 0
    for seed in range(30):
        rng = np.random.default_rng(100 + seed)
        ts = seconds(90)
        mem = 600 * MIB + ar1(rng, 90, 15 * MIB, phi=0.95)
        f = memory_leak(service(rng, mem, ts))
        fired += f is not None and f.confidence >= 0.5
    assert fired <= 1


def test_slow_drift_is_not_material() -> None:
    """An interpreter settling by ~3 MiB over 90 s in a 2 GiB group: significant maybe, but not a leak."""
    rng = np.random.default_rng(12)
    ts = seconds(90)
    mem = 600 * MIB + 0.03 * MIB * (ts - T0) + ar1(rng, 90, 0.3 * MIB)
    assert memory_leak(service(rng, mem, ts)) is None


def test_short_recording_is_not_judged_and_says_how_much_is_needed() -> None:
    """15 s cannot show a leak: the rule says so with the amount it needs, and the verdict is not healthy."""
    tl = leak_timeline(n=15)
    result = memory_leak(tl)
    assert isinstance(result, TooLittleData)
    assert "20 samples over 30 s" in result.needed and result.have.startswith("15 memory samples over 1")
    analysis = analyze(tl)
    assert analysis.primary == "inconclusive"
    assert "memory.leak" in [t["rule"] for t in analysis.too_little_data]
    assert analysis.to_dict()["verdict"]["too_little_data"][0]["needed"] == result.needed


# --------------------------------------------------------------------------- memory_pressure


def test_pressure_fires_when_memory_follows_load_and_returns() -> None:
    tl = pressure_timeline()
    f = memory_pressure(tl)
    assert f is not None and f.cls == "memory_pressure" and f.confidence >= 0.6
    rho = next(e for e in f.evidence if e.unit == "rho")
    assert rho.value >= 0.5
    assert any(r.startswith("memory_leak") for r in f.rules_out)
    assert all(e.unit or isinstance(e.value, str) for e in f.evidence)
    assert memory_leak(tl) is None
    assert analyze(tl).primary == "memory_pressure"


def test_pressure_yields_to_the_leak() -> None:
    assert memory_pressure(leak_timeline()) is None


def test_pressure_quiet_on_healthy_and_queue_backlog() -> None:
    assert memory_pressure(healthy_timeline()) is None
    rng = np.random.default_rng(21)
    ts = seconds(90)
    reqs = request_records(rng, T0, T0 + 90, 5.0, service_s=0.4, slots=1)  # a long queue in front of one slot
    mem = 600 * MIB + 20 * MIB * in_service(reqs, ts) + ar1(rng, 90, 3 * MIB)
    tl = service(rng, mem, ts, reqs)
    assert np.nanmax(tl.requests["queue_wait_s"]) > 10  # the backlog is really there
    assert memory_pressure(tl) is None


def test_pressure_quiet_when_the_pressure_is_the_neighbours() -> None:
    rng = np.random.default_rng(22)
    ts = seconds(90)
    mem = 600 * MIB + ar1(rng, 90, 3 * MIB)
    tl = build(
        host_records(ts, available=np.linspace(8, 0.6, 90) * GIB, mem_some=rng.uniform(20, 40, 90)),
        cgroup_records(ts, mem, psi_some=rng.uniform(0, 0.5, 90)),
        process_records(ts, 4242, mem - 50 * MIB),
    )
    assert memory_pressure(tl) is None


def test_pressure_stays_under_verdict_on_thrashing_signature() -> None:
    rng = np.random.default_rng(23)
    ts = seconds(90)
    mem = 0.97 * GIB + ar1(rng, 90, 2 * MIB)
    majflt = np.cumsum(rng.integers(400, 900, 90))
    tl = build(
        host_records(ts),
        cgroup_records(
            ts, mem, limit=GIB, psi_some=rng.uniform(40, 70, 90), psi_full=rng.uniform(20, 40, 90), stat={"pgmajfault": majflt}
        ),
        process_records(ts, 4242, mem - 50 * MIB),
    )
    f = memory_pressure(tl)
    assert f is not None and f.confidence < 0.5 and "thrashing" in f.summary


def test_static_high_memory_without_load_correlation_is_not_a_verdict() -> None:
    """Memory parked at 92 % of the limit whatever the traffic (e.g. model copies): pressure, but not >= 0.5 alone."""
    rng = np.random.default_rng(24)
    ts = seconds(90)
    reqs = request_records(rng, T0, T0 + 90, 3.0)
    mem = 0.92 * GIB + ar1(rng, 90, 2 * MIB)
    f = memory_pressure(service(rng, mem, ts, reqs, limit=GIB))
    assert f is not None and f.confidence < 0.5


# --------------------------------------------------------------------------- signals / not evaluated


def test_not_evaluated_without_memory_signals() -> None:
    rng = np.random.default_rng(30)
    tl = build(request_records(rng, T0, T0 + 60, 2.0))
    a = analyze(tl)
    missing = {n["rule"]: n["missing"] for n in a.not_evaluated}
    assert "memory.leak" in missing and "memory.pressure" in missing
    assert "memory.leak" not in a.evaluated


def test_evaluated_and_healthy_on_healthy_timeline() -> None:
    a = analyze(healthy_timeline())
    assert {"memory.leak", "memory.pressure"} <= set(a.evaluated)
    assert all(f.cls not in ("memory_leak", "memory_pressure") or f.confidence < 0.5 for f in a.findings)


def test_leak_in_unidentified_process_is_capped() -> None:
    """No service records, no model holders, no watched cgroup: a growing process is reported but cannot be the verdict."""
    rng = np.random.default_rng(31)
    ts = seconds(90)
    rss = 300 * MIB + 2 * MIB * (ts - T0) + ar1(rng, 90, 3 * MIB)
    f = memory_leak(build(host_records(ts), process_records(ts, 777, rss, cgroup=None, comm="java")))
    assert f is not None and f.confidence <= 0.6 and "not identified as the service" in f.summary


def test_config_pid_identifies_the_service() -> None:
    rng = np.random.default_rng(32)
    ts = seconds(90)
    grow = 300 * MIB + 2 * MIB * (ts - T0) + ar1(rng, 90, 3 * MIB)
    other = 300 * MIB + ar1(rng, 90, 3 * MIB)
    cfg = ServiceConfig(ts=T0, service="demo", pid=4242, settings={"workers": 1}).to_dict()
    tl = build(
        host_records(ts), process_records(ts, 4242, grow, cgroup=None), process_records(ts, 999, other, cgroup=None), [cfg]
    )
    scope = stats.service_scope(tl)
    assert scope.identified_by == "service records" and [t.pid for t in scope.tracks] == [4242]
    f = memory_leak(tl)
    assert f is not None and "4242" in f.summary and f.confidence > 0.6
    eta = next(e for e in f.evidence if e.what.startswith("time to exhaust host MemAvailable"))  # no cgroup: the host's headroom
    assert eta.unit == "s" and eta.value == pytest.approx(18 * GIB / (2 * MIB), rel=0.2)


# --------------------------------------------------------------------------- statistics


def test_mann_kendall_matches_scipy_on_iid_data() -> None:
    rng = np.random.default_rng(40)
    y = rng.normal(size=40) + np.linspace(0, 1, 40)
    s, _z, p, tau, corr = stats.mann_kendall(y)
    ref = sps.kendalltau(np.arange(40), y)
    assert tau == pytest.approx(ref.statistic, abs=1e-12)  # no ties: tau_b == tau_a
    assert s == pytest.approx(ref.statistic * 40 * 39 / 2)
    if corr == 1.0:  # no significant autocorrelation: the plain MK p-value (continuity-corrected) is close to scipy's
        assert p == pytest.approx(ref.pvalue, rel=0.15)


def test_hamed_rao_widens_variance_for_autocorrelated_series() -> None:
    rng = np.random.default_rng(41)
    corrs = [stats.mann_kendall(ar1(rng, 60, 1.0, phi=0.9))[4] for _ in range(10)]
    assert np.median(corrs) > 1.5
    iid = [stats.mann_kendall(rng.normal(size=60))[4] for _ in range(10)]
    assert np.median(iid) < 1.3


def test_troughs_take_window_minima() -> None:
    ts = T0 + np.arange(100.0)
    values = np.tile([5.0, 1.0, 7.0, 9.0, 3.0], 20) + np.arange(100) // 5 * 10.0
    tr = stats.troughs(Series(ts, values), windows=20)
    assert len(tr) == 20
    np.testing.assert_allclose(tr.values, 1.0 + np.arange(20) * 10.0)


def test_plateau_detects_warmup_but_not_a_steady_climb() -> None:
    rng = np.random.default_rng(42)
    t = np.arange(18.0) * 5
    warm = 100 * (1 - np.exp(-t / 12)) + rng.normal(0, 1, 18)
    climb = 2.0 * t + rng.normal(0, 3, 18)
    assert stats.plateau_after_change(t, warm) is not None
    assert stats.plateau_after_change(t, climb) is None


def test_load_index_matches_brute_force() -> None:
    rng = np.random.default_rng(43)
    reqs = request_records(rng, T0, T0 + 60, 5.0)
    cols = {k: np.array([r[k] for r in reqs], dtype=float) for k in ("start", "finish", "prompt_tokens", "output_tokens")}
    idx = stats.LoadIndex(Table(cols))
    ts = T0 + rng.uniform(0, 60, 200)
    count, tokens = idx.at(ts)
    inside = (cols["start"][None, :] <= ts[:, None]) & (cols["finish"][None, :] > ts[:, None])
    np.testing.assert_array_equal(count, inside.sum(axis=1))
    np.testing.assert_allclose(tokens, (inside * (cols["prompt_tokens"] + cols["output_tokens"])).sum(axis=1))
