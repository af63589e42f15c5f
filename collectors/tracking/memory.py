"""How full is *our* memory? A cheap, cached reading for the memory guard and ``health()``.

Why not psutil.virtual_memory(): inside a container or a systemd slice the host's free memory says
nothing about the limit the OOM killer enforces on us. The probe finds the process's own memory
cgroup once (``/proc/self/cgroup`` + ``/proc/self/mountinfo``, so it also works with a cgroup
namespace or a container that mounts its own group at the root) and then reads:

- cgroup v2 with the memory controller: ``memory.current`` - ``inactive_file`` (from ``memory.stat``)
  over the smallest ``memory.max`` of the group and its ancestors;
- cgroup v1: ``memory.usage_in_bytes`` - ``total_inactive_file`` over ``hierarchical_memory_limit``
  (which already folds in the ancestors' limits);
- no limit (or a limit above the host's RAM): host ``MemTotal - MemAvailable`` over ``MemTotal``.

Used = working set (usage minus inactive page cache), as the kubelet's eviction signal and
cAdvisor do, so page cache that can be dropped cheaply does not trip the guard.

Memory PSI ``some avg10`` comes from the group's cgroup2 ``memory.pressure`` (on a hybrid host the
v2 twin of the group, which has PSI even without the v2 memory controller), else from
``/proc/pressure/memory``.

A reading costs ~4 small file reads (~60 us); it is reused for ``cache_s`` (0.5 s by default), so
the request path pays it at most twice a second, never per request. Nothing here raises: a file
that cannot be read leaves the value None and its reason in ``error``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from collectors import procfs

# v1 reports "unlimited" as the page-counter maximum (~2^63 rounded to pages).
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryReading:
    """One reading. ``used_ratio`` is None when either side is unknown."""

    mono: float
    used_bytes: int | None
    limit_bytes: int | None
    source: str  # "cgroup-v2:<path>" | "cgroup-v1:<path>" | "host"
    psi_some_avg10: float | None  # percent, 0-100
    psi_source: str | None
    error: str | None = None

    @property
    def used_ratio(self) -> float | None:
        if self.used_bytes is None or not self.limit_bytes:
            return None
        return max(0.0, self.used_bytes / self.limit_bytes)


@dataclass(frozen=True)
class _Mount:
    root: str  # the mount's root inside the hierarchy (mountinfo field 4)
    point: Path


def _parse_mountinfo(text: str | None) -> tuple[_Mount | None, _Mount | None]:
    """(v1 memory mount, cgroup2 mount) from /proc/self/mountinfo text."""
    v1 = v2 = None
    for line in (text or "").splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        root, point, fstype, options = fields[3], fields[4], rfields[0], rfields[2].split(",")
        point = point.replace("\\040", " ")
        if fstype == "cgroup" and "memory" in options and v1 is None:
            v1 = _Mount(root, Path(point))
        elif fstype == "cgroup2" and v2 is None:
            v2 = _Mount(root, Path(point))
    return v1, v2


def _parse_self_cgroup(text: str | None) -> tuple[str | None, str | None]:
    """(v1 memory path, v2 path) from /proc/self/cgroup text."""
    v1 = v2 = None
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _resolve(mount: _Mount, path: str) -> Path | None:
    """Directory of ``path`` (as /proc/self/cgroup prints it) under ``mount``; None if absent."""
    rel = path
    if mount.root not in ("", "/") and (path == mount.root or path.startswith(mount.root.rstrip("/") + "/")):
        rel = path[len(mount.root.rstrip("/")) :]
    candidate = procfs.under(mount.point, rel)
    if candidate.is_dir():
        return candidate
    # A container that mounts its own group at the hierarchy root without a cgroup namespace:
    # /proc/self/cgroup shows the host path, the mount shows our group.
    if mount.point.is_dir():
        return mount.point
    return None


class MemoryProbe:
    """Finds the own memory cgroup once, then reads usage/limit/PSI at most every ``cache_s``.

    ``proc_root`` / ``mountinfo_text`` / ``cgroup_text`` exist for tests (fixture trees); by default
    the live process is probed.
    """

    def __init__(
        self,
        cache_s: float = 0.5,
        *,
        proc_root: str | os.PathLike[str] = "/proc",
        self_cgroup_text: str | None = None,
        mountinfo_text: str | None = None,
    ) -> None:
        self.cache_s = cache_s
        self.proc_root = Path(proc_root)
        self._lock = threading.Lock()
        self._last: MemoryReading | None = None
        if self_cgroup_text is None:
            self_cgroup_text = procfs.read_text(self.proc_root / "self" / "cgroup").text
        if mountinfo_text is None:
            mountinfo_text = procfs.read_text(self.proc_root / "self" / "mountinfo").text
        v1_path, v2_path = _parse_self_cgroup(self_cgroup_text)
        v1_mount, v2_mount = _parse_mountinfo(mountinfo_text)
        self.v1_dir = _resolve(v1_mount, v1_path) if v1_mount and v1_path is not None else None
        self.v2_dir = _resolve(v2_mount, v2_path) if v2_mount and v2_path is not None else None
        self.v2_mount = v2_mount.point if v2_mount else None
        self.v1_path, self.v2_path = v1_path, v2_path
        self.v2_memory = self.v2_dir is not None and (self.v2_dir / "memory.current").exists()
        psi = self.v2_dir / "memory.pressure" if self.v2_dir is not None else None
        if psi is not None and psi.exists():
            self.psi_file, self.psi_source = psi, f"cgroup-v2:{v2_path}"
        else:
            self.psi_file, self.psi_source = self.proc_root / "pressure" / "memory", "host"

    # ------------------------------------------------------------------ reading

    def read(self, max_age_s: float | None = None) -> MemoryReading:
        """The cached reading if younger than ``max_age_s`` (default ``cache_s``), else a fresh one."""
        age = self.cache_s if max_age_s is None else max_age_s
        last = self._last
        now = time.monotonic()
        if last is not None and now - last.mono < age:
            return last
        with self._lock:  # one reader refreshes; concurrent callers reuse its result
            last = self._last
            if last is not None and time.monotonic() - last.mono < age:
                return last
            reading = self._read_now()
            self._last = reading
            return reading

    def _read_now(self) -> MemoryReading:
        errors: list[str] = []
        used = limit = None
        source = "host"
        host_total = None
        meminfo = procfs.parse_meminfo(procfs.read_text(self.proc_root / "meminfo").text)
        host_total = meminfo.get("MemTotal")
        if self.v2_memory and self.v2_dir is not None:
            used, limit, err = self._read_v2(self.v2_dir)
            source = f"cgroup-v2:{self.v2_path}"
        elif self.v1_dir is not None:
            used, limit, err = self._read_v1(self.v1_dir)
            source = f"cgroup-v1:{self.v1_path}"
        else:
            err = None
        if err:
            errors.append(err)
        if limit is not None and host_total is not None and limit >= host_total:
            limit = None  # a limit above the RAM we have is no limit at all
        if limit is None:
            source = "host"
            available = meminfo.get("MemAvailable")
            if host_total is None or available is None:
                errors.append("meminfo: MemTotal/MemAvailable unreadable")
                used = None
            else:
                used, limit = max(0, host_total - available), host_total
        psi = procfs.parse_psi(procfs.read_text(self.psi_file).text)
        avg10 = psi.some.avg10 if psi is not None and psi.some is not None else None
        if avg10 is None:
            errors.append(f"psi: {self.psi_file} unreadable")
        return MemoryReading(
            mono=time.monotonic(),
            used_bytes=used,
            limit_bytes=limit,
            source=source,
            psi_some_avg10=avg10,
            psi_source=self.psi_source if avg10 is not None else None,
            error="; ".join(errors) or None,
        )

    def _read_v1(self, d: Path) -> tuple[int | None, int | None, str | None]:
        usage = procfs.parse_int(procfs.read_text(d / "memory.usage_in_bytes").text)
        stat = procfs.parse_flat_keyed(procfs.read_text(d / "memory.stat").text)
        limit = stat.get("hierarchical_memory_limit")
        if limit is None:
            limit = procfs.parse_int(procfs.read_text(d / "memory.limit_in_bytes").text)
        if limit is not None and limit >= _V1_UNLIMITED:
            limit = None
        if usage is None:
            return None, limit, f"cgroup v1: {d}/memory.usage_in_bytes unreadable"
        inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
        return max(0, usage - inactive), limit, None

    def _read_v2(self, d: Path) -> tuple[int | None, int | None, str | None]:
        current = procfs.parse_int(procfs.read_text(d / "memory.current").text)
        stat = procfs.parse_flat_keyed(procfs.read_text(d / "memory.stat").text)
        limit: int | None = None
        walk: Path | None = d
        for _ in range(32):  # the effective limit is the smallest on the way to the root
            if walk is None:
                break
            ok, value = procfs.parse_limit(procfs.read_text(walk / "memory.max").text)
            if ok and value is not None:
                limit = value if limit is None else min(limit, value)
            if self.v2_mount is None or walk == self.v2_mount:
                break
            walk = walk.parent
        if current is None:
            return None, limit, f"cgroup v2: {d}/memory.current unreadable"
        return max(0, current - stat.get("inactive_file", 0)), limit, None
