"""The runner: it executes the plugins' declarations (``plugin.py``), each step in a worker it can abandon.

``collectors(plugins, state, phase)`` turns every step of the phase's plugins into a ``Collector`` (the
plugin's checks, then the step: files copied, a command run, or the plugin's own gather function), and
``run_collectors`` runs them all at once, each under min(its timeout, the phase's deadline).

Why: the bundle is taken on exactly the machine that is sick. sos report hung for hours on one
stuck command until it wrapped each command in a timeout, and NVIDIA's bug-report script has a
``--safe-mode`` that skips ``nvidia-smi`` because it hangs on a wedged driver. So:

- each collector runs in a *daemon* thread; the main thread only ever waits with a timeout. A
  collector that does not return in time is recorded as ``timeout_hit`` and abandoned (its result,
  should it ever arrive, is ignored), and the process can still exit: daemon threads do not hold
  the interpreter open, whatever they are blocked in (a FIFO's ``open``, a hung mount's ``read``);
- collectors never write bundle files themselves: they *return* their content, which the main
  thread redacts, writes and hashes -- so an abandoned collector can never change the bundle after
  it was hashed. (The history collector, which streams too much to hold, writes into a staging
  folder that the main thread adopts only when the collector finished or acknowledged cancellation.)
- external commands run in their own process group, are read through a size-capped tail buffer,
  and are killed (the whole group) at their deadline, so a stuck ``nvidia-smi`` is not left behind;
- file reads keep the TAIL of a long file under a cap (the end of a log is what explains the end of
  an incident), and say so (``truncated``).
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from diag.bundle.bounded import describe, read_tail, run_command, text_of
from diag.bundle.plugin import (
    COMMON,
    Cancelled,
    Check,
    Command,
    Context,
    Copy,
    Found,
    Gather,
    OutFile,
    Output,
    Phase,
    Plugin,
    Redaction,
    State,
    Step,
    seconds,
)

CollectorFn = Callable[[Context], Output]
GRACE_S = 0.5  # after a timeout: how long a collector may take to acknowledge cancellation


@dataclass
class Collector:
    """One abandonable unit of work: a plugin's step (or the analysis, the report)."""

    name: str
    description: str
    fn: CollectorFn
    timeout_s: float
    plugin: str | None = None
    redaction: Redaction = COMMON


@dataclass
class Run:
    """The manifest entry of one collector run (times are Unix seconds)."""

    name: str
    description: str
    timeout_s: float
    plugin: str | None = None
    redaction: Redaction = COMMON
    start: float = 0.0
    end: float = 0.0
    duration_s: float = 0.0
    timeout_hit: bool = False
    abandoned: bool = False
    status: str = "pending"
    reason: str | None = None
    output: Output | None = None


class _Worker:
    def __init__(self, collector: Collector, deadline: float) -> None:
        self.collector = collector
        self.cancel = threading.Event()
        self.ctx = Context(self.cancel, deadline)
        self.done = threading.Event()
        self.result: Output | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"bundle-{collector.name}", daemon=True)

    def _run(self) -> None:
        try:
            self.result = self.collector.fn(self.ctx)
        except Cancelled:
            self.result = Output(status="error", reason="cancelled at its deadline", timeout_hit=True)
        except BaseException as exc:  # a collector bug must cost that collector, not the bundle
            self.error = exc
        finally:
            self.done.set()


def run_collectors(collectors: Sequence[Collector], deadline: float, progress: Callable[[str], None]) -> list[Run]:
    """Start every collector at once, each under min(its timeout, ``deadline``); return their runs.

    Never blocks past the latest of those limits (+ a short grace for acknowledging cancellation).
    """
    runs: list[Run] = []
    workers: list[tuple[_Worker, Run, float]] = []
    for c in collectors:
        run = Run(c.name, c.description, round(c.timeout_s, 3), c.plugin, c.redaction)
        now = time.monotonic()
        own_deadline = min(now + c.timeout_s, deadline)
        run.timeout_s = round(max(0.0, own_deadline - now), 3)
        run.start = time.time()
        worker = _Worker(c, own_deadline)
        worker.thread.start()
        workers.append((worker, run, now))
        runs.append(run)
    for worker, run, started in workers:
        worker.done.wait(max(0.0, worker.ctx.deadline - time.monotonic()))
        if not worker.done.is_set():
            worker.cancel.set()
            worker.done.wait(GRACE_S)
        run.duration_s = round(time.monotonic() - started, 4)
        run.end = run.start + run.duration_s
        if not worker.done.is_set():
            run.timeout_hit = True
            run.abandoned = True
            run.status = "timeout"
            run.reason = f"no result within {run.timeout_s:g} s; abandoned (its late result is ignored)"
            run.output = _partial_output(worker.ctx)
            if run.output is not None:
                run.reason += f"; kept what it had produced by then ({run.output.reason})"
            progress(f"{run.name}: TIMED OUT after {run.timeout_s:g} s, abandoned")
            continue
        if worker.error is not None:
            run.status = "error"
            run.reason = f"{type(worker.error).__name__}: {worker.error}"
            progress(f"{run.name}: failed ({run.reason})")
            continue
        out = worker.result or Output(status="error", reason="no result")
        run.output = out
        run.timeout_hit = out.timeout_hit
        run.status = "timeout" if out.timeout_hit else out.status
        run.reason = out.reason
        progress(f"{run.name}: {run.status}" + (f" ({run.reason})" if run.reason else "") + f" in {run.duration_s:.2f} s")
    return runs


