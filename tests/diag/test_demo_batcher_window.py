"""The reference backend's batching window: a batch short of what recent batches held waits a little for the rest.

Why this matters: closed-loop clients resubmit as soon as their answers arrive, so one job reaching the
queue a moment after the fixed window misses its batch and waits a whole batch; with request tracking on
the event loop that happened often enough to make every batch smaller and the tracked backend slower.
These drive ``Batcher._take_batch`` directly (no model thread), with a job appended from another thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from diag.demo import batcher as batcher_module
from diag.demo.batcher import Batcher, _Job


@pytest.fixture
def long_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cap far above every wait these tests expect, so that going at the deadline and going early differ by
    seconds, not by a scheduler's hiccup."""
    monkeypatch.setattr(batcher_module, "MAX_EXTRA_WAIT_S", 5.0)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _job(loop: asyncio.AbstractEventLoop) -> _Job:
    return _Job([1, 2, 3], 4, loop, loop.create_future())


def _batcher(recent: list[int], step_s: float) -> Batcher:
    batcher = Batcher(lambda: None, mode="requests", max_batch_requests=8, batch_wait_s=0.002)  # type: ignore[arg-type, return-value]
    batcher._recent_sizes.extend(recent)
    batcher._step_s = step_s
    return batcher


LATE_S = 2.5  # a job that comes this late joins only a batch that waits seconds, far past a half step or the cap


def _append_later(batcher: Batcher, job: _Job, after_s: float, unless: threading.Event | None = None) -> threading.Thread:
    """Append ``job`` after ``after_s`` -- or never, when ``unless`` is set first (the batch went without it: the test
    then never waits out ``after_s``, and a batcher that waited that long would still be caught taking it)."""

    def append() -> None:
        if unless is None:
            time.sleep(after_s)
        elif unless.wait(after_s):
            return
        with batcher._cond:
            batcher._queue.append(job)
            batcher._cond.notify()

    thread = threading.Thread(target=append)
    thread.start()
    return thread


def _record_waits(batcher: Batcher) -> list[float | None]:
    """The timeout of each wait on the batcher's condition, as the batcher asked for it."""
    waits: list[float | None] = []
    wait = batcher._cond.wait

    def recorded(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return wait(timeout)

    batcher._cond.wait = recorded  # type: ignore[method-assign]
    return waits


def test_a_late_job_joins_a_batch_short_of_the_recent_size(loop: asyncio.AbstractEventLoop, long_cap: None) -> None:
    batcher = _batcher([4] * 8, step_s=10.0)  # the window: half a step, 5 s
    batcher._queue.extend(_job(loop) for _ in range(3))
    late = _job(loop)
    thread = _append_later(batcher, late, 0.012)  # after the fixed 2 ms window, well inside the extension
    started = time.monotonic()
    batch = batcher._take_batch()
    elapsed = time.monotonic() - started
    thread.join()
    assert batch is not None
    assert len(batch) == 4 and batch[-1] is late
    assert elapsed < 2.5  # it went when the fourth came, not at the 5 s deadline


# The two below judge the wait by the timeout the batcher asked its condition for, not by a stopwatch, and give the
# late job no deadline to race: with a job appended 0.3 s later and a 0.25 s limit on the take, a test thread that
# a loaded host stalled that long would fail a batcher that waited only its 5 ms (the job queued by the time it ran).
# A stall only makes a wait return later; the timeout it asked for is the bound under test, exactly.


def test_the_extra_wait_is_at_most_half_a_step(loop: asyncio.AbstractEventLoop, long_cap: None) -> None:
    batcher = _batcher([4] * 8, step_s=0.01)  # half a step: 5 ms (the cap, 5 s, does not bind)
    waits = _record_waits(batcher)
    batcher._queue.extend(_job(loop) for _ in range(3))
    taken = threading.Event()
    thread = _append_later(batcher, _job(loop), LATE_S, unless=taken)
    batch = batcher._take_batch()
    taken.set()
    thread.join()
    assert batch is not None and len(batch) == 3  # did not wait for the late job
    # none at all when the host stalled the thread past the 5 ms before it could wait: nothing to judge then
    assert all(w is not None and 0 < w <= 0.01 / 2 for w in waits), waits


def test_the_cap_bounds_the_extra_wait(loop: asyncio.AbstractEventLoop) -> None:
    batcher = _batcher([4] * 8, step_s=10.0)  # half a step, 5 s, is over the 50 ms cap
    waits = _record_waits(batcher)
    batcher._queue.extend(_job(loop) for _ in range(3))
    taken = threading.Event()
    thread = _append_later(batcher, _job(loop), LATE_S, unless=taken)
    batch = batcher._take_batch()
    taken.set()
    thread.join()
    assert batch is not None and len(batch) == 3
    assert all(w is not None and 0 < w <= batcher_module.MAX_EXTRA_WAIT_S for w in waits), waits


# The two below ask whether the batcher waits past the fixed window at all. A window that would wait is 5 s long here
# (half a 10 s step, under the 5 s cap), so waiting and not waiting differ by seconds: the answer never depends on
# how quickly a loaded host schedules a thread (a job appended 30 ms later used to join the batch when the fixed
# 2 ms window overran on a host at load 11).


def test_light_load_waits_only_the_fixed_window(loop: asyncio.AbstractEventLoop, long_cap: None) -> None:
    batcher = _batcher([1] * 8, step_s=10.0)  # recent batches held one job each: nothing to wait for
    batcher._queue.append(_job(loop))
    started = time.monotonic()
    batch = batcher._take_batch()
    assert batch is not None and len(batch) == 1
    assert time.monotonic() - started < 2.5  # not the 5 s window


def test_no_history_means_the_fixed_window_alone(loop: asyncio.AbstractEventLoop, long_cap: None) -> None:
    batcher = _batcher([], step_s=10.0)
    batcher._queue.extend(_job(loop) for _ in range(2))
    started = time.monotonic()
    batch = batcher._take_batch()
    assert batch is not None and len(batch) == 2
    assert time.monotonic() - started < 2.5  # not the 5 s window
    assert list(batcher._recent_sizes) == [2]  # and the batch is remembered


def test_stop_ends_the_wait(loop: asyncio.AbstractEventLoop, long_cap: None) -> None:
    batcher = _batcher([8] * 8, step_s=10.0)  # the window: 5 s
    batcher._queue.append(_job(loop))

    def stop_soon() -> None:
        time.sleep(0.01)
        with batcher._cond:
            batcher._stop = True
            batcher._cond.notify_all()

    thread = threading.Thread(target=stop_soon)
    thread.start()
    started = time.monotonic()
    batcher._take_batch()
    thread.join()
    assert time.monotonic() - started < 2.5  # woke on stop, not at the 5 s deadline
