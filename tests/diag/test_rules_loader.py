"""Blocking loader refresh (diag/rules/loader.py) on simulated timelines built from real records.

The blocking signature is simulated the way the demo's ``--refresh every-request`` produces it: the
re-read runs synchronously on the single event loop inside the handler, before the request asks for
a slot -- so each load sits in its request's arrival -> start window, and loads queue behind each other.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from collectors.records import LoaderEvent
from tests.diag.request_builders import (
    PID,
    T0,
    D,
    Row,
    assert_units,
    confidence,
    finding,
    lognormal,
    not_evaluated,
    request_records,
    run,
    simulate_queue,
    telemetry,
)

WEIGHTS = 64 << 20


def _startup_loads(pid: int = PID) -> list[dict]:
    return [
        LoaderEvent(ts=T0 - 8 + i, name="load-weights", start=T0 - 8 + i, duration_s=0.4, bytes_read=WEIGHTS,
                    cache_hit=False, in_request_path=False, pid=pid).to_dict()
        for i in range(2)
    ]  # fmt: skip


def _blocking(seed: int, flag: bool = True, rate: float = 2.5) -> tuple[list[Row], list[dict]]:
    """Every request re-reads the checkpoint (~250 ms) on the event loop, then takes one of 8 slots."""
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    loads: list[dict] = []
    loop_free = 0.0
    slots = [0.0] * 8
    t = 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t > D:
            break
        ls = max(t, loop_free)
        d = 0.25 * math.exp(rng.normal(0, 0.2))
        loop_free = ls + d
        start = max(loop_free, heapq.heappop(slots))
        s = lognormal(0.15)(rng)
        heapq.heappush(slots, start + s)
        rows.append((t, start, start + s))
        loads.append(
            LoaderEvent(ts=T0 + ls, name="registry-refresh", start=T0 + ls, duration_s=d, bytes_read=WEIGHTS,
                        cache_hit=False, in_request_path=flag, pid=PID).to_dict()
        )  # fmt: skip
    return rows, loads


def test_refresh_per_request_is_found_and_outranks_backlog() -> None:
    rows, loads = _blocking(1)
    rng = np.random.default_rng(1)
    a = run(request_records(rows) + loads + _startup_loads() + telemetry(rng, D))
    f = finding(a, "loader.blocking_refresh")
    assert f is not None and f.cls == "blocking_loader_refresh"
    assert a.primary == "blocking_loader_refresh" and f.confidence >= 0.8
    values = {e.what: e.value for e in f.evidence}
    assert values["on-path loads per request"] >= 0.9  # ~ one refresh per request
    assert values["share of all queue wait spent while an on-path load ran"] >= 0.5
    assert values["start-up loads before the first request (not counted)"] == 2
    assert values["bytes read by on-path loads"] == WEIGHTS * len(loads)
    assert any("not a capacity backlog" in r for r in f.rules_out)
    assert any("TTL" in r for r in f.remediation)
    assert confidence(a, "requests.queue_backlog") < 0.5  # the wait *is* the loader
    assert_units(f)


def test_overlap_alone_finds_loads_a_writer_did_not_flag() -> None:
    """A third-party writer that never sets in_request_path: the arrival -> start overlap still shows it."""
    rows, loads = _blocking(2, flag=False)
    a = run(request_records(rows) + loads)
    f = finding(a, "loader.blocking_refresh")
    assert f is not None and f.confidence >= 0.7


def test_background_ttl_refresh_is_quiet() -> None:
    """A healthy service near capacity: start-up loads, then a short background refresh every 5 s. Several
    coincide with requests waiting for a slot (flagged in_request_path, as the tracker does), but they are
    a handful against ~1600 requests and cover a sliver of the waiting."""
    rng = np.random.default_rng(3)
    rows = simulate_queue(rng, D, lambda t: 18.0, 4, lognormal(0.2))
    waiting = [(a, s) for a, s, _ in rows if s is not None and s - a > 0.02]
    loads = _startup_loads()
    for at in np.arange(2.0, D, 5.0):
        busy = any(a <= at < s for a, s in waiting)
        loads.append(LoaderEvent(ts=T0 + at, name="registry-refresh", start=T0 + at, duration_s=0.02, bytes_read=1 << 20,
                                 cache_hit=True, in_request_path=busy, pid=PID).to_dict())  # fmt: skip
    assert sum(ld["in_request_path"] for ld in loads) >= 3  # the quiet verdict is not for lack of on-path loads
    a = run(request_records(rows) + loads)
    assert finding(a, "loader.blocking_refresh") is None
    assert "loader.blocking_refresh" in a.evaluated


def test_startup_loads_only_on_a_backlogged_service_are_quiet() -> None:
    rng = np.random.default_rng(4)
    rows = simulate_queue(rng, D, lambda t: 5 + 25 * t / D, 4, lognormal(0.2))
    a = run(request_records(rows) + _startup_loads())
    assert finding(a, "loader.blocking_refresh") is None
    assert a.primary == "queue_backlog"
    backlog = finding(a, "requests.queue_backlog")
    assert backlog is not None and any("not a blocking loader" in r for r in backlog.rules_out)


def test_not_evaluated_without_loader_events_or_requests() -> None:
    rows, loads = _blocking(5)
    without_loader = run(request_records(rows))
    assert "loader.blocking_refresh" in not_evaluated(without_loader)
    without_requests = run(loads)
    assert not_evaluated(without_requests)["loader.blocking_refresh"] == ["requests"]


def test_a_reload_in_one_worker_does_not_block_another_workers_queue() -> None:
    """Worker 2 reloads (unflagged) while worker 1's requests queue: matched per pid, not on anyone's path."""
    rng = np.random.default_rng(6)
    backlogged = simulate_queue(rng, D, lambda t: 5 + 25 * t / D, 4, lognormal(0.2))
    idle = simulate_queue(rng, D, lambda t: 2.0, 8, lognormal(0.2))
    loads = [
        LoaderEvent(ts=T0 + at, name="registry-refresh", start=T0 + at, duration_s=0.5, bytes_read=WEIGHTS,
                    cache_hit=False, in_request_path=False, pid=PID + 1).to_dict()
        for at in np.arange(30.0, D, 1.0)
    ]  # fmt: skip
    records = request_records(backlogged) + request_records(idle, pid=PID + 1) + loads
    a = run(records)
    assert finding(a, "loader.blocking_refresh") is None
    # the same loads attributed to the backlogged worker do sit in its requests' waits
    for ld in loads:
        ld["pid"] = PID
    assert finding(run(records), "loader.blocking_refresh") is not None
