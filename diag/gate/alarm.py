"""A callback on the event loop at a monotonic time, to the tens of microseconds, without spinning.

Why: asyncio's own timers wake through ``epoll_wait``, whose timeout is whole milliseconds (rounded up), so a
``call_at`` runs up to 1 ms late -- the whole budget of a load generator's send lag. Spinning through the last
millisecond (yielding to the loop until the time comes) is on time when the process has a CPU, but burns up to a
millisecond of CPU per arrival, and on a shared host a process that spins is one the kernel's scheduler treats as
CPU-bound: it is preempted more, and waits longer for a CPU when it wakes. A ``timerfd`` (a kernel hrtimer that
makes a file descriptor readable at an absolute ``CLOCK_MONOTONIC`` time) is watched by the loop like any socket:
the loop sleeps until that moment exactly, and the callback runs as the loop's first read of that wake-up.

``Alarm`` uses a timerfd where the C library has one (Linux), set ``EARLY_S`` (0.2 ms) early, and spins the rest
(``call_soon`` until the time comes); else ``call_at`` a millisecond early and the same spin. ``time.monotonic`` is
``CLOCK_MONOTONIC`` and asyncio's own ``loop.time()``, so the times are the load generator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable

SPIN_S = 0.001  # the fallback's spin: epoll rounds a wait up to whole milliseconds
# The timerfd wakes the loop this much early and the rest is spun: a wake-up itself takes ~0.1 ms at the median here
# (a process that only sleeps wakes that late), which a spin this short removes for ~2 % of a core at 100 arrivals/s.
EARLY_S = 0.0002
_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1
_PR_SET_TIMERSLACK = 29


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.timerfd_settime.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p)
        libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


class Alarm:
    """``alarm.at(t)`` runs ``callback`` once at monotonic time ``t`` (at once if it has passed); a new ``at``
    replaces the pending one; ``cancel`` drops it; ``close`` releases the timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None], *, precise: bool = True) -> None:
        self.loop = loop
        self.callback = callback
        self.fd = -1
        self.kind = "spin"
        self._spec = _Itimerspec()
        self._handle: asyncio.Handle | None = None
        self._due = float("inf")
        if precise and _LIBC is not None:
            fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
            if fd >= 0:
                self.fd, self.kind = fd, "timerfd"
                loop.add_reader(fd, self._fired)
                # The kernel may defer a timer by the thread's slack (50 us by default) to batch wake-ups: a tenth
                # of the whole budget. This thread (the loop's: it does the waiting) asks for none; failing is fine.
                _LIBC.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)

    def at(self, when: float) -> None:
        self._due = when
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self.fd >= 0:  # re-arming replaces a pending time; a stale wake-up is ignored in _fired
            wake = when - EARLY_S
            sec = int(wake)
            self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = sec, max(1, int((wake - sec) * 1e9))
            if _LIBC.timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, self._spec, None) != 0:  # type: ignore[union-attr]
                raise OSError(ctypes.get_errno(), "timerfd_settime")
            return
        self._handle = self.loop.call_at(when - SPIN_S, self._spin)

    def cancel(self) -> None:
        self._due = float("inf")
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self.fd >= 0:
            self._spec.it_value.tv_sec = self._spec.it_value.tv_nsec = 0  # a zero time disarms it
            _LIBC.timerfd_settime(self.fd, 0, self._spec, None)  # type: ignore[union-attr]
            self._drain()

    def close(self) -> None:
        self.cancel()
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)  # the expiry count: reading it makes the descriptor unreadable again

    def _fired(self) -> None:
        self._drain()
        left = self._due - time.monotonic()
        if left > EARLY_S + 0.001:  # an expiry of a time since replaced or cancelled: the timer holds the new one
            return
        self._spin()

    def _spin(self) -> None:
        if time.monotonic() < self._due:
            self._handle = self.loop.call_soon(self._spin)
            return
        self._handle = None
        self.callback()
