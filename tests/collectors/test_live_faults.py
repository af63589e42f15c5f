"""Faults the host agent must survive, for real: its disk fills, its file system turns read-only, its file is
deleted or replaced under it, and processes come and go by the thousand while it samples.

The disk faults use a small tmpfs mounted by the test (root only; unmounted in cleanup), so "full" and
"read-only" are the kernel's own ENOSPC and EROFS, met by SQLite through the agent's open file.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from collectors.agent import Agent
from collectors.recorder import FlightRecorder
from collectors.snapshot import SamplerConfig, Snapshot, SnapshotTaker

DIAG = [sys.executable, "-m", "diag.cli"]
SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


def _require_mount() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


class _Agent:
    """``diag collect`` as a subprocess on a free loopback port; ``metrics()`` scrapes it."""

    def __init__(self, recorder: Path, *extra: str, prefix: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [*prefix, *DIAG, "collect", "--interval", "100ms", "--listen", "127.0.0.1:0", "--recorder", str(recorder), "--no-gpu",
             "--no-kmsg", *extra],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stderr is not None
        banner = ""
        for line in self.proc.stderr:
            banner += line
            if "sampling every" in line:
                break
        match = re.search(r"http://127\.0\.0\.1:\d+/metrics", banner)
        assert match, banner
        self.url = match.group(0)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url, timeout=10).text.splitlines():
            m = SAMPLE_RE.match(line)
            if m and not line.startswith("#"):
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_for(self, predicate: Callable[[dict[str, float]], bool], timeout: float) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        metrics: dict[str, float] = {}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the agent exited"
            metrics = self.metrics()
            if predicate(metrics):
                return metrics
            time.sleep(0.2)
        seen = {k: v for k, v in metrics.items() if "recorder" in k}
        raise AssertionError(f"not reached in {timeout} s; last scrape: {seen}")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        rest = self.proc.stderr.read() if self.proc.stderr else ""
        assert self.proc.returncode == 0, rest
        return rest


def _host_span(path: Path) -> tuple[int, float, float]:
    """(host rows, oldest ts, newest ts), read the way `diag analyze` reads: read-only, beside the writer."""
    with FlightRecorder(path, readonly=True) as rec:
        n, first, last = rec._db.execute("SELECT COUNT(*), MIN(ts), MAX(ts) FROM records WHERE kind = 'host'").fetchone()
        assert rec.integrity_ok()
    return n, first or 0.0, last or 0.0


def _wait_span(path: Path, reached: Callable[[int, float, float], bool], timeout: float, what: str) -> tuple[int, float, float]:
    """Poll the recorder's host rows (count, oldest, newest) until ``reached`` holds; fail after ``timeout`` seconds.
    A deadline, not a sleep: a loaded host takes longer to write the same samples, never a different number."""
    deadline = time.monotonic() + timeout
    while True:
        span = _host_span(path)
        if reached(*span):
            return span
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s (host rows, oldest, newest: {span})"
        time.sleep(0.2)


FULL = "llmdiag_recorder_disk_full_total"
ERRORS = "llmdiag_recorder_write_errors_total"


@pytest.mark.slow
@pytest.mark.live
@pytest.mark.host_quiet(
    reason="a 3-64 MiB tmpfs filled by the agent's own recorder: its rows and /metrics are checked, the analysis only for running"
)
def test_a_full_disk_costs_the_oldest_rows_never_the_agent(tmp_path: Path) -> None:
    _require_mount()
    with _tmpfs(tmp_path / "small", "3m") as disk:
        recorder = disk / "recorder.db"
        agent = _Agent(recorder, "--max-size", "64MiB", "--top", "200")  # the size cap is far above the disk
        try:
            metrics = agent.wait_for(lambda m: m.get(FULL, 0) >= 1, 90)
            assert metrics["llmdiag_host_memory_total_bytes"] > 0  # /metrics still served, with samples
            _, first1, last1 = _host_span(recorder)
            # new samples are still written on the full disk, and the oldest rows went to make room
            n2, _first2, last2 = _wait_span(recorder, lambda n, first, last: last > last1 + 1 and first > first1, 60,
                                           "samples written on the full disk in place of the oldest")  # fmt: skip
            full_before = agent.metrics()[FULL]
            assert full_before > metrics[FULL] or last2 > last1  # still meeting the full disk, still writing
            # space comes back: once a sample taken after the remount is written, writing goes on without meeting
            # the full disk again over the next seconds of samples
            _remount(disk, "size=64m")
            remounted = time.time()
            _wait_span(recorder, lambda n, first, last: last > remounted, 60, "a sample taken after the remount")
            settled = agent.metrics()
            n_settled, _, last_settled = _host_span(recorder)
            n3, _first3, last3 = _wait_span(recorder, lambda n, first, last: last > last_settled + 3 and n > n_settled, 60,
                                            "three seconds more of samples")  # fmt: skip
            after = agent.metrics()
            assert after[FULL] == settled[FULL] and after[ERRORS] == settled[ERRORS]
            assert last3 > last2 + 2 and n3 > n2
        finally:
            agent.stop()
        analyzed = subprocess.run([*DIAG, "analyze", "--recorder", str(recorder), "--json"], capture_output=True,
                                  text=True, timeout=120)  # fmt: skip
        assert analyzed.returncode == 0, analyzed.stderr
        assert '"verdict"' in analyzed.stdout


# Root ignores permission bits; without these capabilities the agent's root is held to them like anyone.
NO_DAC = ("setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner")


@pytest.mark.live
@pytest.mark.host_quiet(
    reason="a small tmpfs remounted read-only under the agent: its recorder's errors are checked, nothing host-wide"
)
def test_read_only_folder_then_deleted_then_replaced_recorder(tmp_path: Path) -> None:
    _require_mount()
    folder = tmp_path / "state"
    folder.mkdir()
    recorder = folder / "recorder.db"
    agent = _Agent(recorder, prefix=NO_DAC)
    try:
        agent.wait_for(lambda m: "llmdiag_host_memory_total_bytes" in m, 30)
        _wait_span(recorder, lambda n, first, last: n >= 1, 30, "the first sample written")
        # the folder turns read-only: the open file keeps taking samples (nothing lost, no error)
        folder.chmod(0o555)
        try:
            n0, _, _ = _host_span(recorder)
            errors0 = agent.metrics()[ERRORS]
            _wait_span(recorder, lambda n, first, last: n >= n0 + 5, 30, "five more samples in the read-only folder")
            assert agent.metrics()[ERRORS] == errors0
            # ... and then its file is deleted: no fresh file can be made there; every sample's write fails and
            # is counted, sampling and /metrics go on, and the agent tries again every sample
            recorder.unlink()
            errors = agent.wait_for(lambda m: m.get(ERRORS, 0) >= errors0 + 5, 30)[ERRORS]
            later = agent.wait_for(lambda m: m.get(ERRORS, 0) >= errors + 5, 30)
            assert later["llmdiag_host_memory_total_bytes"] > 0 and not recorder.exists()
        finally:
            folder.chmod(0o755)
        # writable again: a fresh recorder at the same path, counted once, taking samples
        agent.wait_for(lambda m: m.get('llmdiag_recorder_resets_total{reason="deleted"}', 0) == 1, 30)
        _wait_span(recorder, lambda n, first, last: n >= 3, 30, "three samples in the fresh recorder")
        # the file is replaced by something that is not a database: moved aside (kept), a fresh one started
        junk = folder / "junk"
        junk.write_bytes(b"not a database" * 100)
        os.replace(junk, recorder)
        agent.wait_for(lambda m: m.get('llmdiag_recorder_resets_total{reason="corrupt"}', 0) == 1, 30)
        (aside,) = [p for p in folder.iterdir() if re.fullmatch(r"recorder\.db\.corrupt-\d{8}T\d{4}Z", p.name)]
        assert aside.read_bytes() == b"not a database" * 100
        _wait_span(recorder, lambda n, first, last: n >= 3, 30, "three samples in the recorder started after the junk")
        # a valid recorder put in its place (a restored copy) is taken over as it is, and counted as replaced
        copy = folder / "copy.db"
        with FlightRecorder(copy) as rec:
            rec.write_rows([(time.time() - 60, "host", 1, '{"kind":"host","schema":1,"ts":0}')])
        os.replace(copy, recorder)
        agent.wait_for(lambda m: m.get('llmdiag_recorder_resets_total{reason="replaced"}', 0) == 1, 30)
        # the copy's row kept, and the agent's new samples added to it
        _wait_span(recorder, lambda n, first, last: n >= 3 and first < time.time() - 30, 30, "samples added to the copy")
    finally:
        log = agent.stop()
    assert "was deleted" in log and "was replaced" in log


# Thousands of short-lived processes a second: a Python fork loop manages ~150/s on a loaded 2-core host,
# so the churner is a few lines of C (fork, a 200 us life, reaped in batches), built by the test.
CHURN_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    double secs = atof(argv[1]);
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long n = 0;
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 > secs) break;
        for (int i = 0; i < 32; i++) {
            pid_t p = fork();
            if (p == 0) { usleep(200); _exit(0); }
            if (p > 0) n++;
        }
        while (waitpid(-1, 0, WNOHANG) > 0) {}
    }
    while (wait(0) > 0) {}
    printf("%ld\n", n);
    return 0;
}
"""


