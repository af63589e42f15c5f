"""The failures of diagnosing services we did not instrument, reproduced for real and checked end to end.

Each test runs plain processes (no request tracker, no reference backend) inside limited memory
cgroups, samples them with the real agent into a flight recorder, writes the ``watch_scope`` record
the operator's ``--pid``/``--cgroup`` produce, and runs the rules on what was recorded:

1. thrashing with no request rows (a process re-reading an mmapped file larger than what its limit leaves);
2. the operator's scope wins over a neighbour that maps a ``.bin`` file (and stalls the host);
3. duplicate model copies that hold no file (workers read a checkpoint into private memory and close it);
4. a short overload of a plain single-slot server (seconds of data, every request queued).

(The fifth, the fleet path losing the OOM kill's owner, is checked in ``test_prometheus_loader.py`` against a real
Prometheus scraping the agent.) Set ``LLMDIAG_RECORD_FIXTURES=<dir>`` to save each run's records as a replay fixture.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import random
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest

from collectors.records import RequestTiming, WatchScope
from diag.demo.scenarios.cgroups import ScenarioCgroups
from diag.demo.scenarios.recording import AgentThread, scenario_records, write_jsonl_gz
from diag.rules.engine import analyze
from diag.timeline import timeline_from_records
from tests.livecg import require_live

pytestmark = pytest.mark.live
MIB = 1 << 20

THRASH = """
import mmap, os, random, sys, time
path, secs = sys.argv[1], float(sys.argv[2])
anon = bytearray(100 << 20)
for i in range(0, len(anon), 4096):
    anon[i] = 1
fd = os.open(path, os.O_RDONLY)
m = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
pages, end, x = os.fstat(fd).st_size // 4096, time.time() + secs, 0
while time.time() < end:
    for _ in range(2000):
        x ^= m[random.randrange(pages) * 4096]
time.sleep(600)
"""

# Each worker reads the checkpoint whole into private memory and closes it (what torch.load does), then says so by
# creating <ready-dir>/<pid>: the test waits for those, not for a fixed time -- three cold 80 MiB reads in one group
# on a busy host can take longer than any sleep chosen on a quiet one (a worker sampled mid-read is not a copy yet).
COPIES = """
import os, sys, time
path, n, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for _ in range(n):
    if os.fork() == 0:
        weights = bytearray(os.path.getsize(path))
        with open(path, "rb") as fh:
            fh.readinto(weights)
        open(os.path.join(ready, str(os.getpid())), "w").close()
        time.sleep(600)
        os._exit(0)
time.sleep(600)
"""

SLEEPER = "import time; time.sleep(600)"


@contextlib.contextmanager
def groups() -> Iterator[ScenarioCgroups]:
    require_live()
    made = ScenarioCgroups(prefix="llmdiag-uninst")
    try:
        yield made
    finally:
        made.close()
    assert not made.leftovers, f"live test cgroups left behind: {made.leftovers}"


def _cold_file(path: Path, size: int) -> Path:
    """A file written from outside every test group, then dropped from the page cache (reads get charged to the reader)."""
    with path.open("wb") as fh:
        chunk = os.urandom(MIB)
        for _ in range(size // MIB):
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


def _record(recorder: Path, seconds: float, *, cgroups: list[str], pids: list[int], top_n: int = 10) -> None:
    agent = AgentThread(recorder, cgroups=cgroups, pids=pids, interval_s=1.0, kmsg=False, top_n=top_n).start()
    try:
        time.sleep(seconds)
    finally:
        agent.stop()


def _scope(*, cgroups: list[str], pids: list[int], ts: float) -> WatchScope:
    """What the operator's --pid/--cgroup resolve to (the agent writes this record; here the test does)."""
    return WatchScope(ts=ts, pids=pids, cgroups=cgroups, resolved_pids=pids, resolved_cgroups=cgroups)


def _analyze(recorder: Path, scope: WatchScope, keep: list[str], name: str, extra: Sequence[dict[str, Any]] = ()) -> Any:
    records = [*scenario_records(recorder, keep, scope.resolved_pids), scope.to_dict(), *extra]
    out = os.environ.get("LLMDIAG_RECORD_FIXTURES")
    if out:
        write_jsonl_gz(sorted(records, key=lambda r: float(r["ts"])), Path(out) / f"{name}.jsonl.gz")
    analysis = analyze(timeline_from_records(records, source=name))
    print(name, analysis.primary, [(f.rule, round(f.confidence, 2), f.summary) for f in analysis.findings])
    return analysis


