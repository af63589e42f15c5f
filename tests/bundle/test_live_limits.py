"""Hard limits on the sick machine: hung collectors are abandoned, thrashing does not stop the bundle,
and the bundle never stays inside the cgroup it diagnoses.

Everything here is real: a FIFO stands in for a file on a hung mount (``open`` blocks, as a read on a
dead NFS server does), a stand-in ``nvidia-smi`` on PATH sleeps like one stuck on a wedged driver (the
only fake: there is no NVIDIA driver here to wedge), a process thrashes inside a real memory cgroup,
and ``diag bundle`` runs as its own process each time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bundle.helpers import ROOT, bundle_argv, parse_run, run_bundle, verify_sums
from tests.livecg import memory_cgroup, own_v1_memory_cgroup, require_live

MiB = 1 << 20


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(") ", 1)[1][0] != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.slow
@pytest.mark.process
def test_hung_collectors_are_recorded_and_the_bundle_keeps_its_deadline(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pidfile = tmp_path / "nvidia-smi.pid"
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\necho '==== NVSMI LOG ===='\nexec sleep 300\n")
    fake.chmod(0o755)
    fifo = tmp_path / "hung-mount-file"
    os.mkfifo(fifo)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    deadline = 15.0
    run = run_bundle("--deadline", f"{deadline:g}s", "--recorder", str(tmp_path / "none.db"), "--include", str(fifo),
                     "--since", "5m", out=tmp_path, env=env, timeout=deadline + 60)  # fmt: skip
    manifest = run.manifest
    smi = run.collector("nvidia-smi")
    assert smi["timeout_hit"] and smi["status"] == "timeout"
    assert smi["exec"].endswith("nvidia-smi -q") and smi["return_code"] != 0  # killed, not finished
    assert "==== NVSMI LOG ====" in (run.root / "raw" / "nvidia-smi-q.txt").read_text()  # what it printed is kept
    assert _gone_within(int(pidfile.read_text()), 5.0)  # killed with its process group, not left behind
    hung = run.collector("include.1")
    assert hung["timeout_hit"] and hung["abandoned"] and hung["files"] == []
    # the bundle still completed, inside its deadline, with everything else and its checksums
    assert manifest["deadline_s"] == deadline and not manifest["deadline_exceeded"] and manifest["duration_s"] <= deadline
    assert run.collector("snapshot")["status"] == "ok" and run.collector("analysis")["status"] == "ok"
    assert "Timed out (data missing or partial): " in run.proc.stdout and "nvidia-smi" in run.proc.stdout
    assert "timed out" in (run.root / "report.md").read_text()
    verify_sums(run.root)


THRASHER = """
import mmap, random, sys
anon = bytearray(b"\\xa5") * (int(sys.argv[2]) << 20)  # written: resident, and unreclaimable without swap
with open(sys.argv[1], "rb") as fh:
    m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
m.madvise(mmap.MADV_RANDOM)  # no readahead: one small read per fault, many more faults per second
pages = len(m) // 4096
print("ready", flush=True)
rng = random.Random(1)
total = 0
while True:  # random 4 KiB reads over a file larger than what the limit leaves: every read a major fault
    for _ in range(512):
        total += m[rng.randrange(pages) * 4096]
    anon[rng.randrange(len(anon))] = total & 0xFF
