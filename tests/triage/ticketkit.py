"""Helpers for the sink tests: a store with incidents driven by real webhook bodies, the outbox driven by hand or
on its thread, polling with a deadline, and a sink wrapper that dies right after the tracker created a ticket."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diag.triage import lifecycle, payload
from diag.triage.outbox import Dispatcher
from diag.triage.sinks import Notice, Sink, Ticket
from diag.triage.store import connect, transaction
from tests.triage.helpers import alert, body

LABELS = {"alertname": "KVCachePressure", "job": "llm", "instance": "10.0.0.5:8000"}


def apply(db: Any, policy: lifecycle.Policy, doc: dict[str, Any], now: float) -> list[str]:
    with transaction(db):
        return lifecycle.apply(db, policy, payload.parse(json.dumps(doc).encode()), now)


def fire(db: Any, policy: lifecycle.Policy, now: float, labels: dict[str, str] = LABELS, **annotations: str) -> None:
    apply(db, policy, body(alert(labels, starts=now, **annotations)), now)


def resolve(db: Any, policy: lifecycle.Policy, starts: float, now: float, labels: dict[str, str] = LABELS) -> None:
    apply(db, policy, body(alert(labels, "resolved", starts=starts)), now)


def drain(dispatcher: Dispatcher, rounds: int = 20) -> None:
    """Send everything that is due now (driving the dispatcher by hand: start=False)."""
    for _ in range(rounds):
        if not dispatcher.drain_once():
            return


def wait_until(check: Callable[[], Any], timeout_s: float = 20.0, every_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"not true within {timeout_s}s: {check}")


def outbox(db: Any) -> list[dict[str, Any]]:
    return [dict(r) for r in db.execute("SELECT * FROM outbox ORDER BY id")]


def store(tmp_path: Path, sinks: tuple[str, ...], hold_down_s: float = 0.0) -> tuple[Any, lifecycle.Policy, Path]:
    path = tmp_path / "triage.db"
    return connect(path), lifecycle.Policy(hold_down_s=hold_down_s, reopen_window_s=3600, sinks=sinks), path


class Crash(BaseException):
    """The receiver dying: not an Exception, so nothing on the way catches it."""


class DiesAfterCreate:
    """A sink whose process dies right after the tracker created the ticket, before the id is stored."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.name = sink.name

    @property
    def lookup_settle_s(self) -> float:
        return self.sink.lookup_settle_s

    def find(self, marker: str) -> Ticket | None:
        return self.sink.find(marker)

    def create(self, notice: Notice) -> Ticket:
        self.sink.create(notice)
        raise Crash()

    def comment(self, ticket: Ticket, notice: Notice) -> None:
        self.sink.comment(ticket, notice)

    def close(self, ticket: Ticket, notice: Notice) -> None:
        self.sink.close(ticket, notice)

    def reopen(self, ticket: Ticket, notice: Notice) -> None:
        self.sink.reopen(ticket, notice)
