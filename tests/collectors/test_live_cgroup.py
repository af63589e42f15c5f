"""CgroupSampler on a real, limited memory cgroup: the limit, then a real OOM kill inside it.

Needs root and a cgroup v1 memory hierarchy (``tests/livecg.py``); skips with the reason elsewhere.
Every allocation happens inside a 150 MiB group, so the host itself never runs short.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from collectors.cgroup import CgroupSampler
from collectors.records import CgroupSnapshot
from tests.livecg import LiveGroup, memory_cgroup, require_live

pytestmark = pytest.mark.live

LIMIT = 150 << 20
# Says "ready" once the interpreter is up, so its memory is charged before the first sample.
SLEEPER = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"]
# Touches 8 MiB at a time until the group's limit makes the kernel OOM-kill it.
HOG = [sys.executable, "-c", "chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))"]


def sample_both(group: LiveGroup, pid: int) -> tuple[CgroupSnapshot, CgroupSnapshot]:
    by_path = CgroupSampler(cgroups=[group.path]).sample()
    by_pid = CgroupSampler(pids=[pid]).sample()
    assert len(by_path) == 1 and len(by_pid) == 1
    return by_path[0], by_pid[0]


def start_sleeper(group: LiveGroup) -> subprocess.Popen[bytes]:
    sleeper = group.spawn(SLEEPER, stdout=subprocess.PIPE)
    assert sleeper.stdout is not None and sleeper.stdout.readline() == b"ready\n"
    sleeper.stdout.close()  # it prints nothing more
    assert str(sleeper.pid) in group.read_v1("cgroup.procs").split()
    return sleeper


def test_live_limit_and_oom_kill_are_seen() -> None:
    require_live()
    with memory_cgroup(LIMIT) as group:
        expected_version = "hybrid" if group.v2_dir is not None else "v1"
        # No swap escape hatch for the hog, so the limit ends in an OOM kill rather than swapping.
        (group.v1_dir / "memory.swappiness").write_text("0")
        sleeper = start_sleeper(group)

        before_path, before_pid = sample_both(group, sleeper.pid)
        for snap in (before_path, before_pid):
            assert snap.path == group.path
            assert snap.version == expected_version
            assert snap.limit_bytes == LIMIT
            assert snap.usage_bytes is not None and 0 < snap.usage_bytes < LIMIT
            assert snap.working_set_bytes is not None and snap.working_set_bytes <= snap.usage_bytes
            assert "max" in snap.events and "oom_kill" in snap.events
            assert snap.under_oom is False
            assert snap.stat["anon"] > 0 and "inactive_file" in snap.stat
            if group.v2_dir is not None:
                assert snap.pressure is not None and snap.pressure.some is not None
                assert "pressure" not in snap.missing

        hog = group.spawn(HOG, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            returncode = hog.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.kill(hog.pid, signal.SIGKILL)
            hog.wait(timeout=10)
            pytest.fail("the hog was not OOM-killed inside a 150 MiB group within 120 s")
        assert returncode == -signal.SIGKILL, f"hog ended with {returncode}, expected an OOM kill"
        assert sleeper.poll() is None, "the OOM killer took the sleeper instead of the hog"

        after_path, after_pid = sample_both(group, sleeper.pid)
        for after, before in ((after_path, before_path), (after_pid, before_pid)):
            assert after.events["max"] > before.events["max"]  # failcnt: the limit was hit
            assert after.events["oom_kill"] > before.events["oom_kill"]
            assert after.peak_bytes is not None and LIMIT * 0.8 <= after.peak_bytes <= LIMIT
            assert after.usage_bytes is not None and after.usage_bytes <= LIMIT
            assert after.limit_bytes == LIMIT
            assert after.under_oom is False  # the kill resolved it
            if group.v2_dir is not None:
                assert after.pressure is not None and after.pressure.some is not None
                assert before.pressure is not None and before.pressure.some is not None
                assert after.pressure.some.total_us >= before.pressure.some.total_us
            assert after.missing == {}
        v1_dir, v2_dir = group.v1_dir, group.v2_dir

    assert not v1_dir.exists()
    assert v2_dir is None or not v2_dir.exists()
    gone = CgroupSampler(cgroups=[group.path]).sample()[0]
    assert gone.version == "none" and "group" in gone.missing