@pytest.mark.slow
def test_thrashing_and_explicit_scope_without_request_rows(tmp_path: Path) -> None:
    """One run, two operators: the thrashing group named as the service is thrashing; the calm group named as
    the service, next to that thrashing neighbour which maps a ``.bin`` file, is a noisy-neighbour victim."""
    weights = _cold_file(tmp_path / "weights.bin", 100 * MIB)
    recorder = tmp_path / "agent.db"
    with groups() as made:
        hog = made.create("hog", 150 * MIB)
        svc = made.create("svc", 256 * MIB)
        calm = svc.spawn([sys.executable, "-c", SLEEPER])
        thrasher = hog.spawn([sys.executable, "-c", THRASH, str(weights), "22"])
        t0 = time.time()
        _record(recorder, 24, cgroups=[hog.path, svc.path], pids=[calm.pid, thrasher.pid])
        assert thrasher.poll() is None and calm.poll() is None  # thrashing, not OOM-killed
        keep = [hog.path, svc.path]
        as_hog = _analyze(recorder, _scope(cgroups=[hog.path], pids=[thrasher.pid], ts=t0), keep, "thrash-no-rows")
        as_svc = _analyze(recorder, _scope(cgroups=[svc.path], pids=[calm.pid], ts=t0), keep, "neighbour-holds-bin")
    assert as_hog.primary == "thrashing", as_hog.to_dict()["findings"]
    stall = next(f for f in as_hog.findings if f.rule == "stalls.thrashing")
    assert stall.confidence >= 0.5 and stall.start is not None and stall.end is not None
    assert as_svc.primary == "noisy_neighbour", as_svc.to_dict()["findings"]
    assert not any(f.cls == "thrashing" and f.confidence >= 0.3 for f in as_svc.findings)


@pytest.mark.slow
def test_duplicate_copies_that_hold_no_file(tmp_path: Path) -> None:
    ckpt = _cold_file(tmp_path / "checkpoint.pt", 80 * MIB)
    recorder = tmp_path / "agent.db"
    with groups() as made:
        group = made.create("workers", 512 * MIB)
        ready = tmp_path / "ready"
        ready.mkdir()
        parent = group.spawn([sys.executable, "-c", COPIES, str(ckpt), "3", str(ready)])
        deadline = time.time() + 60
        while len(list(ready.iterdir())) < 3 and parent.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert len(list(ready.iterdir())) == 3, f"workers that read the checkpoint in 60 s: {sorted(ready.iterdir())}"
        pids = sorted(group.pids())
        assert len(pids) == 4, pids
        t0 = time.time()
        _record(recorder, 14, cgroups=[group.path], pids=pids)
        analysis = _analyze(recorder, _scope(cgroups=[group.path], pids=[parent.pid], ts=t0), [group.path],
                            "duplicates-no-files")  # fmt: skip
    assert analysis.primary == "duplicate_model_processes", analysis.to_dict()["findings"]
    f = next(f for f in analysis.findings if f.rule == "private_copies.duplicate_models")
    named = " ".join(f"{e.what} {e.value}" for e in f.evidence)
    workers = [p for p in pids if p != parent.pid]
    assert all(str(p) in named for p in workers) and f.confidence >= 0.6


class _FifoSlot:
    """One inference slot served first come, first served, as an engine's scheduler queue serves.

    A bare ``threading.Lock`` is not fair: a thread arriving just as the slot frees takes it ahead of those
    already waiting, so on a busy host a sixth of the requests "waited" nothing while the rest waited 15x
    their inference -- a queue no real server has, and one the backlog rule rightly reads as mixed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._cond.wait_for(lambda: self._serving == ticket)
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()


class _SingleSlot(http.server.BaseHTTPRequestHandler):
    """A plain server with one inference slot; it records each request's timing as any exporter could."""

    slot = _FifoSlot()
    rows: ClassVar[list[RequestTiming]] = []

    def do_GET(self) -> None:
        arrival = time.time()
        with self.slot.held():
            start = time.time()
            time.sleep(0.1 + random.random() * 0.01)  # the "inference"
            finish = time.time()
        self.rows.append(RequestTiming(ts=finish, arrival=arrival, start=start, finish=finish, pid=os.getpid()))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def test_short_overload_of_a_plain_single_slot_server(tmp_path: Path) -> None:
    """64 requests at concurrency 8 on one slot: ~7 s of data, every request queued; the whole window is the overload."""
    require_live()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SingleSlot)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    recorder = tmp_path / "agent.db"
    agent = AgentThread(recorder, pids=[os.getpid()], interval_s=1.0, kmsg=False).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        with ThreadPoolExecutor(8) as pool:
            assert all(r == 200 for r in pool.map(lambda _: urllib.request.urlopen(url, timeout=30).status, range(64)))
    finally:
        agent.stop()
        server.shutdown()
        server.server_close()
    rows = [r.to_dict() for r in _SingleSlot.rows]
    assert len(rows) == 64
    t0 = min(r["arrival"] for r in rows)
    scope = WatchScope(ts=t0, pids=[os.getpid()], resolved_pids=[os.getpid()])
    analysis = _analyze(recorder, scope, [], "short-overload", rows)
    waits = sorted((r["start"] - r["arrival"]) / (r["finish"] - r["start"]) for r in rows)
    assert analysis.primary == "queue_backlog", (analysis.to_dict()["findings"], "wait/inference ratios", waits[:8])
    assert max(r["finish"] for r in rows) - t0 < 12
