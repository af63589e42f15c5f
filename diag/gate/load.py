"""The load generator: OpenAI-compatible requests, open loop (Poisson arrivals) or closed loop (N clients).

Why open loop is written this way: a load tool that waits for the server before sending the next request
slows down exactly when the server does, and its latencies then describe a lighter load than the one asked
for (coordinated omission). Here the arrival times are drawn before the step starts; the scheduler sends
each one at its time whatever is still in flight, and a request's latency is measured from its *scheduled*
time, so a late send is charged to the latency, never hidden. The lag of each send behind its schedule is
kept too: it is the generator's own error, reported so a result can be trusted (``bench/gate.py``).

Every request is bounded by the spec's ``request_timeout``; arrivals beyond ``max_in_flight`` are counted as
dropped (the client, not the server, ran out of room) rather than delayed. Streaming responses (SSE) give the
time to the first token and the gaps between tokens as the client sees them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from diag.gate.alarm import Alarm
from diag.gate.http_client import HttpClient, HttpError, Response
from diag.gate.spec import GateSpec, Step

# While a step runs, how long another thread of this process may hold the GIL once the loop wants it back (Python's
# default is 5 ms). `diag gate` samples the host in a thread of its own; a timerfd's wake-up that found it mid-sample
# would otherwise wait up to 5 ms before the send -- five times the whole lag budget.
SWITCH_INTERVAL_S = 0.0005
# The times of a Result, a StepLoad and the schedule: asyncio's loop.time(), read directly (uvloop's is whole ms).
clock = time.monotonic
WORDS = ("the", "of", "and", "model", "token", "serve", "memory", "queue", "cache", "batch", "route", "slot")


@dataclass(slots=True)
class Result:
    """One request as the client saw it; times are ``clock()`` seconds (monotonic)."""

    scheduled: float
    sent: float
    done: float = 0.0
    status: int | None = None
    error: str | None = None
    first_token: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    stream_done: bool = False  # a streamed answer's ``data: [DONE]`` arrived (its absence is a stream cut short)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def e2e_s(self) -> float:
        return self.done - self.scheduled

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.scheduled

    @property
    def lag_s(self) -> float:
        return self.sent - self.scheduled


@dataclass
class StepLoad:
    """What one step sent and got back; ``t0``/``load_end``/``end`` are loop times, ``wall0`` the wall clock at ``t0``."""

    step: Step
    t0: float
    wall0: float
    results: list[Result] = field(default_factory=list)
    dropped: int = 0
    load_end: float = 0.0
    end: float = 0.0
    interrupted: bool = False

    def wall(self, loop_time: float) -> float:
        return self.wall0 + (loop_time - self.t0)


def prompt_text(tokens: int, rng: random.Random) -> str:
    """About ``tokens`` tokens of text: short common words, each one token for the usual BPE tokenizers."""
    return " ".join(rng.choices(WORDS, k=tokens))  # one call, not one per word: a few microseconds a request


def request_body(spec: GateSpec, step: Step, rng: random.Random) -> dict[str, Any]:
    """The JSON body of one request for the spec's endpoint, lengths drawn from the step's distributions."""
    prompt = prompt_text(step.prompt_tokens.draw(rng), rng)
    body: dict[str, Any] = {"max_tokens": step.output_tokens.draw(rng), "stream": step.stream}
    if spec.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if spec.model:
        body["model"] = spec.model
    return body


def arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival offsets (seconds from the step's start) at ``rate`` per second, all before ``duration_s``."""
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _chunk_text(payload: dict[str, Any]) -> str:
    choices = payload.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    first = choices[0]
    text = first.get("text")
    if text is None:
        text = (first.get("delta") or {}).get("content")
    return text if isinstance(text, str) else ""


class _Sse:
    """A streamed answer's Server-Sent Events, read as the bytes arrive (called from the connection's callback,
    so the time taken is when the client received the token): the first token's time, the gaps after it."""

    __slots__ = ("buf", "ended", "last", "loop", "res")

    def __init__(self, res: Result, loop: asyncio.AbstractEventLoop) -> None:
        self.res = res
        self.loop = loop
        self.buf = b""
        self.last = 0.0
        self.ended = False

    def __call__(self, data: bytes) -> None:
        if self.ended:
            return
        lines = (self.buf + data).split(b"\n")
        self.buf = lines.pop()
        now = clock()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.ended = self.res.stream_done = True
                return
            try:
                text = _chunk_text(json.loads(payload))
            except (ValueError, AttributeError):
                self.res.error = "a stream event that is not JSON"
                self.ended = True
                return
            if not text:
                continue
            res = self.res
            if res.first_token is None:
                res.first_token = now
            else:
                res.itl_s.append(now - self.last)
            self.last = now
            res.output_tokens += 1


