"""The scenarios' load driver: real HTTP on 127.0.0.1, bounded in request count and in time.

Why phases: most incident classes are told apart by how the service reacts to *changes* in load --
memory that returns to baseline when load falls (pressure) or keeps climbing (leak), inference time
that inflates with concurrency (thrashing) or stays flat while the queue grows (backlog). A load
plan is a list of ``Phase``s: each runs for ``duration_s`` with ``concurrency`` closed-loop clients
(each sends its next request when the previous one is answered, after an optional think time) or,
with ``rate``, as an open loop (Poisson arrivals at ``rate`` per second, at most ``concurrency`` in
flight); with ``once``, each of the ``concurrency`` clients sends exactly one request (a burst).
Requests never outlive their phase by more than ``request_timeout_s``, and the whole run
stops at ``max_requests``, or early when the caller sets ``stop`` (a ``threading.Event``): a caller
that drives the load from a thread while it waits for what the load should cause -- an alert delivered
and diagnosed -- ends the load as soon as that has happened instead of running the plan to its end.

Safety: the driver refuses any URL that is not loopback. Prompts are generated text (seeded), so
nothing private is ever sent; only status codes and timings come back into the report.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

RETRY_PAUSE_S = 0.25
STOP_POLL_S = 0.05  # how soon a pause or an idle phase notices ``stop`` (a threading.Event, not awaitable)
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
WORDS = tuple(
    "the model reads a prompt and writes tokens one at a time while the batcher groups requests "  # noqa: SIM905
    "memory pages fault in from the page cache when the working set no longer fits under the limit "
    "queue wait grows when every slot is busy and inference time grows when each request slows down".split()
)

BodyFn = Callable[[random.Random], dict[str, Any]]


def text_of_tokens(rng: random.Random, tokens: int) -> str:
    """Random words of about ``tokens`` demo tokens (the demo counts UTF-8 bytes + 1)."""
    out: list[str] = []
    size = 0
    while size < tokens - 1:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[: max(0, tokens - 1)]


def completion(prompt_tokens: int | tuple[int, int], max_tokens: int | tuple[int, int]) -> BodyFn:
    """A body factory: prompt/output lengths fixed or drawn uniformly from ``(lo, hi)``."""

    def draw(rng: random.Random, spec: int | tuple[int, int]) -> int:
        return rng.randint(*spec) if isinstance(spec, tuple) else spec

    def body(rng: random.Random) -> dict[str, Any]:
        return {"prompt": text_of_tokens(rng, draw(rng, prompt_tokens)), "max_tokens": draw(rng, max_tokens)}

    return body


def mixture(*parts: tuple[float, BodyFn]) -> BodyFn:
    """Pick one body factory per request with the given weights."""
    weights = [w for w, _ in parts]
    fns = [f for _, f in parts]

    def body(rng: random.Random) -> dict[str, Any]:
        return rng.choices(fns, weights)[0](rng)

    return body


@dataclass
class Phase:
    name: str
    duration_s: float
    concurrency: int
    body: BodyFn
    rate: float | None = None  # open loop: Poisson arrivals per second (None: closed loop)
    think_s: float = 0.0  # closed loop: pause between a client's requests
    once: bool = False  # closed loop: each client sends one request (a burst of ``concurrency`` at once), no retries


@dataclass
class PhaseReport:
    name: str
    started: float
    ended: float
    sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    stopped: bool = False  # ended before its duration because the caller set ``stop``

    @property
    def ok(self) -> int:
        return self.statuses.get("200", 0)

    def summary(self) -> str:
        lat = sorted(self.latencies_s)
        p50 = lat[len(lat) // 2] if lat else float("nan")
        p95 = lat[int(len(lat) * 0.95)] if lat else float("nan")
        codes = " ".join(f"{k}:{v}" for k, v in sorted(self.statuses.items()))
        took = f"{self.ended - self.started:.1f} s" + (" (stopped early)" if self.stopped else "")
        return f"{self.name}: {self.sent} sent in {took}, p50 {p50:.2f} s, p95 {p95:.2f} s [{codes}]"


@dataclass
class LoadReport:
    phases: list[PhaseReport] = field(default_factory=list)  # the phases that ran (a stop skips the later ones)
    stopped: bool = False  # the caller's ``stop`` cut a phase short or kept one from starting

    @property
    def sent(self) -> int:
        return sum(p.sent for p in self.phases)

    def statuses(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for p in self.phases:
            total.update(p.statuses)
        return total


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"the scenario load driver only talks to loopback, not {host!r}")


def _is_set(stop: threading.Event | None) -> bool:
    return stop is not None and stop.is_set()


async def _sleep(seconds: float, stop: threading.Event | None) -> None:
    """``asyncio.sleep(seconds)``, cut short within ``STOP_POLL_S`` once ``stop`` is set (it is set from another
    thread and cannot be awaited, so a stoppable pause is a series of short ones)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0 and not _is_set(stop):
        await asyncio.sleep(left if stop is None else min(left, STOP_POLL_S))