"""


def _majfaults(group_dir: Path) -> int:
    for line in (group_dir / "memory.stat").read_text().splitlines():
        if line.startswith("total_pgmajfault "):
            return int(line.split()[1])
    return 0


@pytest.mark.live
def test_the_bundle_completes_while_the_service_group_thrashes(tmp_path: Path) -> None:
    require_live()
    data = tmp_path / "mapped.bin"
    with open(data, "wb") as fh:
        for _ in range(256):
            fh.write(os.urandom(MiB))
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(data, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: the group reads (and is charged) it
    os.close(fd)
    with memory_cgroup(192 * MiB, name="llmdiag-bundle-thrash") as group:
        hog = group.spawn([sys.executable, "-c", THRASHER, str(data), "128"], stdout=subprocess.PIPE)
        assert hog.stdout is not None and hog.stdout.readline().strip() == b"ready"
        before = _majfaults(group.v1_dir)
        end = time.monotonic() + 30
        while _majfaults(group.v1_dir) - before < 500 and time.monotonic() < end:
            time.sleep(0.1)
        start_faults = _majfaults(group.v1_dir)
        assert start_faults - before >= 500, "the thrasher does not thrash; the test would prove nothing"
        deadline = 20.0
        run = run_bundle("--cgroup", group.path, "--deadline", f"{deadline:g}s", "--recorder", str(tmp_path / "none.db"),
                         "--since", "5m", "--no-gpu", out=tmp_path, timeout=deadline + 60)  # fmt: skip
        faults_during = _majfaults(group.v1_dir) - start_faults
        still_thrashing = hog.poll() is None
    manifest = run.manifest
    assert still_thrashing and faults_during > 0  # the bundle ran the whole time under the thrash
    assert not manifest["deadline_exceeded"] and manifest["duration_s"] <= deadline
    assert not any(c["timeout_hit"] for c in manifest["collectors"]), [
        c["name"] for c in manifest["collectors"] if c["timeout_hit"]
    ]
    assert not manifest["self_cgroup"]["inside"]  # taken from outside the thrashing group
    cg = [json.loads(line) for line in (run.root / "timeline" / "cgroup.jsonl").read_text().splitlines()]
    (snap,) = [c for c in cg if c["path"] == group.path]
    assert snap["limit_bytes"] == 192 * MiB and snap["usage_bytes"] > 150 * MiB  # it saw the group at its limit
    raw = run.root / "raw" / "cgroup" / "memory" / group.path.lstrip("/")
    assert int((raw / "memory.limit_in_bytes").read_text()) == 192 * MiB
    assert "total_pgmajfault" in (raw / "memory.stat").read_text()
    verify_sums(run.root)


@pytest.mark.live
@pytest.mark.host_quiet(
    reason="a 1 GiB group holding only the bundle process (far below its limit): checks where the bundle moved itself, no verdict"
)
def test_the_bundle_moves_itself_out_of_the_cgroup_it_diagnoses(tmp_path: Path) -> None:
    require_live()
    parent = own_v1_memory_cgroup()
    with memory_cgroup(1024 * MiB, name="llmdiag-bundle-self") as group:
        argv = bundle_argv("--out", str(tmp_path), "--cgroup", group.path, "--recorder", str(tmp_path / "none.db"),
                           "--since", "1m", "--no-tar", "--no-gpu", "--deadline", "60s")  # fmt: skip
        proc = group.spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(ROOT))
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err.decode()[-4000:]
        run = parse_run(subprocess.CompletedProcess(proc.args, 0, out.decode(), err.decode()))
    self_cg = run.manifest["self_cgroup"]
    assert self_cg["before"] == group.path and self_cg["inside"] == group.path
    assert self_cg["moved_to"] == parent and self_cg["after"] == parent and self_cg["warning"] is None
    assert "moved this process to" in (run.root / "log.txt").read_text()


DROP_AND_TRY = """
import json, os, sys
from diag.bundle.selfcg import leave_watched  # imported as root: the interpreter lives under /root
os.setgid(65534); os.setuid(65534)  # no longer root: may not move between groups
print(json.dumps(leave_watched([sys.argv[1]]).to_dict()))
"""


@pytest.mark.live
@pytest.mark.host_quiet(
    reason="an idle process in a 256 MiB group trying to leave it: a cgroup move refused, nothing the host shows"
)
def test_without_root_it_warns_that_it_runs_inside_the_diagnosed_group(tmp_path: Path) -> None:
    require_live()
    with memory_cgroup(256 * MiB, name="llmdiag-bundle-noroot") as group:
        proc = group.spawn([sys.executable, "-c", DROP_AND_TRY, group.path], stdout=subprocess.PIPE, cwd=str(ROOT))
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
    state = json.loads(out)
    assert state["inside"] == group.path and state["moved_to"] is None and state["after"] == group.path
    assert "cannot leave it (not root)" in state["warning"]
