"""Collectors with deadlines: every collector runs in a worker it can abandon, under a timeout.

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

import contextlib
import os
import selectors
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

CHUNK = 64 * 1024
GRACE_S = 0.5  # after a timeout: how long a collector may take to acknowledge cancellation


@dataclass
class OutFile:
    """One file a collector wants in the bundle: text (redacted as text) or records (redacted per field)."""

    path: str  # relative to the bundle root, e.g. raw/proc/meminfo
    text: str
    truncated: bool = False
    source: str | None = None  # what it is a copy of (a path or a command)
    source_bytes: int | None = None  # how big the source was, when known


@dataclass
class Output:
    """What a collector returns. ``status`` ok | skipped | error; ``reason`` says why when not ok."""

    status: str = "ok"
    reason: str | None = None
    files: list[OutFile] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    return_code: int | None = None
    argv: list[str] | None = None
    timeout_hit: bool = False  # a command killed by its own deadline (partial output kept)
    extra: dict[str, Any] = field(default_factory=dict)


class Cancelled(Exception):
    """Raised inside a collector that noticed its cancel flag."""


CollectorFn = Callable[["Context"], Output]


@dataclass
class Context:
    """What a collector gets: its cancel flag and its own deadline (monotonic seconds).

    ``partial``: a collector that produces output over time (a command's stdout) sets it to a function
    returning what it has so far. If the collector is abandoned at its deadline, the runner keeps that
    -- a snapshot taken then, so nothing the abandoned worker does later can reach the bundle.
    """

    cancel: threading.Event
    deadline: float
    partial: Callable[[], Output] | None = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def check(self) -> None:
        if self.cancel.is_set():
            raise Cancelled


@dataclass
class Collector:
    name: str
    description: str
    fn: CollectorFn
    timeout_s: float


@dataclass
class Run:
    """The manifest entry of one collector run (times are Unix seconds)."""

    name: str
    description: str
    timeout_s: float
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
        run = Run(c.name, c.description, round(c.timeout_s, 3))
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


# --------------------------------------------------------------------------- bounded reads


@dataclass
class TailRead:
    data: bytes
    truncated: bool
    size: int  # bytes the source had (read or skipped)


def read_tail(path: str, cap: int, ctx: Context | None = None) -> TailRead:
    """The last ``cap`` bytes of a file (regular: seek; /proc, pipes: stream keeping the tail).

    Blocking on purpose: a file on a hung mount blocks whatever flags we pass, so the caller runs
    this in an abandonable collector instead of pretending it cannot block.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size > cap:
            os.lseek(fd, st.st_size - cap, os.SEEK_SET)
            parts = []
            got = 0
            while got < cap:
                if ctx is not None:
                    ctx.check()
                chunk = os.read(fd, min(CHUNK, cap - got))
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
            return TailRead(_drop_partial_line(b"".join(parts)), True, st.st_size)
        buf = bytearray()
        total = 0
        while True:
            if ctx is not None:
                ctx.check()
            chunk = os.read(fd, CHUNK)
            if not chunk:
                break
            total += len(chunk)
            buf += chunk
            if len(buf) > 2 * cap:
                del buf[: len(buf) - cap]
        truncated = total > cap
        data = bytes(buf[-cap:]) if truncated else bytes(buf)
        return TailRead(_drop_partial_line(data) if truncated else data, truncated, total)
    finally:
        os.close(fd)


def _drop_partial_line(data: bytes) -> bytes:
    """A tail starts mid-line; drop that fragment (it could be half of a secret the rules cannot see)."""
    newline = data.find(b"\n")
    return data[newline + 1 :] if 0 <= newline < len(data) - 1 else data


@dataclass
class CommandResult:
    stdout: bytes
    stderr: bytes
    return_code: int | None
    timed_out: bool
    truncated: bool
    duration_s: float


def run_command(
    argv: Sequence[str], ctx: Context, cap: int, env: dict[str, str] | None = None, sink: bytearray | None = None
) -> CommandResult:
    """Run ``argv`` with stdin closed, keeping the tail of stdout (``cap``) and of stderr (64 KiB).

    Killed -- its whole process group -- when ``ctx``'s deadline passes or it is cancelled; what it
    printed until then is kept (the pipes are drained after the kill). ``sink``: the buffer stdout is
    read into as it arrives (at most 2 x ``cap``, the tail), so a caller can publish it through
    ``Context.partial`` while the command still runs.
    """
    started = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    out, err = (sink if sink is not None else bytearray()), bytearray()
    total_out = 0
    timed_out = False
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    for pipe, buf in ((proc.stdout, out), (proc.stderr, err)):
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ, buf)
    try:
        open_pipes = 2
        while open_pipes:
            left = ctx.deadline - time.monotonic()
            if left <= 0 or ctx.cancel.is_set():
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.2)):
                got = _read_into(key.fd, key.data, cap if key.data is out else 64 * 1024)
                if got is None:
                    sel.unregister(key.fileobj)
                    open_pipes -= 1
                elif key.data is out:
                    total_out += got
        if timed_out:
            _kill_group(proc)
            total_out += _drain(sel, out, cap)
        else:
            try:
                proc.wait(max(0.05, ctx.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # closed its pipes but did not exit
                timed_out = True
                _kill_group(proc)
    finally:
        sel.close()
        for pipe in (proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                pipe.close()
    truncated = total_out > cap
    data = bytes(out[-cap:]) if truncated else bytes(out)
    return CommandResult(
        _drop_partial_line(data) if truncated else data,
        bytes(err[-64 * 1024 :]),
        proc.returncode,
        timed_out,
        truncated,
        time.monotonic() - started,
    )


def _read_into(fd: int, buf: bytearray, limit: int) -> int | None:
    """One non-blocking read appended to ``buf`` (kept under 2 x ``limit``, the tail); bytes read, None at EOF."""
    try:
        chunk = os.read(fd, CHUNK)
    except BlockingIOError:
        return 0
    if not chunk:
        return None
    buf += chunk
    if len(buf) > 2 * limit:
        del buf[: len(buf) - limit]
    return len(chunk)


def _drain(sel: selectors.BaseSelector, out: bytearray, cap: int, within_s: float = 0.3) -> int:
    """After the kill: what is still in the pipes (written before the kill, not yet read). Bounded in time:
    a grandchild that left the process group may still hold a pipe open."""
    deadline = time.monotonic() + within_s
    total = 0
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
            got = _read_into(key.fd, key.data, cap if key.data is out else 64 * 1024)
            if got is None:
                sel.unregister(key.fileobj)
            elif key.data is out:
                total += got
    return total


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(2.0)
