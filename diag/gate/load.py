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
import time
from dataclasses import dataclass, field
from typing import Any

from diag.gate.http_client import HttpClient, HttpError
from diag.gate.spec import GateSpec, Step

SPIN_S = 0.001  # the last stretch before a send is spent yielding to the loop: epoll rounds a wait up to whole ms
STOP_CHECK_S = 0.05  # waits longer than this also watch the stop event (a task each: too dear at high rates)
WORDS = ("the", "of", "and", "model", "token", "serve", "memory", "queue", "cache", "batch", "route", "slot")


@dataclass(slots=True)
class Result:
    """One request as the client saw it; times are ``loop.time()`` seconds (monotonic)."""

    scheduled: float
    sent: float
    done: float = 0.0
    status: int | None = None
    error: str | None = None
    first_token: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0

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
        now = self.loop.time()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.ended = True
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


async def _exchange(client: HttpClient, spec: GateSpec, body: dict[str, Any], res: Result) -> None:
    data = json.dumps(body).encode()
    if body.get("stream"):
        sse = _Sse(res, asyncio.get_running_loop())
        resp = await client.post(spec.endpoint, data, sse)
        res.status = resp.status
        if resp.status != 200:
            res.error = f"HTTP {resp.status}"
        elif not sse.ended and res.error is None:  # a server cut the stream short (a shutdown) yet framed it whole
            res.error = "the stream ended without data: [DONE]"
        return
    resp = await client.post(spec.endpoint, data)
    res.status = resp.status
    if resp.status != 200:
        res.error = f"HTTP {resp.status}"
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
        entry = [self.loop.time() + self.timeout_s, task]
        self.queue.append(entry)
        if self.timer is None:
            self.timer = self.loop.call_at(entry[0], self._fire)
        return entry

    def _fire(self) -> None:
        self.timer = None
        now = self.loop.time()
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


async def send(client: HttpClient, spec: GateSpec, body: dict[str, Any], scheduled: float, deadlines: Deadlines) -> Result:
    """One request, bounded by the spec's timeout; never raises for what the server or the network did."""
    loop = deadlines.loop
    res = Result(scheduled=scheduled, sent=loop.time())
    task = asyncio.current_task()
    assert task is not None
    entry = deadlines.start(task)
    try:
        await _exchange(client, spec, body, res)
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
    res.done = loop.time()
    return res


async def _until(loop: asyncio.AbstractEventLoop, at: float, stop: asyncio.Event) -> None:
    """Wait until loop time ``at``: sleep most of the way, then yield to the loop for the last ``SPIN_S``.
    A long wait (a low rate) also ends on ``stop``, so Ctrl-C is not held up by a far-off arrival."""
    delay = at - loop.time() - SPIN_S
    if delay > STOP_CHECK_S:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            return
    elif delay > 0:
        await asyncio.sleep(delay)
    while loop.time() < at:
        await asyncio.sleep(0)


async def _open_loop(client: HttpClient, spec: GateSpec, out: StepLoad, rng: random.Random,
                     stop: asyncio.Event, deadlines: Deadlines) -> None:  # fmt: skip
    loop = asyncio.get_running_loop()
    assert out.step.rate is not None
    tasks: set[asyncio.Task[Result]] = set()

    def keep(task: asyncio.Task[Result]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is None:
            out.results.append(task.result())

    for offset in arrivals(out.step.rate, out.step.duration_s, rng):
        at = out.t0 + offset
        await _until(loop, at, stop)
        if stop.is_set():
            break
        if len(tasks) >= spec.max_in_flight:
            out.dropped += 1
            continue
        task = loop.create_task(send(client, spec, request_body(spec, out.step, rng), at, deadlines))
        tasks.add(task)
        task.add_done_callback(keep)
    out.load_end = loop.time()
    if tasks:
        await _drain(tasks, stop)


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
        while loop.time() < end and not stop.is_set():
            out.results.append(await send(client, spec, request_body(spec, out.step, rng), loop.time(), deadlines))

    tasks = {loop.create_task(client_loop()) for _ in range(out.step.concurrency)}
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, end - loop.time()))
    out.load_end = min(loop.time(), end)
    await _drain(tasks, stop)  # type: ignore[arg-type]


def make_client(target: str, spec: GateSpec, connections: int | None = None) -> HttpClient:
    """The one client of a run: keep-alive connections, as many as can be in flight (``max_in_flight``, or a
    closed-loop step's clients), to the target named and nowhere else (no proxy from the environment)."""
    n = connections or max(spec.max_in_flight, max((s.concurrency or 0) for s in spec.steps))
    return HttpClient(target, max_connections=n)


async def run_step(client: HttpClient, spec: GateSpec, step: Step, index: int, stop: asyncio.Event) -> StepLoad:
    """Run one step to its end (load for ``duration``, then the in-flight requests drained) or until ``stop``."""
    loop = asyncio.get_running_loop()
    rng = random.Random(f"{spec.seed}:{index}:{step.name}")  # a step's load does not depend on the steps before it
    out = StepLoad(step=step, t0=loop.time() + 0.005, wall0=0.0)
    out.wall0 = time.time() + (out.t0 - loop.time())
    deadlines = Deadlines(loop, spec.request_timeout_s)
    try:
        if step.rate is not None:
            await _open_loop(client, spec, out, rng, stop, deadlines)
        else:
            await _closed_loop(client, spec, out, rng, stop, deadlines)
    finally:
        deadlines.close()
    out.end = loop.time()
    out.interrupted = stop.is_set()
    out.results.sort(key=lambda r: r.scheduled)
    return out
