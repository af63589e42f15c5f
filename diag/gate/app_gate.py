"""The application gate: does the service answer as a service must before it takes traffic -- ready, one short
request, one long prefill at the target context, the target concurrency -- and, only when asked, does it stop
gracefully (SIGTERM with requests in flight: they complete, the process exits in time).

Why a failed readiness check stops the run before the load (and the other checks do not): a server that never
answered its readiness path within the deadline is not up, and load sent to it measures only connection errors --
every step would fail for the same one reason, and a bundle of it would be noise. A slow short request, a long
prefill that times out or a concurrency bound missed are findings about a running server: the steps still run,
so the report shows what the load did too, and the gate fails on the check.

Why graceful termination sends its requests as the spec's clients do (``stream:`` at the top): a server may drain
the two kinds differently -- llama-cpp-python's uvicorn finishes plain requests on SIGTERM but ends every open
event stream at once, framed as a whole answer without its ``data: [DONE]`` -- and the clients' kind is the one that
matters. Why graceful termination runs last, after the steps: it ends the service. It signals only the one process given
(``--pid`` or the unit's MainPID), after checking that the PID still names the same process it named when the gate
started (its start time in ``/proc/<pid>/stat``), so a recycled PID is never signalled.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Callable
from dataclasses import replace

from collectors.procfs import read_text, under
from diag.gate.gates import Check, GateResult
from diag.gate.http_client import HttpClient, HttpError
from diag.gate.inflight import TcpTables, read_by_server
from diag.gate.inprocess import HttpxClient
from diag.gate.load import Deadlines, Result, request_body, send
from diag.gate.spec import AppSpec, Criteria, GateSpec, Lengths, Probe, Readiness, Step

POLL_S = 0.25  # the readiness path is asked this often: a server's start-up is seconds, not milliseconds
IN_FLIGHT_POLL_S = 0.02  # while the termination's requests travel to the server, its socket table is read this often
IN_PROCESS_TURNS = 10  # loop turns an in-process app's requests get to reach it (no socket to look at, no I/O to wait)

Progress = Callable[[str], None]
Client = HttpClient | HttpxClient  # the run's own client: the load's, or an in-process app's


def _step(probe: Probe, name: str, stream: bool = False) -> Step:
    return Step(name, probe.within_s, Lengths("fixed", probe.prompt_tokens), Lengths("fixed", probe.output_tokens),
                stream=stream, criteria=Criteria())  # fmt: skip


async def _requests(client: Client, spec: GateSpec, probe: Probe, name: str) -> list[Result]:
    """``probe.requests`` requests sent at once, each bounded by ``probe.within_s``."""
    bounded = replace(spec, request_timeout_s=probe.within_s)
    step = _step(probe, name)
    rng = random.Random(f"{spec.seed}:application:{name}")
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop, probe.within_s)
    now = loop.time()
    try:
        tasks = [loop.create_task(send(client, bounded, request_body(bounded, step, rng), now, deadlines))  # type: ignore[arg-type]
                 for _ in range(probe.requests)]  # fmt: skip
        return list(await asyncio.gather(*tasks))
    finally:
        deadlines.close()


def _judge(name: str, probe: Probe, results: list[Result], what: str) -> Check:
    ok = [r for r in results if r.ok]
    slowest = max((r.e2e_s for r in results), default=0.0)
    value = f"{len(ok)}/{len(results)} ok, slowest {slowest:.2f} s"
    if len(ok) == len(results) and slowest <= probe.within_s:
        return Check(name, "PASS", value, f"{what}, each within {probe.within_s:g} s")
    errors = sorted({r.error or f"HTTP {r.status}" for r in results if not r.ok})
    return Check(name, "FAIL", value, f"{what}, each within {probe.within_s:g} s: " + (", ".join(errors) or "too slow"))


async def readiness(client: Client, ready: Readiness) -> Check:
    """GET the path until it answers 2xx or the deadline passes; the last answer (or error) is the reason."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + ready.within_s
    last = "no answer"
    while True:
        try:
            left = max(0.05, deadline - loop.time())
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the answer when a cancel (Ctrl-C, the run's
            # stop) lands as the answer completes, and the poll would then go on to its deadline.
            async with asyncio.timeout(min(left, 10.0)):
                resp = await client.get(ready.path)
            if 200 <= resp.status < 300:
                return Check("readiness", "PASS", f"{ready.path} {resp.status} after {loop.time() - start:.2f} s",
                             f"polled every {POLL_S:g} s, deadline {ready.within_s:g} s")  # fmt: skip
            last = f"HTTP {resp.status}"
        except (HttpError, TimeoutError) as exc:
            last = type(exc).__name__
        if loop.time() + POLL_S > deadline:
            return Check("readiness", "FAIL", f"{ready.path}: {last}", f"no 2xx within {ready.within_s:g} s")
        await asyncio.sleep(POLL_S)


async def before_load(client: Client, spec: GateSpec, app: AppSpec, progress: Progress) -> GateResult:
    """Readiness, the short request, the long prefill and the concurrency, in that order; ``stopped`` is set
    when readiness failed (the run stops there, see the module docstring)."""
    gate = GateResult("application")
    if app.readiness is not None:
        check = gate.add(await readiness(client, app.readiness))
        progress(f"application: readiness {check.state} ({check.value})")
        if check.state == "FAIL":
            gate.stopped = f"the target was not ready ({check.value}); no load was sent"
            return gate
    checks = (("short_request", app.short_request, "one short request"),
              ("long_prefill", app.long_prefill, "one long-prefill request"),
              ("concurrency", app.concurrency, "simultaneous requests"))  # fmt: skip
    for name, probe, what in checks:
        if probe is None:
            continue
        label = f"{what} ({probe.requests} x {probe.prompt_tokens} prompt tokens)" if probe.requests > 1 else \
            f"{what} ({probe.prompt_tokens} prompt tokens)"  # fmt: skip
        check = gate.add(_judge(name, probe, await _requests(client, spec, probe, name), label))
        progress(f"application: {name} {check.state} ({check.value})")
    return gate


def _stat(pid: int, proc_root: str) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (state first); empty when the process is gone."""
    text = read_text(under(proc_root, str(pid), "stat")).text
    return text.rpartition(")")[2].split() if text else []


def start_time(pid: int, proc_root: str = "/proc") -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot): with the PID, it names one process for its life."""
    fields = _stat(pid, proc_root)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _exited(pid: int, started: int | None, proc_root: str) -> bool:
    """Gone, a zombie (exited, not yet reaped by its parent), or replaced by another process with its PID."""
    fields = _stat(pid, proc_root)
    return not fields or fields[0] in ("Z", "X") or (int(fields[19]) if len(fields) > 19 else None) != started


async def graceful_termination(client: Client, spec: GateSpec, probe: Probe, pid: int, started: int | None,
                               progress: Progress, proc_root: str = "/proc") -> Check:  # fmt: skip
    """SIGTERM ``pid`` while ``probe.requests`` requests are in flight: they must complete (2xx) and the process
    must exit within ``probe.within_s`` of the signal."""
    name = "graceful_termination"
    if started is None or start_time(pid, proc_root) != started:
        return Check(name, "FAIL", f"pid {pid} is not the process the gate started with",
                     "it exited or was replaced during the run; nothing was signalled")  # fmt: skip
    loop = asyncio.get_running_loop()
    bounded = replace(spec, request_timeout_s=probe.within_s)
    step = _step(probe, name, stream=spec.stream)
    rng = random.Random(f"{spec.seed}:application:{name}")
    deadlines = Deadlines(loop, probe.within_s)
    try:
        return await _terminate(client, bounded, probe, step, rng, deadlines, pid, started, progress, proc_root)
    finally:
        deadlines.close()


async def _until_read(client: Client, tasks: list[asyncio.Task[Result]], pid: int, proc_root: str, deadline: float) -> int:
    """Wait until the server has read every request (see ``diag.gate.inflight``), one finished, or the deadline passed;
    returns how many are still not read (0: all in flight).

    Why not a fixed pause: on a loaded host the client, the kernel's accept queue or the server's own loop may hold a
    request back longer than any pause chosen on a quiet one, and a signal before the server has read it makes a
    refused request look like a failed drain. An in-process app (no socket) gets its requests in their own tasks,
    with no I/O between: a few loop turns hand them over."""
    loop = asyncio.get_running_loop()
    if not isinstance(client, HttpClient):
        for _ in range(IN_PROCESS_TURNS):
            await asyncio.sleep(0)
        return 0
    while True:
        sent = client.in_progress()
        server_tables, own_tables = TcpTables(pid, proc_root), TcpTables(os.getpid(), proc_root)
        unread = len(tasks) - sum(s.unsent == 0 and read_by_server(server_tables, own_tables, s.local, s.server) for s in sent)
        if unread <= 0 or any(t.done() for t in tasks) or loop.time() >= deadline:
            return max(0, unread)
        await asyncio.sleep(IN_FLIGHT_POLL_S)


async def _terminate(client: Client, bounded: GateSpec, probe: Probe, step: Step, rng: random.Random, deadlines: Deadlines,
                     pid: int, started: int | None, progress: Progress, proc_root: str) -> Check:  # fmt: skip
    name = "graceful_termination"
    loop = asyncio.get_running_loop()
    now = loop.time()
    tasks = [loop.create_task(send(client, bounded, request_body(bounded, step, rng), now, deadlines))  # type: ignore[arg-type]
             for _ in range(probe.requests)]  # fmt: skip
    # half the requests' own bound to reach the server: the other half is theirs to finish in once it is signalled
    unread = await _until_read(client, tasks, pid, proc_root, now + probe.within_s / 2)
    if any(t.done() for t in tasks):
        done = sum(t.done() for t in tasks)
        await asyncio.gather(*tasks)
        return Check(name, "FAIL", f"{done} of {probe.requests} requests finished before the signal",
                     f"nothing was in flight to drain: give graceful_termination longer requests (output_tokens: "
                     f"{probe.output_tokens * 4}); nothing was signalled")  # fmt: skip
    if unread:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return Check(name, "FAIL", f"{unread} of {probe.requests} requests not read by pid {pid} in {probe.within_s / 2:g} s",
                     "the server never had them all in flight (its socket table shows no such connection, or its bytes "
                     "unread); nothing was signalled")  # fmt: skip
    progress(f"application: SIGTERM to pid {pid} with {probe.requests} requests in flight")
    os.kill(pid, signal.SIGTERM)
    signalled = loop.time()
    results = await asyncio.gather(*tasks)
    deadline = signalled + probe.within_s
    while not _exited(pid, started, proc_root) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    exited_s = loop.time() - signalled
    exited = _exited(pid, started, proc_root)
    ok = [r for r in results if r.ok]
    value = f"{len(ok)}/{len(results)} in-flight requests completed; " + (
        f"exited {exited_s:.2f} s after SIGTERM" if exited else f"still running {probe.within_s:g} s after SIGTERM"
    )
    how = "streamed" if step.stream else "not streamed"
    if exited and len(ok) == len(results):
        return Check(name, "PASS", value, f"bound {probe.within_s:g} s; the requests {how}, as the spec's clients send them")
    errors = sorted({r.error or f"HTTP {r.status}" for r in results if not r.ok})
    why = ([f"requests cut off ({', '.join(errors)})"] if errors else []) + ([] if exited else ["the process did not exit"])
    tail = f" (requests {how}; the process was sent SIGTERM only; it is left as it is)"
    return Check(name, "FAIL", value, "; ".join(why) + tail)
