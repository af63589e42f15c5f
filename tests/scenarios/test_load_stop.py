"""The load driver's ``stop``: a caller driving load from a thread ends it early, promptly and cleanly.

Why: a test that waits for what a load causes (an alert delivered and diagnosed) drives the load in the
background and stops it once that has happened; a stop that is not noticed until the plan's end saves nothing,
and one that leaves later phases running would keep loading a server the test has moved on from.

No server is needed: the closed-loop clients talk to a loopback port nothing listens on (port 1, tcpmux, which
nothing here serves), each refusal followed by the driver's retry pause -- the pause a stop must cut short.
Nothing here binds a socket or starts a process (the quick tier).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from diag.demo.scenarios.load import Phase, completion, drive, idle

NOWHERE = "http://127.0.0.1:1"  # connection refused at once
LONG_S = 60.0  # every phase would run this long without the stop: a stopped run ends far sooner


def _stop_after_start_of(phase: str, seconds: float) -> tuple[threading.Event, Callable[[str], None]]:
    """A stop set ``seconds`` after the driver announces ``phase``, and the progress callback that starts its clock.

    Counted from the phase, not from the call to ``drive``: the driver first builds its HTTP client, which took
    0.03-0.13 s on a loaded two-core host and can take longer than the whole wait when the host stalls the test,
    and a stop set before the phase begins rightly skips the phase this test means to see stopped."""
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.daemon = True

    def progress(message: str) -> None:
        if message.startswith(f"load phase {phase}:"):
            timer.start()

    return stop, progress


def test_a_stop_ends_a_closed_loop_phase_and_skips_the_rest() -> None:
    phases = [Phase("busy", LONG_S, 2, completion(8, 4)), idle("after", LONG_S)]
    stop, progress = _stop_after_start_of("busy", 0.5)
    t0 = time.monotonic()
    report = drive(NOWHERE, phases, request_timeout_s=5.0, stop=stop, progress=progress)
    took = time.monotonic() - t0
    assert took < 10, f"the stop was not noticed: the run took {took:.1f} s"
    assert report.stopped
    assert [p.name for p in report.phases] == ["busy"], "a phase after the stop started"
    (busy,) = report.phases
    assert busy.stopped and busy.sent >= 2 and sum(busy.statuses.values()) == busy.sent, busy.summary()
    assert "stopped early" in busy.summary()


def test_a_stop_ends_an_idle_phase_before_the_load_starts() -> None:
    phases = [idle("quiet", LONG_S), Phase("never", LONG_S, 4, completion(8, 4))]
    stop, progress = _stop_after_start_of("quiet", 0.3)
    t0 = time.monotonic()
    report = drive(NOWHERE, phases, stop=stop, progress=progress)
    assert time.monotonic() - t0 < 10
    assert report.stopped and [p.name for p in report.phases] == ["quiet"]
    assert report.phases[0].stopped and report.sent == 0


def test_a_stop_set_before_the_run_sends_nothing() -> None:
    stop = threading.Event()
    stop.set()
    report = drive(NOWHERE, [Phase("never", LONG_S, 4, completion(8, 4))], stop=stop)
    assert report.stopped and report.phases == [] and report.sent == 0


def test_a_plan_that_runs_to_its_end_is_not_stopped() -> None:
    # the stop is never set: every phase runs its whole duration and none reads as cut short
    phases = [Phase("short", 0.6, 1, completion(8, 4)), idle("pause", 0.2)]
    t0 = time.monotonic()
    report = drive(NOWHERE, phases, request_timeout_s=5.0, stop=threading.Event())
    assert time.monotonic() - t0 >= 0.8
    assert not report.stopped and not any(p.stopped for p in report.phases)
    assert [p.name for p in report.phases] == ["short", "pause"] and report.phases[0].sent >= 1
