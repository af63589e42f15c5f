"""Bounded reads and commands: the tail of a file under a cap, a command killed with its whole group at its deadline.

Both run inside an abandonable worker (``runner.py``): a file on a hung mount blocks whatever flags we pass,
and a command on a wedged driver ignores everything but SIGKILL. So neither pretends it cannot block; each
checks its context's cancel flag between chunks, keeps the TAIL of what it reads (the end of a log is what
explains the end of an incident) and says when it cut (``truncated``).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import stat
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

CHUNK = 64 * 1024


def describe(exc: OSError) -> str:
    """An OSError as a reader wants it in a reason: "Permission denied", not "[Errno 13] ..."."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


def text_of(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class _Flag(Protocol):
    def is_set(self) -> bool: ...


class Deadline(Protocol):
    """What a bounded read needs of its caller's context (``plugin.Context``)."""

    cancel: _Flag
    deadline: float

    def check(self) -> None: ...


@dataclass
class TailRead:
    data: bytes
    truncated: bool
    size: int  # bytes the source had (read or skipped)


def read_tail(path: str, cap: int, ctx: Deadline | None = None) -> TailRead:
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
    argv: Sequence[str], ctx: Deadline, cap: int, env: dict[str, str] | None = None, sink: bytearray | None = None
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