def _churner(tmp_path: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the process churner (apt-get install gcc)")
    src = tmp_path / "churn.c"
    src.write_text(CHURN_C)
    exe = tmp_path / "churn"
    subprocess.run([cc, "-O2", "-o", str(exe), str(src)], check=True, capture_output=True)
    return exe


@pytest.mark.process
def test_processes_appearing_and_vanishing_by_the_thousand_cost_no_sample(tmp_path: Path) -> None:
    """Every process read in full (top = all), while thousands start and exit per second, for a bounded time."""
    churn_s = 6.0
    churner = subprocess.Popen([str(_churner(tmp_path)), str(churn_s), "llmdiag-churn-marker"], stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    snaps: list[Snapshot] = []
    config = SamplerConfig(top_n=100_000, kmsg_path=None, gpu=False, pids=(churner.pid, os.getpid()))
    agent = Agent(SnapshotTaker(config), interval_s=0.1, on_sample=snaps.append)
    try:
        time.sleep(0.3)
        started = time.monotonic()
        agent.run(max_samples=30)
        took = time.monotonic() - started
    finally:
        agent.close()
        out, _ = churner.communicate(timeout=60)
    forks = int(out)
    assert forks / churn_s >= 1000, f"the churner made only {forks / churn_s:.0f} processes/s; the test would prove little"
    assert len(snaps) == 30 and took < 30 * 0.1 + 10  # none skipped, none stuck
    for snap in snaps:
        assert snap.errors == {}, snap.errors
        assert snap.host.memory.get("total", 0) > 0 and len(snap.processes) > 5
        for p in snap.processes:
            # a process that vanished mid-read is dropped, never reported half-read
            assert not any("No such" in reason for reason in p.missing.values()), (p.pid, p.missing)
    # the churner's children are gone: once it is reaped, none of them is reported
    final = SnapshotTaker(SamplerConfig(top_n=100_000, kmsg_path=None, gpu=False))
    try:
        last = final.take()
    finally:
        final.close()
    assert not [p for p in last.processes if "llmdiag-churn-marker" in p.cmdline]
    # the churn was seen while it ran: some sample held the churner (a watched pid) with its marker
    assert any(p.pid == churner.pid and "llmdiag-churn-marker" in p.cmdline for s in snaps for p in s.processes)


@pytest.mark.live
@pytest.mark.host_quiet(
    reason="empty 32-64 MiB groups created and removed under our own: the agent's sampling is checked, no memory is used"
)
def test_the_agent_keeps_resolving_a_group_that_comes_and_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--cgroup for a group that does not exist yet: warned about, looked for every sample, found when it appears,
    lost again when it goes -- each change a WatchScope record and the state on /metrics. Then groups are created
    and removed as fast as the kernel allows while the agent samples: no sampler error, no exception."""
    import threading
    import uuid

    from prometheus_client import generate_latest

    from diag.demo.scenarios.cgroups import ScenarioCgroups
    from tests.livecg import memory_cgroup, own_v1_memory_cgroup, require_live

    require_live()
    own = own_v1_memory_cgroup()
    assert own is not None
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=0xABCDEF12 << 96))  # the group's name, known in advance
    path = f"{own.rstrip('/')}/llmdiag-later-live-abcdef12"
    recorder = FlightRecorder(tmp_path / "r.db")
    agent = Agent(SnapshotTaker(SamplerConfig(cgroups=(path,), kmsg_path=None, gpu=False)), interval_s=0.05, recorder=recorder)

    def found() -> float:
        text = generate_latest(agent.registry).decode()
        return float(re.search(r'llmdiag_watch_targets_found\{kind="cgroup"\} (\S+)', text).group(1))

    try:
        agent.step()
        agent.step()
        assert found() == 0
        with memory_cgroup(64 << 20, name="llmdiag-later") as group:
            assert group.path == path
            snap = agent.step()
            agent.step()
            assert found() == 1 and [c.version for c in snap.cgroups] != ["none"]
        agent.step()
        assert found() == 0
        monkeypatch.undo()
        # churn: groups appear and vanish while the agent samples them (a watched pid inside each, when it can)
        stop = threading.Event()
        made = [0]

        def churn() -> None:
            while not stop.is_set():
                with ScenarioCgroups(prefix="llmdiag-churn") as groups:
                    groups.create("g", 32 << 20)
                    made[0] += 1

        worker = threading.Thread(target=churn)
        worker.start()
        try:
            deadline = time.monotonic() + 3
            steps = 0
            churn_agent = Agent(SnapshotTaker(SamplerConfig(cgroups=(own,), kmsg_path=None, gpu=False, top_n=5)),
                                interval_s=0.01)  # fmt: skip
            while time.monotonic() < deadline:
                snap = churn_agent.step()
                assert snap.errors == {}, snap.errors
                steps += 1
        finally:
            stop.set()
            worker.join(30)
        assert made[0] >= 10 and steps >= 10
    finally:
        agent.close()
    with FlightRecorder(tmp_path / "r.db", readonly=True) as rec:
        scopes = list(rec.read(kinds=["watch_scope"]))
    assert [s.resolved_cgroups for s in scopes] == [[], [path], []]  # written at start and on each change only
    assert scopes[0].missing and scopes[0].missing[0].startswith(f"cgroup {path}: not found under")
