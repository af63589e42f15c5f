"""Real memory cgroups for the demo scenarios: the product twin of ``tests/livecg.py``.

Why in the product: ``diag demo --scenario`` reproduces incidents *for real* on the user's machine,
so the fault has to be contained by a real kernel limit -- a leak that really leaks must hit a
cgroup limit, never the host. Rules this module enforces (and the tests check):

- every group is a child of *our own* v1 memory cgroup (never a sibling, never the root) and gets
  its hard limit (``memory.limit_in_bytes``) before any process joins it;
- on a hybrid host (cgroup2 mounted without the memory controller) each group gets a cgroup2 twin
  of the same name, joined by the same processes, because per-group PSI exists only in cgroup2;
- a process joins the group(s) in ``preexec_fn`` -- after fork, before exec -- so nothing it
  allocates escapes the limit;
- ``close()`` kills every process in every group *by PID* (from the group's ``cgroup.procs``, so a
  worker a supervisor respawned is caught too; repeated until the group is empty) and removes the
  directories; ``ScenarioCgroups`` is a context manager and ``terminate_as_interrupt`` turns SIGTERM
  into ``KeyboardInterrupt`` so the same ``finally`` runs on Ctrl-C and on ``kill`` (and holds both
  signals while that cleanup runs).

Unavailable (not root, no v1 memory controller): ``unavailable_reason()`` says why and
``ScenarioCgroups.create`` raises ``CgroupUnavailable`` with that reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors.cgroup import procs_in

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
MAX_LIMIT_BYTES = 4 << 30  # a scenario never needs more; anything larger is a bug in the caller
NAME_PREFIX = "llmdiag-demo"


class CgroupUnavailable(RuntimeError):
    """Memory cgroups cannot be created here; the message says why."""


def own_v1_memory_cgroup() -> str | None:
    """Our own v1 memory cgroup path, as /proc/self/cgroup prints it."""
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            return parts[2]
    return None


def own_v2_cgroup() -> tuple[Path, str] | None:
    """(cgroup2 mount, our cgroup2 path) when a cgroup2 hierarchy is mounted."""
    for root in V2_ROOTS:
        if (root / "cgroup.controllers").exists():
            with contextlib.suppress(OSError):
                for line in Path("/proc/self/cgroup").read_text().splitlines():
                    if line.startswith("0::"):
                        return root, line[3:]
    return None


def unavailable_reason() -> str | None:
    """Why scenario cgroups cannot be created here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create memory cgroups (run as root, e.g. in the CI container)"
    own = own_v1_memory_cgroup()
    if own is None or not (V1_ROOT / own.lstrip("/")).is_dir():
        return f"no cgroup v1 memory controller mounted at {V1_ROOT} (cgroup v2-only hosts are not supported yet)"
    if not (V1_ROOT / own.lstrip("/") / "memory.limit_in_bytes").exists():
        return f"own memory cgroup {own} has no memory.limit_in_bytes"
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@dataclass
class MemoryGroup:
    """A limited child memory cgroup. ``path`` is as /proc/<pid>/cgroup shows it (what samplers and kmsg print)."""

    name: str
    path: str
    v1_dir: Path
    v2_dir: Path | None
    limit_bytes: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start a process already inside the group (it joins before exec, so nothing escapes the limit)."""
        v1_procs = str(self.v1_dir / "cgroup.procs")
        v2_procs = str(self.v2_dir / "cgroup.procs") if self.v2_dir else None

        def join() -> None:  # runs in the child between fork and exec: keep it to plain syscalls
            pid = str(os.getpid()).encode()
            fd = os.open(v1_procs, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
            if v2_procs is not None:
                with contextlib.suppress(OSError):
                    fd = os.open(v2_procs, os.O_WRONLY)
                    try:
                        os.write(fd, pid)
                    finally:
                        os.close(fd)

        proc = subprocess.Popen(list(argv), preexec_fn=join, **kwargs)
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process in the group now (our spawns and their children, respawned workers included)."""
        return procs_in(self.v1_dir)

    def read_v1(self, name: str) -> str:
        return _read(self.v1_dir / name)

    def usage_bytes(self) -> int:
        try:
            return int(self.read_v1("memory.usage_in_bytes").strip())
        except ValueError:
            return 0

    def oom_kills(self) -> int:
        """The group's ``oom_kill`` count (v1 memory.oom_control): the kernel's own tally, not a process exit code."""
        for line in self.read_v1("memory.oom_control").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                with contextlib.suppress(ValueError):
                    return int(value)
        return 0

    def stat(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in self.read_v1("memory.stat").splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
        return out

    def kill_all(self, timeout: float = 15.0) -> list[int]:
        """SIGKILL every process in the group, by PID, until it is empty. Returns the PIDs killed."""
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        for proc in self.procs:  # ours first: a supervisor killed first respawns nothing
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)
        for proc in self.procs:  # reap our children so none is left a zombie
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return sorted(set(killed))

    def remove(self) -> bool:
        """Remove both directories (the group must be empty). True when nothing is left."""
        ok = True
        for directory in (self.v2_dir, self.v1_dir):
            if directory is None:
                continue
            for _ in range(100):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)  # a killed task can take a moment to leave the group
            else:
                ok = False
        return ok

    def exists(self) -> bool:
        return self.v1_dir.exists() or (self.v2_dir is not None and self.v2_dir.exists())


