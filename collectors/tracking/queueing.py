"""Admission and queueing: who gets an inference slot, who waits, who is refused -- and who is waiting now.

Why apart from recording: deciding a request's fate (slots, the wait queue, the memory guard) and
reporting on it (metrics, spans, the flight recorder) change for different reasons and are tested
differently. :class:`AdmissionControl` knows nothing of Prometheus, OpenTelemetry or SQLite; what it
observes leaves through two callbacks (``on_reading`` for each new memory reading, ``on_error`` for
a probe failure), which the tracker wires to the recording side.

It also keeps the *arrival windows* of in-flight requests (arrival -> slot granted): a loader that
ran while one of them was open sat on the request path (see ``loader``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from collectors.tracking import spans as sp
from collectors.tracking.admission import AdmissionConfig, QueueFull, SlotPool
from collectors.tracking.deadlines import DeadlineSweeper
from collectors.tracking.memory import MemoryProbe, MemoryReading

__all__ = ["AdmissionControl", "QueueFull"]


class AdmissionControl(SlotPool):
    """Slots, the FIFO wait queue, the memory guard, and the open arrival windows of one tracker.

    It *is* the tracker's :class:`SlotPool` (``try_acquire``, ``enqueue``, ``release``, ``active``,
    ``waiting``, ``queue_full`` are the pool's own: no extra call on the request path) with the
    config's limits and timeouts applied. The request-path calls take no lock beyond the pool's and
    do no I/O; the memory guard reads at most once per ``config.memory_cache_s``.
    """

    def __init__(
        self,
        config: AdmissionConfig,
        *,
        memory_probe: MemoryProbe | None = None,
        on_reading: Callable[[MemoryReading, bool], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(config.max_concurrency, config.queue_size)
        self.config = config
        self.guard_enabled = config.memory_guard_enabled
        self._probe = memory_probe
        self._on_reading = on_reading
        self._on_error = on_error
        self._last_reading: MemoryReading | None = None
        self._windows: dict[int, sp.Arrival] = {}
        self._sweeper: DeadlineSweeper | None = None

    # ------------------------------------------------------------------ arrival windows

    def opened(self, arrival: sp.Arrival) -> None:
        """A request arrived and has no slot yet: its window is open."""
        self._windows[id(arrival)] = arrival

    def closed(self, arrival: sp.Arrival) -> None:
        """The request got its slot or ended: its window is closed (idempotent)."""
        arrival.started = True
        self._windows.pop(id(arrival), None)

    def waiting_since_before(self, mono: float) -> bool:
        """True if an in-flight request arrived at or before ``mono`` and still has no slot."""
        return any(a.mono <= mono and not a.started for a in list(self._windows.values()))

    # ------------------------------------------------------------------ waiting, with the configured timeout

    async def wait_for_slot(self, waiter: Any) -> bool:
        """Wait for the slot on the event loop; False after ``queue_timeout_s`` (the waiter left the queue)."""
        return await self.wait_async(waiter, self.config.queue_timeout_s)

    def wait_for_slot_sync(self, waiter: Any) -> bool:
        """Thread-side :meth:`wait_for_slot` (blocks this thread)."""
        return self.wait_sync(waiter, self.config.queue_timeout_s)

    def deadlines(self, loop: asyncio.AbstractEventLoop) -> DeadlineSweeper:
        """The inference-deadline sweeper of ``loop`` (one per tracker: a tracker serves one event loop; should it
        move to another, the old sweeper still enforces what it holds on its own loop)."""
        sweeper = self._sweeper
        if sweeper is None or sweeper.loop is not loop:
            sweeper = self._sweeper = DeadlineSweeper(loop)
        return sweeper

    # ------------------------------------------------------------------ the memory guard

    def refusal(self) -> tuple[str, str] | None:
        """``(reason, detail)`` when the memory guard refuses new work now, else None (also when it is off)."""
        if not self.guard_enabled:
            return None
        reading = self.reading()
        return None if reading is None else self.refusal_at(reading)

    def reading(self) -> MemoryReading | None:
        """The current (cached) memory reading, or None when the probe failed."""
        try:
            if self._probe is None:
                self._probe = MemoryProbe(self.config.memory_cache_s)
            reading = self._probe.read()
        except Exception:
            self._report_error("memory_probe")
            return None
        if reading is not self._last_reading:
            self._last_reading = reading
            if reading.error:
                self._report_error("memory_probe")
            if self._on_reading is not None:
                try:
                    self._on_reading(reading, self.guard_enabled and self.refusal_at(reading) is not None)
                except Exception:
                    self._report_error("metrics")
        return reading

    def refusal_at(self, reading: MemoryReading) -> tuple[str, str] | None:
        """(reason, detail) when the guard refuses new work at this reading. Unknown values admit (fail open)."""
        cfg = self.config
        ratio = reading.used_ratio
        if cfg.memory_high_watermark is not None and ratio is not None and ratio > cfg.memory_high_watermark:
            return "memory_watermark", (
                f"memory {ratio * 100:.1f}% of {reading.source} is above the {cfg.memory_high_watermark * 100:.1f}% watermark"
            )
        psi = reading.psi_some_avg10
        if cfg.psi_memory_some_avg10 is not None and psi is not None and psi > cfg.psi_memory_some_avg10:
            return "memory_psi", f"memory PSI some avg10 {psi:.2f}% is above {cfg.psi_memory_some_avg10:.2f}%"
        return None

    # ------------------------------------------------------------------ lifecycle

    def after_fork(self) -> None:
        """In a forked child: a fresh pool (the parent's lock may be held) and no inherited windows."""
        SlotPool.__init__(self, self.config.max_concurrency, self.config.queue_size)
        self._windows = {}
        self._sweeper = None
        self._probe = None
        self._last_reading = None

    def _report_error(self, stage: str) -> None:
        if self._on_error is not None:
            with contextlib.suppress(Exception):  # never into the app
                self._on_error(stage)
