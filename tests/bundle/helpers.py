"""Shared helpers for the bundle tests: run ``diag bundle`` as a real process, read what it wrote, make history.

``diag bundle`` is run through ``diag.cli`` with the bundle command registered when ``diag/cli/main.py`` does
not register it yet, so the tests exercise the real command line either way.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from collectors.recorder import FlightRecorder
from collectors.records import CgroupSnapshot, HostSnapshot, ProcessSample, Psi, PsiLine, RequestTiming, ServiceConfig

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = (
    "import sys; from diag.cli.main import app\n"
    "names = {c.name or (c.callback.__name__ if c.callback else '') for c in app.registered_commands}\n"
    "if 'bundle' not in names:\n"
    "    from diag.cli.bundle import register; register(app)\n"
    "sys.argv[0] = 'diag'; app()\n"
)


@dataclass
class BundleRun:
    proc: subprocess.CompletedProcess[str]
    root: Path
    archive: Path | None

    @property
    def manifest(self) -> dict[str, Any]:
        return json.loads((self.root / "manifest.json").read_text())

    def collector(self, name: str) -> dict[str, Any]:
        return next(c for c in self.manifest["collectors"] if c["name"] == name)

    def findings(self) -> dict[str, Any]:
        return json.loads((self.root / "findings.json").read_text())


def bundle_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", WRAPPER, "bundle", *args]


def run_bundle(*args: str, out: Path, env: dict[str, str] | None = None, timeout: float = 180.0, **popen: Any) -> BundleRun:
    """``diag bundle --out OUT ARGS`` in a fresh process; fails the test with its output if it fails."""
    proc = subprocess.run(bundle_argv("--out", str(out), *args), capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(ROOT), **popen)  # fmt: skip
    assert proc.returncode == 0, f"diag bundle exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    return parse_run(proc)


def parse_run(proc: subprocess.CompletedProcess[str]) -> BundleRun:
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if line.startswith(("Bundle: ", "Archive: ")))
    assert "Bundle" in lines, proc.stdout
    archive = Path(lines["Archive"]) if "Archive" in lines else None
    return BundleRun(proc, Path(lines["Bundle"]), archive)


def verify_sums(root: Path) -> int:
    """Check SHA256SUMS the way ``sha256sum -c`` does; return how many files it covers."""
    lines = (root / "SHA256SUMS").read_text().splitlines()
    for line in lines:
        digest, rel = line.split("  ", 1)
        assert hashlib.sha256((root / rel).read_bytes()).hexdigest() == digest, f"{rel}: checksum mismatch"
    listed = {line.split("  ", 1)[1] for line in lines}
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != "SHA256SUMS"}
    assert listed == present, f"SHA256SUMS does not cover exactly the files: {listed ^ present}"
    return len(lines)


def extract(archive: Path, dest: Path) -> Path:
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(dest, filter="data")
    (top,) = [p for p in dest.iterdir() if p.is_dir()]
    return top


def all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def write_history(path: Path, *, end: float, seconds: int = 300, cgroup: str = "/system.slice/llm.service",
                  queue: bool = True, seed: int = 3) -> None:  # fmt: skip
    """A small, realistic history ending at ``end``: 1 Hz host/cgroup/process samples and requests.

    With ``queue`` the request stream is a single slot offered a load that ramps past its capacity
    (the queue-backlog signature: waits grow, service time stays flat)."""
    rng = np.random.default_rng(seed)
    t0 = end - seconds
    records: list[Any] = [ServiceConfig(ts=t0, service="llm", pid=4000, settings={"workers": 1, "max_concurrency": 1,
                                                                                   "queue_size": 512})]  # fmt: skip
    for i in range(seconds):
        ts = t0 + i
        used = (6 << 30) + int(rng.normal(0, 32 << 20))
        some = float(abs(rng.normal(0.2, 0.1)))
        psi = Psi(some=PsiLine(some, some, some, 1000 * i), full=PsiLine(some / 3, some / 3, some / 3, 300 * i))
        records.append(HostSnapshot(ts=ts, psi={"memory": psi, "cpu": psi, "io": psi},
                                    memory={"total": 24 << 30, "available": (24 << 30) - used, "free": (12 << 30)},
                                    vmstat={"pgmajfault": 10 * i, "pgfault": 5000 * i}))  # fmt: skip
        usage = (2 << 30) + int(rng.normal(0, 16 << 20))
        records.append(CgroupSnapshot(ts=ts, path=cgroup, version="hybrid", usage_bytes=usage, working_set_bytes=usage,
                                      limit_bytes=4 << 30, stat={"anon": usage, "inactive_file": 0, "pgmajfault": i},
                                      pressure=psi))  # fmt: skip
        records.append(ProcessSample(ts=ts, pid=4000, comm="python3", cmdline="python3 -m server --api-key <redacted>",
                                     start_time_s=100.0, rss_bytes=usage, memory_cgroup=cgroup, major_faults=i))  # fmt: skip
    if queue:
        service = 0.2
        free_at = t0
        s = 0.0
        while s < seconds - 5:
            rate = 1.0 + 6.0 * (s / seconds)  # 0.2x -> 1.4x of the slot's capacity (5/s)
            s += float(rng.exponential(1 / rate))
            arrival = t0 + s
            start = max(arrival, free_at)
            d = service * float(rng.uniform(0.9, 1.1))
            free_at = start + d
            if free_at < end:
                records.append(RequestTiming(ts=free_at, arrival=arrival, start=start, finish=free_at, outcome="ok",
                                             route="/v1/completions", model="m", prompt_tokens=int(rng.integers(20, 200)),
                                             output_tokens=32, pid=4000))  # fmt: skip
    with FlightRecorder(path, retention_s=10 * 86400, max_size_bytes=1 << 34) as rec:
        rec.write(records)