class ScenarioCgroups:
    """Creates limited groups and removes them all -- with everything in them -- on ``close()``/exit."""

    def __init__(self, prefix: str = NAME_PREFIX) -> None:
        self.prefix = prefix
        self.groups: list[MemoryGroup] = []
        self.killed: list[int] = []
        self.leftovers: list[str] = []  # paths that could not be removed (reported, never silent)

    def create(self, name: str, limit_bytes: int) -> MemoryGroup:
        reason = unavailable_reason()
        if reason:
            raise CgroupUnavailable(reason)
        if not 0 < limit_bytes <= MAX_LIMIT_BYTES:
            raise ValueError(f"a scenario group needs a limit between 1 byte and {MAX_LIMIT_BYTES >> 30} GiB")
        own = own_v1_memory_cgroup() or "/"
        leaf = f"{self.prefix}-{name}-{uuid.uuid4().hex[:8]}"
        path = f"{own.rstrip('/')}/{leaf}"
        v1_dir = V1_ROOT / path.lstrip("/")
        v1_dir.mkdir()
        group = MemoryGroup(name=name, path=path, v1_dir=v1_dir, v2_dir=None, limit_bytes=limit_bytes)
        self.groups.append(group)  # registered before anything can fail: close() removes it
        (v1_dir / "memory.limit_in_bytes").write_text(str(limit_bytes))
        v2 = own_v2_cgroup()
        if v2 is not None and "memory" not in _read(v2[0] / "cgroup.controllers").split():
            root, v2_own = v2
            candidate = root / v2_own.lstrip("/") / leaf
            with contextlib.suppress(OSError):
                candidate.mkdir()
                group.v2_dir = candidate
        return group

    def close(self) -> None:
        """Kill every process in every group (by PID) and remove the groups; idempotent."""
        for group in reversed(self.groups):
            self.killed += group.kill_all()
        for group in reversed(self.groups):
            if not group.remove():
                self.leftovers.append(group.path)
        self.groups = [g for g in self.groups if g.exists()]

    def __enter__(self) -> ScenarioCgroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InterruptGuard:
    """SIGTERM and SIGINT become ``KeyboardInterrupt`` -- except inside ``shield()``, where they are held
    until the block ends (cleanup must not be cut short by a second Ctrl-C or a repeated ``kill``)."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self._shielded = 0

    def handler(self, signum: int, frame: object) -> None:
        if self._shielded:
            self.pending = signum
            return
        raise KeyboardInterrupt(f"signal {signum}")

    @contextlib.contextmanager
    def shield(self) -> Iterator[None]:
        self._shielded += 1
        try:
            yield
        finally:
            self._shielded -= 1
        if not self._shielded and self.pending is not None:
            signum, self.pending = self.pending, None
            raise KeyboardInterrupt(f"signal {signum} (held during cleanup)")


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[InterruptGuard]:
    """Install an ``InterruptGuard`` for SIGTERM and SIGINT for the duration, so ``finally`` blocks run on ``kill`` too.

    Outside the main thread (signal handlers cannot be installed there) the guard is inert.
    """
    guard = InterruptGuard()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    previous = {sig: signal.signal(sig, guard.handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield guard
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
