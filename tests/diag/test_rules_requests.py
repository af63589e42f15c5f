"""Queue backlog vs thrashing (diag/rules/requests.py) and the load-curve / USL maths (diag/rules/usl.py).

Timelines are built from real record dataclasses (``.to_dict()``), with request timings produced by
small simulations -- a FIFO queue in front of c inference slots (open loop, Poisson arrivals) and a
closed loop of clients -- and 1 Hz host/cgroup/process samples with seeded noise. The generators
live in ``tests/diag/request_builders.py``, shared with the other request-family test files.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from diag.rules.usl import count_at, covered_time, fit_usl, time_averaged_count, usl
from tests.diag.request_builders import (
    D,
    assert_units,
    confidence,
    finding,
    lognormal,
    not_evaluated,
    request_records,
    run,
    simulate_clients,
    simulate_queue,
    telemetry,
)


def _backlog(seed: int = 1) -> list[dict]:
    """4 slots of ~200 ms (capacity ~20 req/s) under a load ramping 5 -> 30 req/s; memory calm."""
    rng = np.random.default_rng(seed)
    rows = simulate_queue(rng, D, lambda t: 5 + 25 * t / D, 4, lognormal(0.2))
    return request_records(rows) + telemetry(rng, D)


def _clients(t: float) -> int:
    return 1 + int(15 * max(t, 0.0) / D)


def _thrash_service(rng: np.random.Generator, n: int) -> float:
    """USL with sigma 0.05, kappa 0.02: X(N) = 10 N / (1 + 0.05 (N-1) + 0.02 N (N-1)), peak at N* ~ 6.9."""
    return 0.1 * (1 + 0.05 * (n - 1) + 0.02 * n * (n - 1)) * math.exp(rng.normal(0.0, 0.3))


def _over(n0: int, per: float) -> Callable[[float], float]:
    return lambda t: per * max(0, _clients(t) - n0)


def _thrash(seed: int = 2, **tele: object) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = simulate_clients(rng, D, _clients, _thrash_service)
    kwargs = {"stall": _over(5, 4.0), "faults": _over(5, 40.0), **tele}
    return request_records(rows) + telemetry(rng, D, **kwargs)  # type: ignore[arg-type]


def _healthy(seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = simulate_queue(rng, D, lambda t: 5.0 + 2 * math.sin(t / 10), 8, lognormal(0.2))
    return request_records(rows) + telemetry(rng, D)


# --------------------------------------------------------------------------- queue backlog


def test_backlog_fires_when_wait_rises_and_inference_stays_flat() -> None:
    a = run(_backlog())
    f = finding(a, "requests.queue_backlog")
    assert f is not None and f.cls == "queue_backlog"
    assert a.primary == "queue_backlog" and f.confidence >= 0.7
    assert confidence(a, "requests.thrashing") < 0.5
    values = {e.what: e.value for e in f.evidence}
    assert values["median queue wait, high-load quartile"] > 1.0  # seconds: the queue grew
    assert values["inference time inflation (worst of by-load and by-time)"] < 1.2
    assert any(r.startswith("not thrashing: inference time flat at") for r in f.rules_out)
    assert any("429" in r for r in f.remediation)
    assert f.start is not None and f.end is not None and f.start < f.end
    assert_units(f)


def test_a_wait_that_dwarfs_a_doubled_inference_is_still_a_backlog() -> None:
    """One slot; offered 5 then 8 req/s while inference doubles from 70 to 135 ms under load (CPU shared with the HTTP
    work), memory calm. The wait grows to many times the inference time: too little capacity with a contributing
    slowdown, not a coin toss."""
    rng = np.random.default_rng(7)

    def service(rng: np.random.Generator, start: float, busy: int) -> float:
        return (0.07 if start < D / 3 else 0.135) * math.exp(rng.normal(0.0, 0.1))

    rows = simulate_queue(rng, D, lambda t: 5.0 if t < D / 3 else 8.0, 1, service)
    a = run(request_records(rows) + telemetry(rng, D))
    f = finding(a, "requests.queue_backlog")
    assert f is not None and a.primary == "queue_backlog" and f.confidence >= 0.5
    values = {e.what: e.value for e in f.evidence}
    assert 1.5 <= values["inference time inflation (worst of by-load and by-time)"] < 3
    assert values["median queue wait / median inference time, high-load quartile"] >= 5
    assert "contributing slowdown" in f.summary


def test_backlog_is_not_thrashing_even_without_memory_signals() -> None:
    rng = np.random.default_rng(4)
    rows = simulate_queue(rng, D, lambda t: 5 + 25 * t / D, 4, lognormal(0.2))
    a = run(request_records(rows))
    assert a.primary == "queue_backlog"
    assert "requests.thrashing" in not_evaluated(a)  # no stall signal: not evaluated, never "healthy"
    f = finding(a, "requests.queue_backlog")
    assert f is not None and any("memory stall not evaluated" in r for r in f.rules_out)


def test_healthy_service_is_quiet() -> None:
    a = run(_healthy())
    assert finding(a, "requests.queue_backlog") is None
    assert finding(a, "requests.thrashing") is None
    assert {"requests.queue_backlog", "requests.thrashing"} <= set(a.evaluated)


def test_constant_batching_delay_is_not_a_backlog() -> None:
    """Every request waits ~150 ms for its batch to form, whatever the load: waiting, but not growing with load."""
    rng = np.random.default_rng(13)
    rows = [(a, a + 0.15 * math.exp(rng.normal(0, 0.1)), 0.0) for a, _, _ in simulate_queue(rng, D, lambda t: 3 + 12 * t / D, 64,
            lognormal(0.2))]  # fmt: skip
    rows = [(a, s, s + lognormal(0.2)(rng)) for a, s, _ in rows]
    a = run(request_records(rows) + telemetry(rng, D))
    assert finding(a, "requests.queue_backlog") is None


def test_backlog_rule_stays_below_verdict_on_thrashing() -> None:
    """Bounded slots with a queue in front: the queue grows too, but because inference slows and memory stalls."""
    rng = np.random.default_rng(5)

    def service(rng: np.random.Generator, start: float, busy: int) -> float:
        return _thrash_service(rng, busy)

    rows = simulate_queue(rng, D, lambda t: 4 + 30 * t / D, 12, service)
    busy_at = lambda t: max(0, min(12, int(4 + 30 * t / D) // 2) - 5)  # noqa: E731 -- memory follows load
    a = run(request_records(rows) + telemetry(rng, D, stall=lambda t: 4.0 * busy_at(t), faults=lambda t: 40.0 * busy_at(t)))
    assert confidence(a, "requests.queue_backlog") < 0.5
    assert a.primary == "thrashing"


# --------------------------------------------------------------------------- thrashing


def test_thrashing_fires_with_inflating_service_time_and_memory_stall() -> None:
    a = run(_thrash())
    f = finding(a, "requests.thrashing")
    assert f is not None and f.cls == "thrashing"
    assert a.primary == "thrashing" and f.confidence >= 0.7
    assert confidence(a, "requests.queue_backlog") < 0.5
    values = {e.what: e.value for e in f.evidence}
    assert values["inference time inflation (worst of by-load and by-time)"] >= 2
    kappa = values["USL kappa (coherency)"]
    n_star = values["USL N* (concurrency of peak throughput)"]
    assert kappa > 0 and 4 <= n_star <= 11  # true N* = sqrt(0.95 / 0.02) = 6.9
    assert any(r.startswith("not a plain queue backlog") for r in f.rules_out)
    assert any("not a noisy neighbour" in r for r in f.rules_out)  # the service's own cgroup stalls
    assert any("lower max concurrency" in r for r in f.remediation)
    assert_units(f)


def test_thrashing_on_host_signals_alone_when_the_service_has_no_cgroup() -> None:
    a = run(_thrash(seed=6, cgroup=False, process=False))
    f = finding(a, "requests.thrashing")
    assert f is not None and f.confidence >= 0.5 and a.primary == "thrashing"


def test_slowdown_without_memory_stall_is_not_thrashing() -> None:
    """Service time inflates with concurrency (CPU/batch contention) but PSI and faults stay flat."""
    a = run(_thrash(seed=7, stall=lambda t: 0.0, faults=lambda t: 0.5))
    assert confidence(a, "requests.thrashing") < 0.5
    f = finding(a, "requests.thrashing")
    assert f is not None and any("not thrashing" in r for r in f.rules_out)


def test_host_pressure_with_a_calm_service_cgroup_points_to_a_neighbour() -> None:
    a = run(_thrash(seed=8, stall=lambda t: 0.0, faults=lambda t: 0.5, host_stall=_over(5, 4.0), host_faults=_over(5, 40.0)))
    assert confidence(a, "requests.thrashing") < 0.5
    f = finding(a, "requests.thrashing")
    assert f is not None and any("noisy neighbour" in r for r in f.rules_out)


def test_thrashing_not_evaluated_without_stall_signals_and_both_without_requests() -> None:
    rng = np.random.default_rng(9)
    only_requests = run(request_records(simulate_clients(rng, D, _clients, _thrash_service)))
    missing = not_evaluated(only_requests)
    assert "requests.thrashing" in missing and "requests.queue_backlog" not in missing
    assert any("psi.memory.some.avg10" in m for m in missing["requests.thrashing"])
    only_host = run(telemetry(rng, D))
    assert {"requests.thrashing", "requests.queue_backlog"} <= set(not_evaluated(only_host))


def test_too_few_requests_is_no_verdict() -> None:
    rng = np.random.default_rng(10)
    rows = simulate_queue(rng, 5.0, lambda t: 3.0, 1, lognormal(0.5))[:20]
    a = run(request_records(rows) + telemetry(rng, 5.0))
    assert finding(a, "requests.queue_backlog") is None and finding(a, "requests.thrashing") is None


# --------------------------------------------------------------------------- the maths


def test_time_averaged_count_and_count_at_match_brute_force() -> None:
    rng = np.random.default_rng(11)
    starts = rng.uniform(0, 50, 400)
    ends = starts + rng.exponential(2.0, 400)
    edges = np.arange(0.0, 61.0, 1.0)
    fine = np.arange(0.0, 60.0, 0.001) + 0.0005  # 1 ms grid: a Riemann sum of the in-flight count
    inflight = ((starts[None, :] <= fine[:, None]) & (fine[:, None] < ends[None, :])).sum(1)
    expected = inflight.reshape(60, 1000).mean(1)
    assert np.allclose(time_averaged_count(starts, ends, edges), expected, atol=0.02)
    probe = rng.uniform(0, 60, 50)
    brute = ((starts[None, :] <= probe[:, None]) & (probe[:, None] < ends[None, :])).sum(1)
    assert np.array_equal(count_at(probe, starts, ends), brute.astype(float))


def test_covered_time_merges_overlaps() -> None:
    starts = np.array([0.0, 1.0, 10.0])
    ends = np.array([2.0, 3.0, 11.0])  # union: [0, 3] and [10, 11]
    got = covered_time(starts, ends, np.array([-1.0, 2.5, 0.0, 20.0]), np.array([1.0, 10.5, 20.0, 21.0]))
    assert np.allclose(got, [1.0, 1.0, 4.0, 0.0])


def test_usl_fit_recovers_contention_and_coherency() -> None:
    rng = np.random.default_rng(12)
    n = np.repeat(np.arange(1, 17, dtype=float), 6) + rng.normal(0, 0.1, 96)
    x = usl(n, 10.0, 0.05, 0.02) * np.exp(rng.normal(0, 0.05, n.size))
    fit = fit_usl(n, x)
    assert fit is not None
    assert fit.sigma == pytest.approx(0.05, abs=0.05) and fit.kappa == pytest.approx(0.02, rel=0.35)
    assert fit.n_star == pytest.approx(math.sqrt(0.95 / 0.02), rel=0.25) and fit.retrograde and fit.r2 > 0.8
    flat = fit_usl(n, usl(n, 10.0, 0.3, 0.0) * np.exp(rng.normal(0, 0.02, n.size)))
    assert flat is not None and not flat.retrograde  # contention only: throughput flattens, never falls
    assert fit_usl(np.array([1.0, 1, 2, 2, 3, 3]), np.array([1.0, 1, 2, 2, 3, 3])) is None  # < 4 levels
