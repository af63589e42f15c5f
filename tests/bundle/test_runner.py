"""Collectors with deadlines: bounded tail reads, commands killed with their whole group, hung workers abandoned."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from diag.bundle import runner
from diag.bundle.bounded import read_tail, run_command
from diag.bundle.plugin import Context, Output
from diag.bundle.runner import Collector, command_output, run_collectors


def _ctx(seconds: float) -> Context:
    return Context(threading.Event(), time.monotonic() + seconds)


def _gone(pid: int, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie still answers kill(0); its /proc stat says Z
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
                return True
        time.sleep(0.05)
    return False


def test_read_tail_keeps_the_end_of_a_long_regular_file(tmp_path: Path) -> None:
    f = tmp_path / "log"
    f.write_text("".join(f"line {i:05d}\n" for i in range(10000)))  # 110 000 bytes
    tail = read_tail(str(f), 1000)
    assert tail.truncated and tail.size == f.stat().st_size
    text = tail.data.decode()
    assert text.endswith("line 09999\n")
    assert text.startswith("line ") and len(tail.data) <= 1000  # the cut-off half line was dropped
    small = read_tail(str(f), 1 << 20)
    assert not small.truncated and small.data == f.read_bytes()


def test_read_tail_keeps_the_end_of_a_stream(tmp_path: Path) -> None:
    r, w = os.pipe()

    def writer() -> None:
        with os.fdopen(w, "wb") as fh:
            for i in range(5000):
                fh.write(f"event {i:05d}\n".encode())

    threading.Thread(target=writer, daemon=True).start()
    tail = read_tail(f"/proc/self/fd/{r}", 2000)
    os.close(r)
    assert tail.truncated and tail.size == 5000 * 12
    assert tail.data.decode().endswith("event 04999\n") and len(tail.data) <= 2000


@pytest.mark.process
def test_a_command_past_its_deadline_is_killed_with_its_whole_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    script = f"echo started; sleep 300 & echo $! > {pidfile}; wait"
    res = run_command(["sh", "-c", script], _ctx(1.5), cap=1 << 20)
    assert res.timed_out
    assert res.stdout == b"started\n"  # what it printed before the kill is kept
    assert _gone(int(pidfile.read_text()))  # the grandchild went with the group


@pytest.mark.process
def test_command_output_over_the_cap_keeps_the_tail() -> None:
    code = "import sys\nfor i in range(100000): sys.stdout.write(f'row {i:06d}\\n')"
    res = run_command([sys.executable, "-c", code], _ctx(30), cap=4096)
    assert not res.timed_out and res.return_code == 0 and res.truncated
    assert res.stdout.decode().endswith("row 099999\n") and len(res.stdout) <= 4096


def test_a_hung_collector_is_abandoned_and_the_others_still_deliver(tmp_path: Path) -> None:
    fifo = tmp_path / "hung"
    os.mkfifo(fifo)

    def hang(ctx: Context) -> Output:  # open() of a FIFO with no writer blocks, like a read on a hung mount
        read_tail(str(fifo), 1024, ctx)
        return Output()

    def fine(ctx: Context) -> Output:
        return Output(extra={"value": 42})

    def broken(ctx: Context) -> Output:
        raise RuntimeError("collector bug")

    lines: list[str] = []
    try:
        runs = run_collectors(
            [Collector("hung", "a FIFO", hang, 1.0), Collector("fine", "ok", fine, 5.0), Collector("broken", "bug", broken, 5.0)],
            time.monotonic() + 30,
            lines.append,
        )
    finally:  # release the abandoned thread: a writer appearing unblocks its open()
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    by = {r.name: r for r in runs}
    assert by["hung"].timeout_hit and by["hung"].abandoned and by["hung"].status == "timeout" and by["hung"].output is None
    assert by["fine"].status == "ok" and by["fine"].output.extra == {"value": 42} and not by["fine"].timeout_hit
    assert by["broken"].status == "error" and "collector bug" in by["broken"].reason
    assert any("hung: TIMED OUT" in line for line in lines)


def test_the_bundle_deadline_caps_every_collector_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    # "Not abandoned" asks whether the collector was cancelled at the deadline and answered, not how soon a loaded
    # host ran its thread again: with the runner's 0.5 s grace, a test process stalled that long would read as a
    # collector that ignored the cancel. A grace far longer costs nothing when the answer comes (the runner
    # waits for it, not for the grace), and a runner that never cancels still ends with the collector abandoned.
    monkeypatch.setattr(runner, "GRACE_S", 10.0)

    def slow(ctx: Context) -> Output:
        while not ctx.cancel.is_set():
            time.sleep(0.01)
        return Output(status="ok", timeout_hit=True, reason="stopped")

    (run,) = run_collectors([Collector("slow", "cooperative", slow, 600.0)], time.monotonic() + 0.5, lambda _: None)
    assert run.timeout_s <= 0.5 and run.timeout_hit and not run.abandoned  # it acknowledged the cancel
    assert run.reason == "stopped"  # the collector's own answer, not a partial kept from an abandoned one


@pytest.mark.process
def test_a_command_that_prints_then_hangs_keeps_its_output_when_killed_at_once(tmp_path: Path) -> None:
    # Printed and still in the pipe when the deadline hits: read after the kill, not lost with the process.
    pidfile = tmp_path / "pid"
    res = run_command(["sh", "-c", f"echo $$ > {pidfile}; echo '==== NVSMI LOG ===='; exec sleep 300"], _ctx(0.8), 1 << 20)
    assert res.timed_out and res.stdout == b"==== NVSMI LOG ====\n"
    assert _gone(int(pidfile.read_text()))


@pytest.mark.process
def test_an_abandoned_command_collector_keeps_what_was_printed(tmp_path: Path) -> None:
    """A collector stuck past its deadline (here: running its command under a later deadline of its own, as a
    worker blocked in a kill or a slow wait would be) is abandoned -- and what its command printed is kept."""
    pidfile = tmp_path / "pid"
    argv = ["sh", "-c", f"echo $$ > {pidfile}; echo 'GPU 00000000:3B:00.0'; exec sleep 300"]

    def stuck(ctx: Context) -> Output:
        own = Context(threading.Event(), time.monotonic() + 4.0)
        ctx.partial = lambda: own.partial() if own.partial is not None else Output()
        return command_output(argv, "raw/nvidia-smi-q.txt", 1 << 20, own)

    (run,) = run_collectors([Collector("nvidia-smi", "stuck", stuck, 1.0)], time.monotonic() + 30, lambda _: None)
    assert run.abandoned and run.timeout_hit and run.status == "timeout"
    assert run.output is not None and run.output.timeout_hit
    (f,) = run.output.files
    assert f.path == "raw/nvidia-smi-q.txt" and f.text == "GPU 00000000:3B:00.0\n"
    assert "printed before it was abandoned" in run.reason
    assert _gone(int(pidfile.read_text()))  # the stuck worker still kills its command at its own deadline


def test_the_kmsg_collector_stops_at_its_own_budget_and_keeps_its_lines(tmp_path: Path) -> None:
    """A source that never drains (here /dev/zero; on a host that thrashes, a slow CPU) must not run the
    collector into its deadline: it returns what it read before the deadline, saying where it stopped."""
    from diag.bundle.options import BundleOptions
    from diag.bundle.plugin import Phase, State
    from diag.bundle.plugins import PLUGINS
    from diag.bundle.redactor import Redactor
    from diag.bundle.runner import collectors

    options = BundleOptions(kmsg_path="/dev/zero")
    state = State(options, Redactor(), time.time(), time.time() - 60, tmp_path)
    (collector,) = [c for c in collectors(PLUGINS, state, Phase.AFTER_SNAPSHOT) if c.name == "kmsg"]
    assert collector.timeout_s == 5.0 and collector.plugin == "kernel"  # as the kernel plugin declares
    collector.timeout_s = 1.5
    (run,) = run_collectors([collector], time.monotonic() + 30, lambda _: None)
    assert run.status == "ok" and not run.timeout_hit and not run.abandoned  # done before its 1.5 s deadline
    assert "stopped at its time budget" in run.reason and run.output.extra["records_read"] > 0
