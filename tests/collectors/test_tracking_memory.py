"""The memory guard's probe: its own cgroup (live v1 group with a limit), v2 trees, host fallback, PSI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from collectors import procfs
from collectors.tracking import AdmissionConfig, AdmissionRejected, MemoryProbe, RequestTracker
from tests.livecg import memory_cgroup

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _v2_tree(tmp_path: Path, psi_avg10: str = "42.00") -> tuple[MemoryProbe, Path]:
    """A cgroup2 tree in the kernel's formats: /a (memory.max 1 GiB) / b (max), usage in b."""
    mount = tmp_path / "cgroup2"
    a, b = mount / "a", mount / "a" / "b"
    b.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("cpu io memory pids\n")
    (a / "memory.max").write_text(f"{1024 * MiB}\n")
    (b / "memory.max").write_text("max\n")
    (b / "memory.current").write_text(f"{600 * MiB}\n")
    (b / "memory.stat").write_text(f"anon {450 * MiB}\nfile {150 * MiB}\nactive_file {50 * MiB}\ninactive_file {100 * MiB}\n")
    (b / "memory.pressure").write_text(
        f"some avg10={psi_avg10} avg60=30.00 avg300=10.00 total=123456\nfull avg10=1.00 avg60=0.50 avg300=0.10 total=999\n"
    )
    proc = tmp_path / "proc"
    (proc / "pressure").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       16384000 kB\nMemFree:         1000000 kB\nMemAvailable:    8192000 kB\n")
    (proc / "pressure" / "memory").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    mountinfo = f"30 23 0:26 / {mount} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
    probe = MemoryProbe(proc_root=proc, self_cgroup_text="0::/a/b\n", mountinfo_text=mountinfo)
    return probe, b


def test_v2_limit_is_the_smallest_on_the_way_up_and_used_is_the_working_set(tmp_path: Path) -> None:
    probe, _ = _v2_tree(tmp_path)
    reading = probe.read()
    assert reading.source == "cgroup-v2:/a/b"
    assert reading.limit_bytes == 1024 * MiB  # from the parent: the group itself says "max"
    assert reading.used_bytes == 500 * MiB  # 600 current - 100 inactive_file
    assert reading.used_ratio == pytest.approx(500 / 1024)
    assert reading.psi_some_avg10 == 42.0 and reading.psi_source == "cgroup-v2:/a/b"
    assert reading.error is None


def test_v2_without_any_limit_falls_back_to_host_memory(tmp_path: Path) -> None:
    probe, b = _v2_tree(tmp_path)
    (b.parent / "memory.max").write_text("max\n")
    reading = probe.read()
    assert reading.source == "host"
    assert reading.limit_bytes == 16384000 * 1024
    assert reading.used_bytes == (16384000 - 8192000) * 1024


def test_container_mount_of_its_own_group_is_found(tmp_path: Path) -> None:
    # no cgroup namespace: /proc/self/cgroup shows the host path, the container mounts its group at the root
    mount = tmp_path / "cg"
    mount.mkdir()
    (mount / "memory.current").write_text(f"{100 * MiB}\n")
    (mount / "memory.max").write_text(f"{400 * MiB}\n")
    (mount / "memory.stat").write_text("inactive_file 0\n")
    (tmp_path / "meminfo").write_text("MemTotal: 16384000 kB\nMemAvailable: 8192000 kB\n")
    mountinfo = f"1 0 0:26 /kubepods/pod1/ctr {mount} ro - cgroup2 cgroup2 rw\n"
    probe = MemoryProbe(proc_root=tmp_path, self_cgroup_text="0::/kubepods/pod1/ctr\n", mountinfo_text=mountinfo)
    reading = probe.read()
    assert (reading.used_bytes, reading.limit_bytes) == (100 * MiB, 400 * MiB)


def test_psi_threshold_refuses_new_work(tmp_path: Path) -> None:
    probe, b = _v2_tree(tmp_path, psi_avg10="42.00")
    tracker = RequestTracker(
        "m",
        recorder=False,
        registry=CollectorRegistry(),
        admission=AdmissionConfig(psi_memory_some_avg10=25.0, memory_cache_s=0.0),
        memory_probe=probe,
    )
    with pytest.raises(AdmissionRejected) as info, tracker.request("/x") as req:
        req.acquire_sync()
    assert info.value.status_code == 503 and info.value.reason == "memory_psi"
    assert tracker.health()["reasons"] == ["memory_psi"]
    (b / "memory.pressure").write_text("some avg10=3.00 avg60=30.00 avg300=10.00 total=123456\n")
    probe.cache_s = 0.0
    with tracker.request("/x") as req:
        req.acquire_sync()  # pressure gone: admitted again
    assert tracker.health()["status"] == "ok"


def test_reading_is_cached_not_taken_per_request(tmp_path: Path) -> None:
    probe, _ = _v2_tree(tmp_path)
    probe.cache_s = 60.0
    first = probe.read()
    assert probe.read() is first
    assert probe.read(max_age_s=0.0) is not first


def test_this_host_unlimited_group_reads_as_host() -> None:
    reading = MemoryProbe().read()
    meminfo = procfs.parse_meminfo(procfs.read_text("/proc/meminfo").text)
    assert reading.limit_bytes is not None and reading.used_bytes is not None
    if reading.source == "host":
        assert reading.limit_bytes == meminfo["MemTotal"]
    assert 0 < reading.used_bytes <= reading.limit_bytes


_CHILD = """
import json, sys, time
from prometheus_client import CollectorRegistry
from collectors.tracking import AdmissionConfig, RequestTracker
t = RequestTracker("m", recorder=False, registry=CollectorRegistry(),
                   admission=AdmissionConfig(memory_high_watermark=0.5, memory_cache_s=0.0))
out = {"before": t.health()}
ballast = bytearray(150 * 1024 * 1024)           # touched: 150 MiB of anon memory in a 256 MiB group
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
out["during"] = t.health()
del ballast
out["after"] = t.health()
print(json.dumps(out))
"""


@pytest.mark.live
@pytest.mark.host_quiet(
    reason="150 MiB touched in a 256 MiB group (no OOM, no reclaim): the guard reads that group's own limit and usage"
)
def test_live_cgroup_limit_drives_the_guard(tmp_path: Path) -> None:
    with memory_cgroup(256 * MiB) as group:
        proc = group.spawn([sys.executable, "-c", _CHILD], cwd=ROOT, stdout=subprocess.PIPE)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
    result = json.loads(out)
    before, during, after = result["before"], result["during"], result["after"]
    assert before["memory_limit_bytes"] == 256 * MiB
    assert before["memory_source"] == f"cgroup-v1:{group.path}"
    if group.v2_dir is not None:  # hybrid host: PSI from the group's v2 twin
        assert before["memory_psi_some_avg10"] is not None
    assert before["accepting_new_requests"] is True
    assert during["memory_used_percent"] > 50 and during["accepting_new_requests"] is False
    assert during["reasons"] == ["memory_watermark"]
    assert after["accepting_new_requests"] is True