def _partial_output(ctx: Context) -> Output | None:
    """What an abandoned collector had produced (see ``Context.partial``), or None."""
    if ctx.partial is None:
        return None
    try:
        out = ctx.partial()
    except Exception:  # a collector's snapshot function must not cost the bundle either
        return None
    out.timeout_hit = True
    return out


# --------------------------------------------------------------------------- executing the declarations


def collectors(plugins: Sequence[Plugin], state: State, phase: Phase) -> list[Collector]:
    """One collector per step of every plugin of ``phase``, in declaration order."""
    out = []
    for plugin in plugins:
        if plugin.phase is not phase:
            continue
        for step in plugin.steps_for(state.options):
            timeout = seconds(step.timeout if step.timeout is not None else plugin.timeout, state.options)
            out.append(Collector(step.name, step.description, _step_fn(plugin, step, state), timeout, plugin.name,
                                 plugin.redaction))  # fmt: skip
    return out


def _step_fn(plugin: Plugin, step: Step, state: State) -> CollectorFn:
    def fn(ctx: Context) -> Output:
        reason = first_reason(plugin.when, state)
        if reason is not None:
            return Output(status="skipped", reason=reason)
        if isinstance(step, Copy):
            return copy_files(step, state, ctx)
        if isinstance(step, Command):
            return run_declared_command(step, state, ctx)
        if isinstance(step, Gather):
            return step.fn(state, ctx)
        raise TypeError(f"{plugin.name}: not a step: {step!r}")

    return fn


def first_reason(checks: Sequence[Check], state: State) -> str | None:
    for check in checks:
        reason = check(state)
        if reason is not None:
            return reason
    return None


def copy_file(source: str, dest: str, cap: int, ctx: Context) -> OutFile:
    tail = read_tail(source, cap, ctx)
    return OutFile(dest, text_of(tail.data), tail.truncated, source, tail.size)


MAX_PROBLEMS = 10  # named one by one in the reason; the rest counted


def copy_files(step: Copy, state: State, ctx: Context) -> Output:
    """A ``Copy`` step: every file it declares (or its function finds), each tail-capped; problems named."""
    o = state.options
    found = step.files(state) if callable(step.files) else Found([s.resolve(o) for s in step.files])
    if found.skipped is not None:
        return Output(status="skipped", reason=found.skipped)
    out = Output(extra=dict(found.notes))
    problems = list(found.problems)
    cap = getattr(o, step.cap)
    for item in found.files:
        ctx.check()
        try:
            out.files.append(copy_file(item.source, item.dest, cap, ctx))
        except OSError as exc:
            if not ((item.optional and exc.errno == errno.ENOENT) or exc.errno in step.not_problems):
                problems.append(f"{item.source}: {describe(exc)}")
    if problems:
        more = len(problems) - MAX_PROBLEMS
        out.reason = "; ".join(problems[:MAX_PROBLEMS]) + (f" (+{more} more)" if more > 0 else "")
        out.status = "ok" if out.files else "error"
    return out


def run_declared_command(step: Command, state: State, ctx: Context) -> Output:
    """A ``Command`` step: the program found on PATH, the step's checks, then the command under the deadline."""
    o = state.options
    program = step.program(o) if callable(step.program) else step.program
    exe = shutil.which(program)
    if exe is None:
        return Output(status="skipped", reason=step.missing.format(program=program))
    reason = first_reason(step.requires, state)
    if reason is not None:
        return Output(status="skipped", reason=reason)
    env = {**os.environ, **dict(step.env)} if step.env else None
    return command_output([exe, *step.args(state)], step.dest, getattr(o, step.cap), ctx, env)


def command_output(argv: list[str], dest: str, cap: int, ctx: Context, env: dict[str, str] | None = None) -> Output:
    """Run a command into ``dest``; its stdout is published as it arrives, so even an abandoned run keeps it."""
    printed = bytearray()

    def so_far() -> Output:
        data = bytes(printed)  # one copy under the GIL: the worker may still be appending
        kept = data[-cap:] if len(data) > cap else data
        return Output(argv=argv, files=[OutFile(dest, text_of(kept), len(data) > cap, " ".join(argv))],
                      reason=f"{len(kept)} bytes of output printed before it was abandoned")  # fmt: skip

    ctx.partial = so_far
    res = run_command(argv, ctx, cap, env=env, sink=printed)
    out = Output(argv=argv, return_code=res.return_code, timeout_hit=res.timed_out)
    out.files.append(OutFile(dest, text_of(res.stdout), res.truncated, " ".join(argv)))
    if res.timed_out:
        out.reason = f"killed after {res.duration_s:.1f} s (timeout); kept {len(res.stdout)} bytes of output"
    elif res.return_code != 0:
        out.status = "error"
        err = text_of(res.stderr).strip().splitlines()
        out.reason = f"exit code {res.return_code}" + (f": {err[-1][:300]}" if err else "")
    return out
