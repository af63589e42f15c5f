"""Real memory cgroups for live tests: a v1 memory child (the limit) plus, where cgroup2 is mounted
without the memory controller (hybrid hosts like CI here), a v2 twin for per-group PSI.

Safety rules this module enforces: every group is a child of *our own* memory cgroup, always has a
limit, and is removed on exit after every process we started in it has been killed -- by PID,
never by name. A test that cannot run here gets a skip with the exact reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


def own_v1_memory_cgroup() -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    return None


def own_v2_cgroup() -> tuple[Path, str] | None:
    for root in V2_ROOTS:
        if (root / "cgroup.controllers").exists():
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                if line.startswith("0::"):
                    return root, line[3:]
    return None


def skip_reason() -> str | None:
    """Why live cgroup tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create memory cgroups (CI runs as root)"
    own = own_v1_memory_cgroup()
    if own is None or not (V1_ROOT / own.lstrip("/")).is_dir():
        return "no cgroup v1 memory controller mounted at /sys/fs/cgroup/memory"
    return None


def require_live() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)


@dataclass
class LiveGroup:
    """A child memory cgroup with a hard limit; ``path`` is as /proc/<pid>/cgroup shows it."""

    path: str
    v1_dir: Path
    v2_dir: Path | None
    limit_bytes: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start a process already inside the group (it joins before exec, so nothing escapes the limit)."""
        v1_procs = self.v1_dir / "cgroup.procs"
        v2_procs = self.v2_dir / "cgroup.procs" if self.v2_dir else None

        def join() -> None:
            pid = str(os.getpid())
            v1_procs.write_text(pid)
            if v2_procs is not None:
                with contextlib.suppress(OSError):
                    v2_procs.write_text(pid)

        proc = subprocess.Popen(list(argv), preexec_fn=join, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def read_v1(self, name: str) -> str:
        return (self.v1_dir / name).read_text()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int, name: str = "llmdiag-test") -> Iterator[LiveGroup]:
    """Create a limited child of our own memory cgroup (and its v2 twin), yield it, remove both."""
    require_live()
    if limit_bytes <= 0 or limit_bytes > 4 << 30:
        raise ValueError("live test groups need a limit between 1 byte and 4 GiB")
    own = own_v1_memory_cgroup() or "/"
    leaf = f"{name}-{uuid.uuid4().hex[:8]}"
    path = f"{own.rstrip('/')}/{leaf}"
    v1_dir = V1_ROOT / path.lstrip("/")
    v1_dir.mkdir()
    v2_dir: Path | None = None
    group = LiveGroup(path=path, v1_dir=v1_dir, v2_dir=None, limit_bytes=limit_bytes)
    try:
        (v1_dir / "memory.limit_in_bytes").write_text(str(limit_bytes))
        v2 = own_v2_cgroup()
        if v2 is not None:
            root, v2_own = v2
            candidate = root / v2_own.lstrip("/") / leaf
            with contextlib.suppress(OSError):
                candidate.mkdir()
                v2_dir = candidate
        group.v2_dir = v2_dir
        yield group
    finally:
        group.kill_all()
        for directory in (v2_dir, v1_dir):
            if directory is None:
                continue
            for _ in range(50):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    # A killed task can take a moment to leave the group.
                    time.sleep(0.1)
