"""Live: a real OOM kill inside a real memory cgroup seen through /dev/kmsg, and real processes that
map or hold open a model file seen by ProcessSampler.

The OOM test needs root and cgroup v1 memory (``require_live`` skips with the reason otherwise); the
allocation happens only inside a 150 MiB limited group. The model-file test needs neither: it reads
our own children's /proc entries. Every process started here is killed by PID in ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors.kmsg import KmsgOomWatcher
from collectors.processes import ProcessSampler, model_process_counts
from collectors.records import OomEvent
from tests.livecg import memory_cgroup, require_live

MIB = 1 << 20

ALLOCATE_FOREVER = """
chunks = []
while True:
    chunks.append(bytearray(b"\\x01") * (10 << 20))  # written, so every page is charged
"""


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@pytest.mark.live
def test_memcg_oom_kill_is_seen_in_kmsg() -> None:
    require_live()
    watcher = KmsgOomWatcher()
    try:
        assert watcher.error is None, watcher.error
        with memory_cgroup(150 * MIB) as group:
            started = time.time()
            victim = group.spawn([sys.executable, "-c", ALLOCATE_FOREVER])
            try:
                victim.wait(timeout=60)
            finally:
                _kill(victim)
            assert victim.returncode == -signal.SIGKILL
            leaf = group.path.rsplit("/", 1)[-1]

            found: list[OomEvent] = []
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                found += [e for e in watcher.poll() if e.pid == victim.pid]
                if found and found[-1].anon_rss_bytes is not None:
                    break
                time.sleep(0.1)
        assert found, f"no OOM event for pid {victim.pid} in /dev/kmsg"
        event = found[0]
        assert event.constraint == "CONSTRAINT_MEMCG"
        assert event.task_memcg is not None and event.task_memcg.endswith("/" + leaf)
        assert event.oom_memcg is not None and event.oom_memcg.endswith("/" + leaf)
        assert event.task == "python3" or (event.task or "").startswith("python")
        # The victim held most of the limit in anonymous memory when it died (RSS counters are approximate).
        assert event.anon_rss_bytes is not None and 100 * MIB < event.anon_rss_bytes <= 160 * MIB
        # Wall time of the kill (printk stamp + boot time), within the window the victim lived in.
        assert started - 1.0 <= event.ts <= time.time() + 1.0
        assert len(found) == 1  # one kill, one event
    finally:
        watcher.close()


def _write_safetensors(path: Path, floats: int) -> None:
    """A small but valid safetensors file: u64 header length, JSON header, raw little-endian F32 data."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [floats], "data_offsets": [0, 4 * floats]}}).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.write(struct.pack("<f", 1.5) * floats)


MAP_IT = """
import mmap, sys, time
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the fd is closed; only the mapping holds it
total = sum(m[i] for i in range(0, len(m), 4096))  # fault the pages in, as a loader would
print("ready", flush=True)
time.sleep(120)
"""

HOLD_IT = """
import sys, time
f = open(sys.argv[1], "rb")  # open, never mapped
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture
def model_file(tmp_path: Path) -> Iterator[str]:
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, (4 * MIB) // 4)
    yield os.path.realpath(path)


@pytest.mark.process
def test_processes_mapping_or_holding_a_model_are_counted(model_file: str) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for script in (MAP_IT, HOLD_IT):
            proc = subprocess.Popen([sys.executable, "-c", script, model_file], stdout=subprocess.PIPE)
            procs.append(proc)
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        mapper, holder = procs

        sampler = ProcessSampler(top_n=0)  # only model holders (and watched PIDs) are reported
        samples = {s.pid: s for s in sampler.sample()}
        assert model_file in samples[mapper.pid].model_files
        assert model_file in samples[holder.pid].model_files
        assert model_process_counts(samples.values())[model_file] == 2
        # The mapper faulted the whole file in: its RSS covers it.
        assert (samples[mapper.pid].rss_bytes or 0) >= 4 * MIB

        for proc in procs:
            _kill(proc)
        after = sampler.sample()
        assert model_process_counts(after).get(model_file, 0) == 0
        assert not {mapper.pid, holder.pid} & {s.pid for s in after}
    finally:
        for proc in procs:
            _kill(proc)