async def _one(client: httpx.AsyncClient, body: dict[str, Any], report: PhaseReport) -> str:
    t0 = time.monotonic()
    try:
        resp = await client.post("/v1/completions", json=body)
        status = str(resp.status_code)
    except httpx.TimeoutException:
        status = "timeout"
    except httpx.HTTPError as exc:  # connection reset by a killed worker, refused while it restarts ...
        status = type(exc).__name__
    report.statuses[status] += 1
    if status == "200":
        report.latencies_s.append(time.monotonic() - t0)
    return status


async def _run_phase(
    client: httpx.AsyncClient, phase: Phase, rng: random.Random, budget: list[int], pending: set[asyncio.Task[None]],
    stop: threading.Event | None = None,
) -> PhaseReport:  # fmt: skip
    """Run one phase. Closed-loop clients stop at the deadline (after their current request); open-loop
    requests still in flight at the deadline are left running in ``pending`` -- the next phase starts on
    time, as real arrivals would, and the backlog carries over. ``stop`` set is the deadline reached now."""
    report = PhaseReport(phase.name, time.time(), 0.0)
    deadline = time.monotonic() + phase.duration_s

    def running() -> bool:
        return time.monotonic() < deadline and not _is_set(stop)

    def take() -> bool:
        if budget[0] <= 0:
            return False
        budget[0] -= 1
        report.sent += 1
        return True

    if phase.rate is None:

        async def worker() -> None:
            while running() and take():
                status = await _one(client, phase.body(rng), report)
                if phase.once:
                    break
                # A refused or failed request is retried after a pause, as a polite client would
                # (the server sends Retry-After); a tight retry loop would only measure the refusals.
                pause = phase.think_s if status == "200" else max(phase.think_s, RETRY_PAUSE_S)
                if pause > 0:
                    await _sleep(min(pause, max(0.0, deadline - time.monotonic())), stop)

        await asyncio.gather(*(worker() for _ in range(phase.concurrency)))
    else:
        sem = asyncio.Semaphore(phase.concurrency)

        async def limited(body: dict[str, Any]) -> None:
            async with sem:
                await _one(client, body, report)

        assert phase.rate > 0
        while running():
            await _sleep(min(rng.expovariate(phase.rate), max(0.0, deadline - time.monotonic())), stop)
            if not running() or not take():
                break
            task = asyncio.create_task(limited(phase.body(rng)))
            pending.add(task)
            task.add_done_callback(pending.discard)
    if time.monotonic() < deadline:  # a burst, or the budget ran out: the phase still lasts its duration
        await _sleep(deadline - time.monotonic(), stop)
    report.stopped = time.monotonic() < deadline  # only a stop ends a phase before its deadline
    report.ended = time.time()
    return report


def drive(
    url: str,
    phases: Sequence[Phase],
    *,
    seed: int = 0,
    max_requests: int = 5000,
    request_timeout_s: float = 30.0,
    progress: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
) -> LoadReport:
    """Run the phases in order against ``url`` (loopback only); returns what was sent and answered.

    Open-loop requests still in flight when the last phase ends get ``request_timeout_s`` to finish;
    a phase's report counts the answers that arrived for its requests, whenever they arrived.

    ``stop``: set it (from another thread) to end the run early. The current phase ends as if its time
    were up -- closed-loop clients after their current request, no new open-loop arrivals, a pause or
    an idle phase within ``STOP_POLL_S`` -- the later phases do not start, and the report says
    ``stopped``. In-flight requests are answered, not cancelled, as at a phase's natural end.
    """
    check_loopback(url)
    rng = random.Random(seed)
    budget = [max_requests]
    report = LoadReport()
    most = max([p.concurrency for p in phases] + [1])

    async def run() -> None:
        pending: set[asyncio.Task[None]] = set()
        # No keep-alive: each request is a new connection, so the kernel spreads them over the workers.
        limits = httpx.Limits(max_keepalive_connections=0, max_connections=4 * most)
        timeout = httpx.Timeout(request_timeout_s, connect=5.0)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
            for phase in phases:
                if _is_set(stop):
                    report.stopped = True
                    if progress:
                        progress(f"load stopped before phase {phase.name}")
                    break
                if progress:
                    kind = f"{phase.rate:g} req/s open loop" if phase.rate else ("burst" if phase.once else "closed loop")
                    what = "idle" if phase.concurrency <= 0 else f"{phase.concurrency} concurrent, {kind}"
                    progress(f"load phase {phase.name}: {phase.duration_s:g} s, {what}")
                if phase.concurrency <= 0:
                    started, deadline = time.time(), time.monotonic() + phase.duration_s
                    await _sleep(phase.duration_s, stop)
                    report.phases.append(PhaseReport(phase.name, started, time.time(), stopped=time.monotonic() < deadline))
                else:
                    report.phases.append(await _run_phase(client, phase, rng, budget, pending, stop))
                report.stopped |= report.phases[-1].stopped
                if progress:
                    progress("  " + report.phases[-1].summary())
            if pending:
                if progress:
                    progress(f"waiting for {len(pending)} request(s) still in flight")
                await asyncio.wait(set(pending), timeout=request_timeout_s + 5.0)
                for task in set(pending):
                    task.cancel()

    asyncio.run(run())
    return report


def idle(name: str, duration_s: float) -> Phase:
    """A phase that sends nothing (memory should come back to baseline here, unless it leaks)."""
    return Phase(name, duration_s, 0, completion(1, 1))
