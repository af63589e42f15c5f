"""Inference deadlines on the event loop: one timer per tracker and loop, not one per request.

Why: ``asyncio.timeout`` per request builds a ``Timeout``, a ``TimerHandle`` (with a copy of the
context), pushes it on the loop's heap and cancels it again when the inference ends in time --
almost always. Here a request appends a small entry to a deque and marks it done when its
inference ends; one ``loop.call_at`` timer, armed for the earliest pending deadline, cancels the
tasks whose deadline passed. Entries that ended are dropped from the front as new ones arrive, so
the deque holds about the requests in flight.

Cancellation follows ``asyncio.timeout``: the expired task is cancelled, and the request turns the
``CancelledError`` into its timeout only when this sweeper caused it and nothing else asked to
cancel the task meanwhile (``Task.uncancel`` back to the count it had on entry).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any


class Deadline:
    """One request's inference deadline (``perf_counter`` seconds) on a :class:`DeadlineSweeper`."""

    __slots__ = ("at", "cancelling", "done", "expired", "task")

    def __init__(self, at: float, task: asyncio.Task[Any]) -> None:
        self.at = at
        self.task = task
        self.cancelling = task.cancelling()
        self.done = False
        self.expired = False

    def timed_out(self) -> bool:
        """After a ``CancelledError``: True when this deadline caused it and no other cancellation is pending."""
        return self.expired and self.task.uncancel() <= self.cancelling


class DeadlineSweeper:
    """The pending deadlines of one loop, and the one timer that enforces them. Event-loop thread only."""

    __slots__ = ("_armed_at", "_handle", "_pending", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: collections.deque[Deadline] = collections.deque()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = float("inf")

    def add(self, at: float, task: asyncio.Task[Any]) -> Deadline:
        """Enforce ``at`` (a ``time.perf_counter()`` instant) on ``task``; mark the entry ``done`` when the work ends."""
        pending = self._pending
        while pending and pending[0].done:
            pending.popleft()
        entry = Deadline(at, task)
        pending.append(entry)
        if at < self._armed_at:
            self._arm(at)
        return entry

    def _arm(self, at: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_at = at
        # the loop's clock is monotonic, not perf_counter: convert with the offset of now
        self._handle = self.loop.call_at(self.loop.time() + (at - time.perf_counter()), self._sweep)

    def _sweep(self) -> None:
        self._handle = None
        self._armed_at = float("inf")
        now = time.perf_counter()
        kept: collections.deque[Deadline] = collections.deque()
        earliest = float("inf")
        for entry in self._pending:
            if entry.done:
                continue
            if entry.at <= now:
                entry.expired = True
                entry.done = True
                entry.task.cancel()
                continue
            kept.append(entry)
            earliest = min(earliest, entry.at)
        self._pending = kept
        if kept:
            self._arm(earliest)
