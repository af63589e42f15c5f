"""Short windows: a backlog decided on overwhelming per-request evidence, seconds of data being enough."""

from __future__ import annotations

from typing import Any

from diag.rules.base import Finding, TooLittleData
from diag.rules.engine import analyze
from diag.rules.requests import queue_backlog
from diag.timeline import timeline_from_records

T0 = 1_700_000_000.0


def _single_slot(n: int, clients: int, service_s: float, *, gap_s: float = 0.0) -> list[dict[str, Any]]:
    """A one-slot server and ``clients`` closed-loop clients (each sends again when answered, after ``gap_s``)."""
    free_at = T0
    ready = [T0 + 0.001 * c for c in range(clients)]  # when each client sends next
    rows: list[dict[str, Any]] = []
    for i in range(n):
        c = min(range(clients), key=lambda k: ready[k])
        arrival = ready[c]
        start = max(arrival, free_at)
        finish = start + service_s * (1 + 0.05 * (i % 3))
        free_at = finish
        ready[c] = finish + gap_s
        rows.append({"kind": "request", "ts": finish, "arrival": arrival, "start": start, "finish": finish,
                     "outcome": "ok", "pid": 7})  # fmt: skip
    return rows


def test_seven_seconds_of_overload_is_a_backlog() -> None:
    rows = _single_slot(64, clients=8, service_s=0.1)
    tl = timeline_from_records(rows)
    assert tl.duration_s < 8
    f = queue_backlog(tl)
    assert isinstance(f, Finding) and f.confidence >= 0.6, f
    assert "never emptied" in f.summary
    assert analyze(tl).primary == "queue_backlog"


def test_clients_that_pause_leave_the_queue_empty_and_no_backlog_is_claimed() -> None:
    rows = _single_slot(64, clients=2, service_s=0.1, gap_s=0.5)  # the slot idles between requests
    assert queue_backlog(timeline_from_records(rows)) is None


def test_too_few_requests_say_how_many_are_needed() -> None:
    result = queue_backlog(timeline_from_records(_single_slot(12, clients=8, service_s=0.1)))
    assert isinstance(result, TooLittleData) and result.needed == "30 started requests"
