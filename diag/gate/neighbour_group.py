"""Where the gate's neighbour lives: the service's memory cgroup found, a sibling of it made with a hard limit,
the hog started inside it, and everything removed again -- plus the hog itself (``python -m
diag.gate.neighbour_group --hog BYTES --seconds S --parent PID``).

Why a sibling of the service's group (same parent), v1 memory hierarchy or v2 where the memory controller is
there: that is where a real neighbour sits -- another unit of the same slice, another container of the same
pod -- and where the parent's limit, or the service's own protection (v2 memory.min/low), decides whose pages
reclaim takes. Safety is enforced here, whatever the caller does:

- the group gets its hard limit (size + ``SLACK_BYTES``, the interpreter's own few MiB) *before* the hog joins
  it, and swap is closed to it where the hierarchy lets us say so; the hog joins between fork and exec, so
  nothing it touches is charged elsewhere;
- the hog refuses to run outside a limited group, dies with the gate (``PR_SET_PDEATHSIG``), exits by itself
  after its hold, and is killed by PID -- with anything else found in the group -- before the group is removed;
- a neighbour larger than half the host's MemAvailable is refused: the check probes the service's isolation,
  it must never put the host itself under pressure.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from collectors.cgroup import V1_UNLIMITED_THRESHOLD, discover_mounts, parse_proc_cgroup, procs_in

SLACK_BYTES = 32 << 20  # the hog's interpreter and page tables beside what it touches
HOST_SHARE = 0.5  # the neighbour's limit may be at most this share of the host's MemAvailable
PAGE = 4096
PR_SET_PDEATHSIG = 1
NAME_PREFIX = "llmdiag-gate-neighbour"


class NotRun(RuntimeError):
    """The negative check cannot run here; the message says why (and the verdict is NOT RUN, never PASS)."""


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _int(path: Path) -> int | None:
    text = _read(path).strip()
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= V1_UNLIMITED_THRESHOLD else value


@dataclass(frozen=True)
class TargetGroup:
    """The service's memory cgroup: ``path`` as /proc prints it, ``dir`` its directory, ``kind`` v1 or v2,
    ``pressure`` its PSI file (v2, or the cgroup2 twin of a v1 group on a hybrid host) when there is one."""

    path: str
    dir: Path
    kind: str
    pressure: Path | None

    @property
    def parent_dir(self) -> Path:
        return self.dir.parent

    @property
    def parent_path(self) -> str:
        return self.path.rsplit("/", 1)[0] or "/"

    def usage_file(self) -> Path:
        return self.dir / ("memory.usage_in_bytes" if self.kind == "v1" else "memory.current")

    def limit_of(self, directory: Path) -> int | None:
        """The hard limit of ``directory`` (a group of the same hierarchy), None when unlimited or unreadable."""
        return _int(directory / ("memory.limit_in_bytes" if self.kind == "v1" else "memory.max"))

    def oom_kills(self) -> int | None:
        """The kernel's own count of OOM kills of this group's tasks (v1 memory.oom_control, v2 memory.events)."""
        name = "memory.oom_control" if self.kind == "v1" else "memory.events"
        for line in _read(self.dir / name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                with contextlib.suppress(ValueError):
                    return int(value)
        return None

    def pids(self) -> list[int]:
        return procs_in(self.dir)

    def protection(self) -> str:
        """What shields the service's pages from a neighbour's reclaim, in words (the evidence line)."""
        if self.kind == "v2":
            low, low_min = _read(self.dir / "memory.low").strip() or "?", _read(self.dir / "memory.min").strip() or "?"
            return f"cgroup v2: memory.min {low_min}, memory.low {low} (the service's own protection from reclaim)"
        soft = _int(self.dir / "memory.soft_limit_in_bytes")
        soft_text = "unlimited" if soft is None else f"{soft >> 20} MiB"
        return (f"cgroup v1: no hard protection (memory.min/low exist in v2 only); soft limit {soft_text} "
                "(heeded only under host-wide pressure): only the others' limits keep their pages off the service's")  # fmt: skip


def resolve_target(pids: tuple[int, ...], cgroups: tuple[str, ...], sys_root: str = "/sys") -> TargetGroup:
    """The service's memory cgroup from ``--cgroup`` (first) or ``--pid`` (first that has one); ``NotRun`` says why not."""
    if os.geteuid() != 0:
        raise NotRun("needs root to create a memory cgroup beside the service's (run the gate as root)")
    mounts = discover_mounts(sys_root)
    candidates: list[str] = list(cgroups)
    for pid in pids:
        member = parse_proc_cgroup(_read(Path(f"/proc/{pid}/cgroup")) or None)
        if member.v1_memory and mounts.v1_memory is not None:
            candidates.append(member.v1_memory)
        elif member.v2:
            candidates.append(member.v2)
    if not candidates:
        raise NotRun("name the service with --pid or --cgroup: the neighbour is placed beside its memory cgroup")
    for path in candidates:
        path = "/" + path.strip("/")
        for_v1 = mounts.v1_memory / path.lstrip("/") if mounts.v1_memory is not None else None
        if for_v1 is not None and (for_v1 / "memory.limit_in_bytes").is_file():
            twin = mounts.v2 / path.lstrip("/") / "memory.pressure" if mounts.v2 is not None else None
            return _checked(TargetGroup(path, for_v1, "v1", twin if twin is not None and twin.is_file() else None))
        for_v2 = mounts.v2 / path.lstrip("/") if mounts.v2 is not None else None
        if for_v2 is not None and (for_v2 / "memory.max").is_file():
            pressure = for_v2 / "memory.pressure"
            return _checked(TargetGroup(path, for_v2, "v2", pressure if pressure.is_file() else None))
    where = ", ".join(str(m) for m in (mounts.v1_memory, mounts.v2) if m is not None) or "no cgroup hierarchy mounted"
    raise NotRun(f"the service's memory cgroup ({', '.join(candidates)}) is not under a memory hierarchy here ({where})")