def _begin(client: HttpClient, spec: GateSpec, data: bytes, res: Result, stream: bool) -> Awaitable[Response]:
    """Start one request now: with this module's own client its bytes are written before this returns (when a
    kept-alive connection is idle), so ``res.sent`` is when it left, not when its task first ran."""
    on_chunk = _Sse(res, asyncio.get_running_loop()) if stream else None
    res.sent = clock()
    if isinstance(client, HttpClient):
        return client.post_now(spec.endpoint, data, on_chunk)
    return client.post(spec.endpoint, data, on_chunk)  # another client (an ASGI app in this process): when awaited


def _read(resp: Response, res: Result, stream: bool) -> None:
    res.status = resp.status
    if resp.status != 200:
        res.error = f"HTTP {resp.status}"
        return
    if stream:
        if not res.stream_done and res.error is None:  # a server cut the stream short (a shutdown) yet framed it whole
            res.error = "the stream ended without data: [DONE]"
        return
    try:
        usage = json.loads(resp.body).get("usage") or {}
        res.output_tokens = int(usage.get("completion_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        res.error = "a response that is not the completions JSON"


class Deadlines:
    """Every request's timeout, kept by one timer for the whole step instead of one per request.

    Why: ``asyncio.timeout`` around each request costs a timer object, a heap push and a cancel -- about a tenth
    of a request's CPU at thousands per second. All requests of a run share one timeout, so their deadlines come
    in the order they were sent: a queue, and one timer that fires at the oldest deadline (or ``GRAIN_S`` later
    at most, so a burst of deadlines is one wake-up) and cancels what is still running then."""

    GRAIN_S = 0.005

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.queue: collections.deque[list[Any]] = collections.deque()  # [deadline, task or None when done]
        self.expired: set[asyncio.Task[Any]] = set()
        self.timer: asyncio.TimerHandle | None = None

    def start(self, task: asyncio.Task[Any]) -> list[Any]:
        entry = [clock() + self.timeout_s, task]
        self.queue.append(entry)
        if self.timer is None:
            self.timer = self.loop.call_at(entry[0], self._fire)
        return entry

    def _fire(self) -> None:
        self.timer = None
        now = clock()
        queue = self.queue
        while queue and queue[0][0] <= now:
            _, task = queue.popleft()
            if task is not None and not task.done():
                self.expired.add(task)
                task.cancel()
        if queue:
            self.timer = self.loop.call_at(max(queue[0][0], now + self.GRAIN_S), self._fire)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.queue.clear()


async def finish(answer: Awaitable[Response], res: Result, stream: bool, deadlines: Deadlines) -> Result:
    """Wait for a started request's answer, bounded by the spec's timeout; never raises for what the server or the
    network did."""
    task = asyncio.current_task()
    assert task is not None
    entry = deadlines.start(task)
    try:
        _read(await answer, res, stream)
    except asyncio.CancelledError:
        if task not in deadlines.expired:
            raise  # a stop, not this request's deadline
        deadlines.expired.discard(task)
        task.uncancel()
        res.error = "timeout"
    except HttpError as exc:
        res.error = type(exc).__name__
    except Exception as exc:  # a server's malformed answer is the server's failure: count it, never lose the request
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        entry[1] = None
    res.done = clock()
    return res


async def send(client: HttpClient, spec: GateSpec, body: dict[str, Any], scheduled: float, deadlines: Deadlines) -> Result:
    """One request started now (scheduled at ``scheduled``), bounded by the spec's timeout."""
    res = Result(scheduled=scheduled, sent=0.0)
    stream = bool(body.get("stream"))
    return await finish(_begin(client, spec, json.dumps(body).encode(), res, stream), res, stream, deadlines)


class _Sender:
    """The open loop's schedule, run from the loop's callbacks rather than a task: an ``Alarm`` wakes it at each
    arrival's time and it writes every request then due before the loop does anything else it has ready.

    Why not a task that sleeps and then sends: the task's wake-up waits behind whatever else the loop has ready at
    that moment (answers to read and parse), and asyncio's timers are a millisecond coarse. Here the request's bytes
    are built ahead of its time, the alarm (diag.gate.alarm) fires at the time itself, and the write is the first
    thing done on that wake-up; what the answer needs afterwards runs in a task of its own."""

    def __init__(self, client: HttpClient, spec: GateSpec, out: StepLoad, rng: random.Random, deadlines: Deadlines,
                 precise: bool) -> None:  # fmt: skip
        assert out.step.rate is not None
        self.client, self.spec, self.out, self.rng, self.deadlines = client, spec, out, rng, deadlines
        self.loop = deadlines.loop
        self.stream = out.step.stream
        self.arrivals = iter(arrivals(out.step.rate, out.step.duration_s, rng))
        self.tasks: set[asyncio.Task[Result]] = set()
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self.alarm = Alarm(self.loop, self._due, precise=precise)
        self.next: tuple[float, bytes] | None = None
        self._prepare()

    def _prepare(self) -> None:
        """The next arrival's time and its request's bytes, built now rather than when it is due."""
        offset = next(self.arrivals, None)
        if offset is None:
            self.next = None
            return
        self.next = (self.out.t0 + offset, json.dumps(request_body(self.spec, self.out.step, self.rng)).encode())

    def start(self) -> None:
        self._due()

    def stop(self) -> None:
        self.alarm.close()

    def _due(self) -> None:
        """Send every arrival whose time has come, then set the alarm for the next one."""
        try:
            while self.next is not None and self.next[0] <= clock():
                at, data = self.next
                self._send(at, data)
                self._prepare()
            if self.next is not None:
                self.alarm.at(self.next[0])
            elif not self.finished.done():
                self.finished.set_result(None)
        except Exception as exc:  # a callback's exception would only be logged: end the step with it instead
            if not self.finished.done():
                self.finished.set_exception(exc)

    def _send(self, at: float, data: bytes) -> None:
        if len(self.tasks) >= self.spec.max_in_flight:
            self.out.dropped += 1
            return
        res = Result(scheduled=at, sent=0.0)
        answer = _begin(self.client, self.spec, data, res, self.stream)
        task = self.loop.create_task(finish(answer, res, self.stream, self.deadlines))
        self.tasks.add(task)
        task.add_done_callback(self._keep)

    def _keep(self, task: asyncio.Task[Result]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is None:
            self.out.results.append(task.result())


async def _open_loop(client: HttpClient, spec: GateSpec, out: StepLoad, rng: random.Random,
                     stop: asyncio.Event, deadlines: Deadlines, precise: bool) -> None:  # fmt: skip
    sender = _Sender(client, spec, out, rng, deadlines, precise)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        sender.start()
        await asyncio.wait({sender.finished, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sender.stop()
        stopper.cancel()
    out.load_end = clock()
    if sender.tasks:
        await _drain(sender.tasks, stop)


async def _drain(tasks: set[asyncio.Task[Result]], stop: asyncio.Event) -> None:
    """Wait for what is in flight (each bounded by its timeout); a stop cancels it instead."""
    stopper = asyncio.ensure_future(stop.wait())
    pending = set(tasks)
    while pending and not stop.is_set():
        _, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
        pending.discard(stopper)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    stopper.cancel()


async def _closed_loop(client: HttpClient, spec: GateSpec, out: StepLoad, rng: random.Random,
                       stop: asyncio.Event, deadlines: Deadlines) -> None:  # fmt: skip
    loop = asyncio.get_running_loop()
    assert out.step.concurrency is not None
    end = out.t0 + out.step.duration_s

    async def client_loop() -> None:
        while clock() < end and not stop.is_set():
            out.results.append(await send(client, spec, request_body(spec, out.step, rng), clock(), deadlines))

    tasks = {loop.create_task(client_loop()) for _ in range(out.step.concurrency)}
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, end - clock()))
    out.load_end = min(clock(), end)
    await _drain(tasks, stop)  # type: ignore[arg-type]


def make_client(target: str, spec: GateSpec, connections: int | None = None) -> HttpClient:
    """The one client of a run: keep-alive connections, as many as can be in flight (``max_in_flight``, or a
    closed-loop step's clients), to the target named and nowhere else (no proxy from the environment)."""
    n = connections or max(spec.max_in_flight, max((s.concurrency or 0) for s in spec.steps))
    return HttpClient(target, max_connections=n)


async def run_step(client: HttpClient, spec: GateSpec, step: Step, index: int, stop: asyncio.Event, *,
                   precise: bool = True) -> StepLoad:  # fmt: skip
    """Run one step to its end (load for ``duration``, then the in-flight requests drained) or until ``stop``.
    ``precise=False``: the open loop's arrivals wait on asyncio's timer and a spin, not a timerfd (the bench's
    comparison; diag.gate.alarm says why the timerfd is the default)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(f"{spec.seed}:{index}:{step.name}")  # a step's load does not depend on the steps before it
    out = StepLoad(step=step, t0=clock() + 0.005, wall0=0.0)
    out.wall0 = time.time() + (out.t0 - clock())
    deadlines = Deadlines(loop, spec.request_timeout_s)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, SWITCH_INTERVAL_S))
    try:
        if step.rate is not None:
            await _open_loop(client, spec, out, rng, stop, deadlines, precise)
        else:
            await _closed_loop(client, spec, out, rng, stop, deadlines)
    finally:
        deadlines.close()
        sys.setswitchinterval(switch)
    out.end = clock()
    out.interrupted = stop.is_set()
    out.results.sort(key=lambda r: r.scheduled)
    return out
