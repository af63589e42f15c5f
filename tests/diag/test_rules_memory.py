"""memory_leak and memory_pressure on synthetic timelines built from real record shapes, plus the shared statistics.

Every timeline goes through the records' ``to_dict()`` and ``timeline_from_records`` -- the same path
a flight recorder takes -- with seeded numpy noise (never straight lines). Each rule must fire on
its own signature, stay quiet on healthy data and on the neighbouring classes' signatures, and be
*not evaluated* (through ``analyze()``) when its signals are absent. The builders live in
``tests/diag/memory_builders.py``, shared with the OOM and placement tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from scipy import stats as sps

from collectors.records import ServiceConfig
from diag.rules import stats
from diag.rules.base import TooLittleData
from diag.rules.engine import analyze
from diag.rules.memory import assess_service, memory_leak, memory_pressure
from diag.timeline import Series, Table
from tests.diag.memory_builders import (
    GIB,
    MIB,
    T0,
    ar1,
    build,
    cgroup_records,
    healthy_timeline,
    held,
    host_records,
    in_service,
    leak_timeline,
    load_ramp_timeline,
    pressure_timeline,
    process_records,
    request_records,
    seconds,
    service,
    warmup_timeline,
)


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
    """Requests held from arrival (queued or in service) to finish; a queue forms in front of two slots."""
    rng = np.random.default_rng(43)
    reqs = request_records(rng, T0, T0 + 60, 5.0, slots=2)
    names = ("arrival", "start", "finish", "prompt_tokens", "output_tokens")
    cols = {k: np.array([r[k] for r in reqs], dtype=float) for k in names}
    assert np.mean(cols["start"] > cols["arrival"]) > 0.5  # most requests queued: the two definitions differ
    idx = stats.LoadIndex(Table(cols))
    ts = T0 + rng.uniform(0, 60, 200)
    count, tokens = idx.at(ts)
    np.testing.assert_array_equal(count, held(reqs, ts))
    inside = (cols["arrival"][None, :] <= ts[:, None]) & (cols["finish"][None, :] > ts[:, None])
    np.testing.assert_array_equal(count, inside.sum(axis=1))
    np.testing.assert_allclose(tokens, (inside * (cols["prompt_tokens"] + cols["output_tokens"])).sum(axis=1))


def _one_slot_backlog(seed: int, leak_mib_s: float, rate: float | np.ndarray) -> Any:
    """One inference slot (0.5 s a request); memory follows the requests held (1 MiB each) plus a leak."""
    rng = np.random.default_rng(seed)
    n = 120
    ts = seconds(n)
    reqs = request_records(rng, T0, T0 + n, rate, slots=1)
    mem = 500 * MIB + 1.0 * MIB * held(reqs, ts) + leak_mib_s * MIB * (ts - T0) + ar1(rng, n, 1 * MIB)
    return service(rng, mem, ts, reqs)


def test_memory_that_rises_with_a_queue_in_front_of_one_slot_is_not_a_leak() -> None:
    """A queue growing in front of one slot holds its requests in memory while the requests in service stay one.

    Judged against the requests in service alone, the climb had no load to follow and was called a leak (7 of
    these 10 seeds); a backlog's memory follows the requests held -- the engines' running + waiting gauges say
    the same. Arrivals 2.4/s against 2/s of capacity: the queue grows ~0.4/s, to ~48 requests.
    """
    called_a_leak = []
    for seed in range(20, 30):
        tl = _one_slot_backlog(seed, 0.0, 2.4)
        f = memory_leak(tl)
        if f is not None and f.confidence >= 0.5:
            called_a_leak.append((seed, f.summary))
    assert not called_a_leak
    verdict = analyze(_one_slot_backlog(20, 0.0, 2.4))
    assert "memory_leak" not in (verdict.primary, *verdict.contributing)


def test_a_leak_behind_a_steady_queue_is_still_a_leak() -> None:
    """Counting queued requests as load does not explain a leak away: the queue comes and goes, memory climbs."""
    found = sum(
        bool(f is not None and f.cls == "memory_leak" and f.confidence >= 0.5)
        for f in (memory_leak(_one_slot_backlog(seed, 1.0, 1.6)) for seed in range(20, 30))  # 80 % busy
    )
    assert found >= 9


def _climbing_working_set(seed: int, kept_mib_s: float, shmem_mib_s: float = 0.0) -> Any:
    """A group whose working set climbs 1.5 MiB/s (troughs and all) over 90 s, of which ``kept_mib_s`` is anon and
    ``shmem_mib_s`` shmem; the rest is file pages moved to the active list (a checkpoint read again and again)."""
    rng = np.random.default_rng(seed)
    n = 90
    ts = seconds(n)
    reqs = request_records(rng, T0, T0 + n, 3.0)
    climb = (ts - T0) * MIB
    anon = 300 * MIB + kept_mib_s * climb + 10 * MIB * in_service(reqs, ts) + ar1(rng, n, 2 * MIB)
    shmem = shmem_mib_s * climb
    active_file = 200 * MIB + (1.5 - kept_mib_s - shmem_mib_s) * climb
    ws = anon + shmem + active_file
    return service(rng, ws, ts, reqs, stat={"anon": anon, "shmem": shmem, "active_file": active_file})


def test_a_working_set_that_climbs_in_page_cache_with_anon_flat_is_not_a_leak() -> None:
    """A checkpoint's pages promoted to the active list climb in the working set and stay there while nothing evicts
    them -- yet the kernel reclaims them at will: without anon or shmem carrying the climb it is no leak."""
    for seed in range(20, 30):
        tl = _climbing_working_set(seed, kept_mib_s=0.0)
        assert memory_leak(tl) is None, seed
        assessments = {a.cand.label: a for a in assess_service(tl).decisive}
        (ws,) = [a for label, a in assessments.items() if label.endswith("working_set")]
        assert any(w.startswith("page cache, not a leak") for w in ws.why_not), ws.why_not


@pytest.mark.parametrize(("anon", "shmem"), [(1.5, 0.0), (1.0, 0.0), (0.0, 1.5)], ids=["anon", "mostly-anon", "shmem"])
def test_a_working_set_climb_carried_by_anon_or_shmem_is_still_a_leak(anon: float, shmem: float) -> None:
    """Heap that grows, or a tmpfs/shared-memory segment that grows (file pages the kernel cannot reclaim without
    swap): the climb is kept memory, a leak."""
    found = [memory_leak(_climbing_working_set(seed, kept_mib_s=anon, shmem_mib_s=shmem)) for seed in range(20, 30)]
    assert sum(f is not None and f.cls == "memory_leak" for f in found) >= 9, [f and f.summary for f in found]
