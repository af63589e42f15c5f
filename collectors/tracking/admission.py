"""Admission control: inference slots, a bounded FIFO wait queue, and the refusals they produce.

Why one slot pool for both worlds: a FastAPI service runs ``async def`` handlers on the event loop
and ``def`` handlers in a thread pool, and both may drive the same model. A plain
``asyncio.Semaphore`` cannot be waited on from a thread and a ``threading.Semaphore`` would block
the loop, so :class:`SlotPool` is a small hand-off semaphore guarded by a ``threading.Lock`` whose
waiters are either asyncio futures (woken with ``call_soon_threadsafe``) or thread events. It is
FIFO across both kinds: a released slot is handed *directly* to the oldest waiter (it never
becomes free in between, so a newcomer cannot barge in front of the queue), and the fast path
(a free slot) is taken only when nobody is waiting.

Refusals and what they mean to a client (``status_code`` / ``Retry-After``):

============================  ======  =================  ==========================================
exception                     status  ``outcome``        when
============================  ======  =================  ==========================================
``AdmissionRejected``         429     ``rejected``       the wait queue is full (``reason="queue_full"``)
``AdmissionRejected``         503     ``rejected``       the memory guard refuses new work
                                                         (``reason="memory_watermark"`` / ``"memory_psi"``)
``QueueTimeout``              503     ``queue_timeout``  waited ``queue_timeout_s`` without a slot
(subclass of AdmissionRejected)
``InferenceTimeout``          504     ``inference_timeout`` inference ran past ``inference_timeout_s``
============================  ======  =================  ==========================================

429 says "you (the client population) are sending too much": back off and retry. 503 says "this
server cannot take work right now" (memory, or a backlog it could not drain in time): retry later,
possibly elsewhere. A queue timeout is a 503 rather than a 504 because no inference ran: the
request may be retried safely. 504 marks work that started and was abandoned.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

from collectors.records import RequestOutcome


@dataclass(frozen=True)
class AdmissionConfig:
    """What the tracker enforces. Every field ``None`` (the default) means *observe only*.

    - ``max_concurrency``: inference slots (requests between ``acquire()`` and the end of the
      ``with`` block) per process. ``None`` = unlimited; waits are then always ~0.
    - ``queue_size``: how many requests may wait for a slot; one more is refused with 429.
      ``None`` = unbounded, ``0`` = no queue (refuse whenever all slots are busy).
    - ``queue_timeout_s``: longest wait for a slot before :class:`QueueTimeout` (503).
    - ``inference_timeout_s``: budget from slot grant to the end; enforced by ``req.run()`` (async)
      and ``req.check_deadline()`` (sync), raising :class:`InferenceTimeout` (504).
    - ``memory_high_watermark``: fraction 0-1 of memory in use above which *new* requests are
      refused with 503 (queued and running ones continue). Memory is the own cgroup's working set
      over its limit when a limit is set (v1 or v2), else host (MemTotal - MemAvailable) / MemTotal.
    - ``psi_memory_some_avg10``: percent (0-100); refuse new work while memory PSI ``some avg10``
      (the own cgroup2 group's ``memory.pressure`` when present, else /proc/pressure/memory) is above.
    - ``retry_after_s``: the ``Retry-After`` hint sent with every refusal.
    - ``memory_cache_s``: how long one memory/PSI reading is reused (it is never read per request).
    """

    max_concurrency: int | None = None
    queue_size: int | None = None
    queue_timeout_s: float | None = None
    inference_timeout_s: float | None = None
    memory_high_watermark: float | None = None
    psi_memory_some_avg10: float | None = None
    retry_after_s: float = 1.0
    memory_cache_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1 (or None for unlimited)")
        if self.queue_size is not None and self.queue_size < 0:
            raise ValueError("queue_size must be >= 0 (or None for unbounded)")
        for name in ("queue_timeout_s", "inference_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (or None)")
        if self.memory_high_watermark is not None and not 0.0 <= self.memory_high_watermark <= 1.0:
            raise ValueError("memory_high_watermark is a fraction between 0 and 1")
        if self.psi_memory_some_avg10 is not None and not 0.0 <= self.psi_memory_some_avg10 <= 100.0:
            raise ValueError("psi_memory_some_avg10 is a percentage between 0 and 100")
        if self.retry_after_s < 0 or self.memory_cache_s < 0:
            raise ValueError("retry_after_s and memory_cache_s must be >= 0")

    @property
    def memory_guard_enabled(self) -> bool:
        return self.memory_high_watermark is not None or self.psi_memory_some_avg10 is not None


class AdmissionRejected(Exception):
    """The request was refused before inference.

    Attributes for the HTTP layer: ``status_code`` (429 or 503), ``retry_after_s`` (send it as
    ``Retry-After``), ``outcome`` (what the request is counted as) and ``reason`` (a short
    machine-readable word: ``queue_full``, ``memory_watermark``, ``memory_psi``, ``queue_timeout``).
    ``instrument_fastapi`` installs a handler that turns it into that response.
    """

    def __init__(
        self,
        reason: str,
        status_code: int,
        retry_after_s: float,
        detail: str = "",
        outcome: RequestOutcome = "rejected",
    ) -> None:
        super().__init__(detail or reason)
        self.reason = reason
        self.status_code = status_code
        self.retry_after_s = retry_after_s
        self.outcome: RequestOutcome = outcome
        self.detail = detail or reason


class QueueTimeout(AdmissionRejected):
    """Waited ``queue_timeout_s`` for an inference slot and did not get one (503, outcome ``queue_timeout``)."""

    def __init__(self, waited_s: float, retry_after_s: float) -> None:
        super().__init__(
            "queue_timeout", 503, retry_after_s, f"no inference slot within {waited_s:.3f} s", outcome="queue_timeout"
        )
        self.waited_s = waited_s


class InferenceTimeout(Exception):
    """Inference ran past ``inference_timeout_s`` (504, outcome ``inference_timeout``)."""

    status_code = 504
    outcome: RequestOutcome = "inference_timeout"
    reason = "inference_timeout"

    def __init__(self, budget_s: float) -> None:
        super().__init__(f"inference exceeded its {budget_s:.3f} s budget")
        self.budget_s = budget_s
        self.retry_after_s: float | None = None


# --------------------------------------------------------------------------- the slot pool


class _Waiter:
    """One queued request: an asyncio future (with its loop) or a thread event.

    ``on_leave`` runs (under the pool lock) at the moment the waiter leaves the queue -- granted,
    timed out or cancelled -- not when its task next runs: a queue-depth gauge that counted a
    granted waiter until its coroutine resumed would read above ``queue_size``.
    """

    __slots__ = ("event", "future", "granted", "loop", "on_leave")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None,
        future: asyncio.Future[None] | None,
        event: threading.Event | None,
        on_leave: Callable[[], None] | None = None,
    ) -> None:
        self.loop = loop
        self.future = future
        self.event = event
        self.granted = False
        self.on_leave = on_leave

    def left(self) -> None:
        if self.on_leave is not None:
            with contextlib.suppress(Exception):  # a metrics hook must never break admission
                self.on_leave()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class QueueFull(Exception):
    """Internal: the wait queue is at its bound."""


class SlotPool:
    """Counting hand-off semaphore, FIFO across asyncio tasks and threads (see the module docstring).

    ``limit`` None means unlimited (it only counts); ``queue_size`` None means unbounded.
    All state changes happen under one short ``threading.Lock``; no I/O and no waiting under it.
    """

    def __init__(self, limit: int | None, queue_size: int | None) -> None:
        self.limit = limit
        self.queue_size = queue_size
        self.active = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def queue_full(self) -> bool:
        """True when one more request that needs to wait would be refused."""
        if self.limit is None or self.queue_size is None:
            return False
        return self.active >= self.limit and len(self._waiters) >= self.queue_size

    def try_acquire(self) -> bool:
        """Take a free slot if there is one and nobody is queued (FIFO). Never blocks."""
        with self._lock:
            if self.limit is None or (self.active < self.limit and not self._waiters):
                self.active += 1
                return True
            return False

    def enqueue(
        self,
        loop: asyncio.AbstractEventLoop | None,
        on_enter: Callable[[], None] | None = None,
        on_leave: Callable[[], None] | None = None,
    ) -> _Waiter | None:
        """Join the queue. Returns None if a slot was free after all (it is taken), raises QueueFull at the bound.

        ``on_enter`` / ``on_leave`` run under the pool lock when the waiter joins and when it leaves
        the queue (granted, timed out, cancelled): exactly once each, in that order.
        """
        with self._lock:
            if self.limit is None or (self.active < self.limit and not self._waiters):
                self.active += 1
                return None
            if self.queue_size is not None and len(self._waiters) >= self.queue_size:
                raise QueueFull
            if loop is not None:
                waiter = _Waiter(loop, loop.create_future(), None, on_leave)
            else:
                waiter = _Waiter(None, None, threading.Event(), on_leave)
            self._waiters.append(waiter)
            if on_enter is not None:
                with contextlib.suppress(Exception):
                    on_enter()
            return waiter

    def abandon(self, waiter: _Waiter) -> bool:
        """Leave the queue (timeout, cancellation). Returns True if the slot was granted meanwhile:
        the caller then owns a slot and must use or release it."""
        with self._lock:
            if waiter.granted:
                return True
            try:
                self._waiters.remove(waiter)
            except ValueError:  # not queued (any more): nothing left it here
                return False
            waiter.left()
            return False

    def release(self) -> None:
        """Give a slot back: straight to the oldest waiter if there is one, else free it."""
        with self._lock:
            if self._waiters:
                waiter = self._waiters.popleft()
                waiter.granted = True
                waiter.left()
            else:
                if self.active > 0:
                    self.active -= 1
                return
        # Wake outside the lock: the waiter re-checks ``granted`` under the lock anyway.
        if waiter.event is not None:
            waiter.event.set()
        elif waiter.loop is not None and waiter.future is not None:
            try:
                waiter.loop.call_soon_threadsafe(_resolve, waiter.future)
            except RuntimeError:  # its loop is closed: nobody will use the slot, pass it on
                self.release()

    async def wait_async(self, waiter: _Waiter, timeout_s: float | None) -> bool:
        """Wait for a grant. True = slot owned; False = timed out (already removed from the queue).
        On cancellation a slot granted meanwhile is passed on before CancelledError propagates."""
        assert waiter.future is not None
        try:
            if timeout_s is None:
                await waiter.future
            else:
                async with asyncio.timeout(timeout_s):
                    await waiter.future
            return True
        except TimeoutError:
            return self.abandon(waiter)
        except asyncio.CancelledError:
            if self.abandon(waiter):
                self.release()
            raise

    def wait_sync(self, waiter: _Waiter, timeout_s: float | None) -> bool:
        """Thread-side twin of :meth:`wait_async`."""
        assert waiter.event is not None
        if waiter.event.wait(timeout_s):
            return True
        return self.abandon(waiter)
