"""Admission control without HTTP: FIFO slot hand-off across asyncio tasks and real threads,
cancellation, refusals, and the outcome bookkeeping of TrackedRequest."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from collectors import catalog
from collectors.tracking import AdmissionConfig, AdmissionRejected, InferenceTimeout, QueueTimeout, RequestTracker
from collectors.tracking.admission import QueueFull, SlotPool
from tests.collectors.registry_samples import sample_value


def _tracker(**admission: object) -> tuple[RequestTracker, CollectorRegistry]:
    registry = CollectorRegistry()
    return RequestTracker("m", recorder=False, admission=AdmissionConfig(**admission), registry=registry), registry  # type: ignore[arg-type]


def test_config_rejects_nonsense() -> None:
    for bad in (
        {"max_concurrency": 0},
        {"queue_size": -1},
        {"queue_timeout_s": 0},
        {"inference_timeout_s": -1},
        {"memory_high_watermark": 1.5},
        {"psi_memory_some_avg10": 101},
        {"retry_after_s": -1},
    ):
        with pytest.raises(ValueError):
            AdmissionConfig(**bad)  # type: ignore[arg-type]
    assert not AdmissionConfig().memory_guard_enabled
    assert AdmissionConfig(psi_memory_some_avg10=10).memory_guard_enabled


def test_slots_are_handed_over_in_arrival_order_across_threads_and_tasks() -> None:
    """Waiters of both kinds queue in one FIFO; a release goes to the oldest, never to a newcomer."""
    pool = SlotPool(limit=1, queue_size=None)
    assert pool.try_acquire()
    order: list[str] = []
    lock = threading.Lock()

    def thread_waiter(name: str, ready: threading.Event) -> None:
        waiter = pool.enqueue(None)
        ready.set()
        assert waiter is not None and pool.wait_sync(waiter, 10)
        with lock:
            order.append(name)
        pool.release()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        tasks = []
        threads = []
        for i in range(6):
            if i % 2 == 0:
                ready = threading.Event()
                t = threading.Thread(target=thread_waiter, args=(f"thread{i}", ready))
                t.start()
                threads.append(t)
                await asyncio.to_thread(ready.wait, 10)
            else:
                waiter = pool.enqueue(loop)
                assert waiter is not None

                async def task_waiter(name: str, w: object = waiter) -> None:
                    assert await pool.wait_async(w, 10)  # type: ignore[arg-type]
                    with lock:
                        order.append(name)
                    await asyncio.sleep(0)
                    pool.release()

                tasks.append(asyncio.create_task(task_waiter(f"task{i}")))
        assert pool.waiting == 6
        assert not pool.try_acquire()  # a newcomer does not barge past the queue
        pool.release()
        await asyncio.gather(*tasks)
        for t in threads:
            await asyncio.to_thread(t.join, 10)

    asyncio.run(main())
    assert order == ["thread0", "task1", "thread2", "task3", "thread4", "task5"]
    assert pool.active == 0 and pool.waiting == 0


def test_queue_bound_and_timeout() -> None:
    pool = SlotPool(limit=1, queue_size=1)
    assert pool.try_acquire()
    waiter = pool.enqueue(None)
    assert waiter is not None
    assert pool.queue_full
    with pytest.raises(QueueFull):
        pool.enqueue(None)
    assert pool.wait_sync(waiter, 0.01) is False  # timed out: it left the queue
    assert pool.waiting == 0 and not pool.queue_full
    pool.release()
    assert pool.active == 0


def test_cancelled_waiter_passes_a_granted_slot_on() -> None:
    async def main() -> None:
        pool = SlotPool(limit=1, queue_size=None)
        assert pool.try_acquire()
        loop = asyncio.get_running_loop()
        first, second = pool.enqueue(loop), pool.enqueue(loop)
        assert first is not None and second is not None
        t1 = asyncio.create_task(pool.wait_async(first, None))
        t2 = asyncio.create_task(pool.wait_async(second, None))
        await asyncio.sleep(0)
        pool.release()  # granted to `first` ...
        t1.cancel()  # ... which is cancelled (client went away) before it runs
        with pytest.raises(asyncio.CancelledError):
            await t1
        assert await asyncio.wait_for(t2, 5) is True  # the slot moved on instead of leaking
        pool.release()
        assert pool.active == 0

    asyncio.run(main())


def test_outcomes_of_admission_exceptions() -> None:
    tracker, registry = _tracker(max_concurrency=1, queue_size=0, inference_timeout_s=0.01, retry_after_s=3)

    async def main() -> None:
        async with tracker.request("/a") as holder:
            await holder.acquire()
            with pytest.raises(AdmissionRejected) as info:
                async with tracker.request("/a") as req:
                    await req.acquire()
            assert info.value.status_code == 429 and info.value.retry_after_s == 3
            assert info.value.outcome == "rejected" and info.value.reason == "queue_full"
        # caught inside the block: still counted as what it was
        async with tracker.request("/a") as req:
            try:
                await req.run(asyncio.sleep(5))
            except InferenceTimeout as exc:
                assert exc.status_code == 504
        assert req.outcome == "inference_timeout"
        # someone else's exception type leaving the block is just an error
        with pytest.raises(AdmissionRejected):
            async with tracker.request("/a") as req:
                await req.acquire()
                raise AdmissionRejected("other", 429, 1.0)
        assert req.outcome == "error"

    asyncio.run(main())
    count = lambda outcome: sample_value(registry, catalog.REQUESTS.name, {"outcome": outcome})  # noqa: E731
    assert (count("ok"), count("rejected"), count("inference_timeout"), count("error")) == (1, 1, 1, 1)


def test_queue_timeout_is_a_503_admission_refusal() -> None:
    tracker, registry = _tracker(max_concurrency=1, queue_timeout_s=0.02)
    with tracker.request("/a") as holder:
        holder.acquire_sync()
        with pytest.raises(QueueTimeout) as info, tracker.request("/a") as req:
            req.acquire_sync()
    assert isinstance(info.value, AdmissionRejected)
    assert info.value.status_code == 503 and info.value.outcome == "queue_timeout"
    assert sample_value(registry, catalog.REQUESTS.name, {"outcome": "queue_timeout"}) == 1
    assert tracker.health()["active_inference"] == 0


def test_finish_is_idempotent_and_acquire_after_finish_fails() -> None:
    tracker, registry = _tracker()
    req = tracker.request("/a")
    req.acquire_sync()
    req.finish()
    req.finish()
    with req:
        pass
    assert sample_value(registry, catalog.REQUESTS.name) == 1
    with pytest.raises(RuntimeError):
        req.acquire_sync()


def test_many_threads_never_exceed_the_limit(tmp_path: Path) -> None:
    tracker, registry = _tracker(max_concurrency=3)
    active = 0
    peak = 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal active, peak
        for _ in range(20):
            with tracker.request("/t") as req:
                req.acquire_sync()
                with lock:
                    active += 1
                    peak = max(peak, active)
                time.sleep(0.0005)
                with lock:
                    active -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert 2 <= peak <= 3  # never above the limit (8 threads would reach 8 without it)
    assert sample_value(registry, catalog.REQUESTS.name, {"outcome": "ok"}) == 160
    assert sample_value(registry, catalog.ACTIVE_INFERENCES.name) == 0


def test_queue_depth_never_reads_above_the_queue_bound() -> None:
    """A waiter leaves the depth gauge when it is granted, not when its task next runs.

    Sequence: one request holds the only slot, two wait (depth 2 = queue_size). The holder finishes
    and grants the first waiter; before that waiter's task resumes, a new request joins the queue.
    Counting the granted waiter until it resumed read 3 here -- above ``queue_size`` 2.
    """
    tracker, registry = _tracker(max_concurrency=1, queue_size=2)
    depth = lambda: sample_value(registry, catalog.QUEUE_DEPTH.name)  # noqa: E731
    seen: list[float] = []

    async def one(hold: asyncio.Event) -> None:
        async with tracker.request(route="/q") as req:
            await req.acquire()
            await hold.wait()

    async def main() -> None:
        release = asyncio.Event()
        holder = tracker.request(route="/q")
        await holder.acquire()
        waiters = [asyncio.create_task(one(release)) for _ in range(2)]
        await asyncio.sleep(0.01)
        seen.append(depth())  # both queued
        holder.finish()  # grants the first waiter; its task has not run yet
        late = asyncio.create_task(one(release))
        for _ in range(3):  # the late request enqueues before the granted waiter resumes
            await asyncio.sleep(0)
            seen.append(depth())
        release.set()
        await asyncio.gather(*waiters, late)
        seen.append(depth())

    asyncio.run(main())
    assert seen[0] == 2
    assert max(seen) <= 2, seen
    assert seen[-1] == 0