def _checked(target: TargetGroup) -> TargetGroup:
    if target.path == "/":
        raise NotRun("the service runs in the root memory cgroup: there is no parent to place a neighbour beside it in")
    if target.kind == "v2" and "memory" not in _read(target.parent_dir / "cgroup.subtree_control").split():
        raise NotRun(f"the memory controller is not enabled for the children of {target.parent_path} (cgroup.subtree_control)")
    return target


def host_available_bytes() -> int | None:
    for line in _read(Path("/proc/meminfo")).splitlines():
        if line.startswith("MemAvailable:"):
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split()[1]) * 1024
    return None


@dataclass
class NeighbourGroup:
    """The sibling group, its limit, and the hog in it. ``close()`` kills by PID and removes the group; idempotent."""

    target: TargetGroup
    dir: Path
    path: str
    limit_bytes: int
    hog_pids: list[int] = field(default_factory=list)
    leftover: str = ""  # why the group could not be removed (reported, never silent)

    @classmethod
    def create(cls, target: TargetGroup, size_bytes: int) -> NeighbourGroup:
        limit = size_bytes + SLACK_BYTES
        avail = host_available_bytes()
        if avail is not None and limit > HOST_SHARE * avail:
            raise NotRun(
                f"a {size_bytes >> 20} MiB neighbour (limit {limit >> 20} MiB) is more than {HOST_SHARE:.0%} of the host's "
                f"MemAvailable ({avail >> 20} MiB): it would pressure the host itself, not probe the service's isolation"
            )
        leaf = f"{NAME_PREFIX}-{uuid.uuid4().hex[:8]}"
        directory = target.parent_dir / leaf
        try:
            directory.mkdir()
        except OSError as exc:
            raise NotRun(f"cannot create {target.parent_path.rstrip('/')}/{leaf}: {exc.strerror}") from None
        group = cls(target, directory, f"{target.parent_path.rstrip('/')}/{leaf}", limit)
        try:
            group._limit()
        except OSError as exc:
            group.close()
            raise NotRun(f"cannot set the neighbour's limit in {directory}: {exc.strerror}") from None
        return group

    def _limit(self) -> None:
        """The hard limit before anything joins; swap closed where the hierarchy has the knob (no swap: nothing to do)."""
        if self.target.kind == "v1":
            (self.dir / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            memsw = self.dir / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(self.limit_bytes))  # memory + swap = memory: nothing of it goes to swap
        else:
            (self.dir / "memory.max").write_text(str(self.limit_bytes))
            with contextlib.suppress(OSError):
                (self.dir / "memory.swap.max").write_text("0")

    def join_in_child(self) -> None:
        """``preexec_fn``: the child (after fork, before exec) joins the group; plain syscalls only."""
        fd = os.open(str(self.dir / "cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def hog_argv(self, size_bytes: int, seconds: float) -> list[str]:
        return [sys.executable, "-m", "diag.gate.neighbour_group", "--hog", str(size_bytes), "--seconds", f"{seconds:.3f}",
                "--parent", str(os.getpid())]  # fmt: skip

    def usage_bytes(self) -> int | None:
        return _int(self.dir / ("memory.usage_in_bytes" if self.target.kind == "v1" else "memory.current"))

    def pids(self) -> list[int]:
        return procs_in(self.dir)

    def kill_all(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the hog and anything else in the group, by PID, until the group is empty."""
        for pid in self.hog_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def close(self) -> None:
        """Kill everything in the group and remove it (a killed task can take a moment to leave)."""
        if not self.dir.exists():
            return
        self.kill_all()
        for _ in range(200):
            try:
                self.dir.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                self.leftover = f"{self.path}: {exc.strerror}"
                time.sleep(0.025)


# --------------------------------------------------------------------------- the hog process


def own_limit_bytes() -> int | None:
    """The hard limit of this process's memory cgroup (v1 or v2), None when unlimited or unknown."""
    member = parse_proc_cgroup(_read(Path("/proc/self/cgroup")) or None)
    mounts = discover_mounts("/sys")
    if member.v1_memory and mounts.v1_memory is not None:
        return _int(mounts.v1_memory / member.v1_memory.lstrip("/") / "memory.limit_in_bytes")
    if member.v2 and mounts.v2 is not None:
        return _int(mounts.v2 / member.v2.lstrip("/") / "memory.max")
    return None


def hog(size_bytes: int, seconds: float, parent: int) -> int:
    """Touch ``size_bytes`` of anonymous memory, say ``ready``, hold it ``seconds``, exit. Refuses without a limit."""
    with contextlib.suppress(OSError, AttributeError):  # die with the gate, whatever kills it
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        return 3  # the gate is already gone
    limit = own_limit_bytes()
    if limit is None or limit < size_bytes:
        print(f"hog: refusing to run: this memory cgroup's limit ({limit}) does not bound {size_bytes} bytes", file=sys.stderr)
        return 2
    deadline = time.monotonic() + seconds
    buf = bytearray(b"\xa5") * size_bytes  # written, so resident: anonymous pages reclaim can only swap
    print("ready", flush=True)
    pages = range(0, size_bytes, PAGE)
    while (left := deadline - time.monotonic()) > 0:
        for i in pages:  # keep every page recently used, so with swap too it stays the hottest memory around
            buf[i] = 0x5A
        time.sleep(min(0.5, left))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The gate's neighbour: touch BYTES of memory and hold it for SECONDS.")
    ap.add_argument("--hog", type=int, required=True, metavar="BYTES")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--parent", type=int, required=True)
    args = ap.parse_args(argv)
    return hog(args.hog, args.seconds, args.parent)


if __name__ == "__main__":
    raise SystemExit(main())
