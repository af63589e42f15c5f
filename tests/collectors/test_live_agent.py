"""Live, as root: the agent watching a real memory cgroup whose process is OOM-killed by the kernel.

The snapshot must show failcnt (events["max"]) and oom_kill rise, and the agent must record an
OomEvent with CONSTRAINT_MEMCG and the victim's pid.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectors.recorder import FlightRecorder
from collectors.records import CgroupSnapshot, OomEvent
from tests.livecg import memory_cgroup, require_live

DIAG = [sys.executable, "-m", "diag.cli"]
HOG = "b=[]\nwhile True: b.append(bytearray(8 << 20))"


def _wait_for(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _count(path: Path, kind: str) -> int:
    if not path.exists():
        return 0
    with FlightRecorder(path, readonly=True) as rec:
        return rec.count(kind)


@pytest.mark.live
def test_agent_records_memcg_oom_kill(tmp_path: Path) -> None:
    require_live()
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg is not readable (needs root and kernel.dmesg_restrict permitting it)")
    recorder = tmp_path / "r.db"
    with memory_cgroup(120 << 20) as group:
        agent = subprocess.Popen(
            [*DIAG, "collect", "--interval", "250ms", "--listen", "off", "--recorder", str(recorder),
             "--cgroup", group.path, "--no-gpu"],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert agent.stderr is not None
            assert "sampling every" in agent.stderr.readline()
            assert _wait_for(lambda: _count(recorder, "cgroup") >= 2, 20)
            victim = group.spawn([sys.executable, "-c", HOG])
            assert victim.wait(timeout=60) == -signal.SIGKILL
            time.sleep(1.5)  # a few more samples after the kill
        finally:
            os.kill(agent.pid, signal.SIGTERM)
            assert agent.wait(timeout=15) == 0
        leaf = group.path.rsplit("/", 1)[1]
    with FlightRecorder(recorder, readonly=True) as rec:
        ooms = [r for r in rec.read(kinds=["oom"]) if isinstance(r, OomEvent)]
        mine = [o for o in ooms if o.pid == victim.pid]
        assert mine, f"no OomEvent for pid {victim.pid}; saw {[(o.pid, o.task_memcg) for o in ooms]}"
        assert mine[0].constraint == "CONSTRAINT_MEMCG"
        assert mine[0].task_memcg is not None and re.search(re.escape(leaf) + "$", mine[0].task_memcg)
        groups = [r for r in rec.read(kinds=["cgroup"]) if isinstance(r, CgroupSnapshot) and r.path == group.path]
        assert len(groups) >= 3
        first, last = groups[0], groups[-1]
        assert first.limit_bytes == 120 << 20
        assert last.events["max"] > first.events.get("max", 0), "failcnt did not rise"
        assert last.events["oom_kill"] >= first.events.get("oom_kill", 0) + 1, "oom_kill did not rise"
