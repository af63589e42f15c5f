"""Inference deadlines enforced by one sweeper per tracker (``collectors/tracking/deadlines.py``) instead of an
``asyncio.timeout`` per request: the same outcomes -- a timeout past the budget, nothing for work that ends in time,
someone else's cancellation left alone -- on a real event loop."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from collectors.tracking import AdmissionConfig, InferenceTimeout, RequestTracker
from collectors.tracking.deadlines import DeadlineSweeper
from collectors.tracking.request import TrackedRequest


def _tracker(budget: float) -> RequestTracker:
    return RequestTracker(
        "m", recorder=False, registry=CollectorRegistry(), admission=AdmissionConfig(inference_timeout_s=budget)
    )


def test_work_past_the_budget_times_out_and_work_within_it_does_not() -> None:
    tracker = _tracker(0.05)
    cuts: list[tuple[float, float]] = []  # each cut work's (deadline, perf_counter when the cancellation reached it)

    async def work(req: TrackedRequest, seconds: float) -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cuts.append((req._deadline, time.perf_counter()))  # type: ignore[arg-type]
            raise

    async def one(seconds: float) -> str:
        try:
            async with tracker.request(route="/x") as req:
                await req.acquire()
                await req.run(work(req, seconds))
                return "ok"
        except InferenceTimeout:
            return "timeout"

    async def main() -> list[str]:
        return await asyncio.gather(*(one(s) for s in (0.0, 5.0, 0.0, 5.0, 0.0)))

    # The work within the budget ends at its first resumption, which the loop runs before any timer that fell due
    # meanwhile, so no stall of the host can put the sweep ahead of it. Work that waits on a timer of its own
    # (a 1 ms sleep) could: a loop stalled past the 50 ms budget runs that timer and the sweep in one pass, and the
    # sweep cancels the task before it resumes. A sweep that cut too early is caught by the times of the cuts.
    started = time.monotonic()
    assert asyncio.run(main()) == ["ok", "timeout", "ok", "timeout", "ok"]
    assert time.monotonic() - started < 4.0  # the slow ones were cut at their deadline, not left to finish
    assert len(cuts) == 2 and all(cut_at >= deadline for deadline, cut_at in cuts), cuts  # and not before it


def test_a_later_request_with_an_earlier_deadline_is_cut_at_its_own_deadline() -> None:
    """Deadlines need not arrive in order (a request may start its inference long after its slot): the timer is
    re-armed for the earliest pending one."""

    async def main() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        sweeper = DeadlineSweeper(loop)
        late = loop.create_task(asyncio.sleep(30))
        early = loop.create_task(asyncio.sleep(30))
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        sweeper.add(t0 + 20.0, late)
        entry = sweeper.add(t0 + 0.05, early)
        with pytest.raises(asyncio.CancelledError):
            await early
        cut_after = time.perf_counter() - t0
        late.cancel()
        return entry.timed_out(), cut_after

    timed_out, cut_after = asyncio.run(main())
    assert timed_out
    assert cut_after < 10.0  # at its own 0.05 s, far from the other's 20 s


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    """A client that disconnects cancels the handler's task: that is not an inference timeout."""
    tracker = _tracker(30.0)
    seen: list[str] = []

    async def handler() -> None:
        async with tracker.request(route="/x") as req:
            await req.acquire()
            try:
                await req.run(asyncio.sleep(30))
            except InferenceTimeout:
                seen.append("timeout")
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(handler())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ["cancelled"]


def test_finished_requests_do_not_pile_up() -> None:
    """Entries of requests that ended are dropped as new ones arrive: the sweeper holds about the requests in flight."""
    tracker = _tracker(60.0)

    async def main() -> int:
        for _ in range(500):
            async with tracker.request(route="/x") as req:
                await req.acquire()
                await req.run(asyncio.sleep(0))
        return len(tracker.queueing.deadlines(asyncio.get_running_loop())._pending)

    assert asyncio.run(main()) <= 1
