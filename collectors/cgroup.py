"""Memory state of watched cgroups, on cgroup v1, v2 or a hybrid host -> ``CgroupSnapshot`` records.

Why per cgroup: the limit that decides who gets OOM-killed is the service's memory cgroup, not the
host's RAM, and its memory.events / failcnt say whether the limit was hit before anyone died.

What is watched: explicit group paths (``--cgroup /process_api/x/svc``, as /proc/<pid>/cgroup
prints them) and the groups of given PIDs, re-resolved through ``/proc/<pid>/cgroup`` on every
sample because a restarted service may land in a new group. One snapshot per distinct group.
PIDs that cannot be resolved (gone, no memory cgroup) produce no snapshot; the last sample's
reasons are in ``CgroupSampler.unresolved``.

Mounts, under ``sys_root``: the v1 memory controller at ``fs/cgroup/memory``; cgroup2 at
``fs/cgroup/unified`` (hybrid layout) or ``fs/cgroup`` (unified layout), recognised by its
``cgroup.controllers`` file. ``version`` on the record:

* ``v2``: everything from the cgroup2 group (memory.current/peak/max/high/low/min,
  memory.swap.current, memory.events(.local) by key, memory.stat as is, memory.pressure).
* ``v1``: memory from the v1 group, and no cgroup2 hierarchy to take pressure from.
* ``hybrid``: memory from the v1 group, ``pressure`` from the process's cgroup2 group (its
  ``0::`` line) -- per-group PSI exists only in cgroup2, even without its memory controller. For
  an explicit path the twin is the cgroup2 group of the first process in the v1 group's
  cgroup.procs, else a cgroup2 group at the same path. With no twin to be found the version
  still says hybrid (it describes how memory is accounted) and ``missing["pressure"]`` says why.
* ``none``: the group was not found; ``missing["group"]`` says where it was looked for.

v1 is mapped so both versions read the same downstream:

* usage = memory.usage_in_bytes, peak = memory.max_usage_in_bytes, limit = memory.limit_in_bytes,
  where the page-counter maximum (9223372036854771712) or anything >= 2**60 means unlimited (None).
* ``events["max"]`` = memory.failcnt (times usage hit the limit, v2's "max" event);
  ``events["oom_kill"]`` = memory.oom_control oom_kill; ``under_oom`` from the same file.
* ``stat`` uses the **v2 key names**, filled from the hierarchical ``total_*`` keys (the local
  keys only when a kernel prints no ``total_*`` at all): total_rss -> anon, total_cache -> file,
  total_mapped_file -> file_mapped, total_dirty -> file_dirty, total_writeback -> file_writeback,
  total_rss_huge -> anon_thp; keys whose v1 and v2 names agree keep them (inactive_file,
  active_file, inactive_anon, active_anon, unevictable, shmem, swapcached, pgfault, pgmajfault,
  workingset_refault_anon/file, ...); v1-only keys keep their v1 name without ``total_``
  (pgpgin, pgpgout). total_swap is not a stat key: it becomes ``swap_bytes`` (present only with
  swap accounting on). v1 "rss" is anon plus swap cache, close to but not exactly v2 "anon".

working_set_bytes = usage - stat inactive_file, clamped at 0 (cAdvisor's definition).

Contract: ``sample()`` never raises. A file that cannot be read or parsed leaves its field None
(or its dict empty) and puts ``field -> reason`` in ``missing``. Fields a version does not have
(v1: high/low/min, events_local; v2: under_oom) stay None/empty and are not listed as missing.
The root cgroup has no memory.current & co. on v2: what is there is reported, the rest listed.
"""

from __future__ import annotations

import errno as errno_codes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from collectors.procfs import parse_flat_keyed, parse_int, parse_limit, parse_psi, read_text, under
from collectors.records import CgroupSnapshot

# v1 reports "no limit" as PAGE_COUNTER_MAX * PAGE_SIZE, rounded down to the page size
# (9223372036854771712 with 4 KiB pages); other page sizes give other values just under 2**63.
V1_UNLIMITED_THRESHOLD = 1 << 60

# v1 memory.stat name (after total_) -> v2 name, where they differ.
V1_STAT_RENAMES: dict[str, str] = {
    "rss": "anon",
    "cache": "file",
    "mapped_file": "file_mapped",
    "dirty": "file_dirty",
    "writeback": "file_writeback",
    "rss_huge": "anon_thp",
}
# Not stat keys after mapping: swap goes to swap_bytes; the hierarchical limits are limits.
_V1_STAT_EXCLUDED = frozenset({"swap", "hierarchical_memory_limit", "hierarchical_memsw_limit"})

_ENOENT = errno_codes.ENOENT


@dataclass(frozen=True)
class Mounts:
    """Where the hierarchies are under sys_root (None when not mounted)."""

    v1_memory: Path | None
    v2: Path | None


def discover_mounts(sys_root: str) -> Mounts:
    """Find the v1 memory hierarchy and the cgroup2 hierarchy under ``sys_root`` (cheap: a few stats)."""
    base = under(sys_root, "fs", "cgroup")
    v1: Path | None = base / "memory"
    try:
        if not (v1 / "memory.usage_in_bytes").is_file():  # a v2 child named "memory" would not have it
            v1 = None
    except (OSError, ValueError):
        v1 = None
    v2: Path | None = None
    for candidate in (base / "unified", base):
        try:
            if (candidate / "cgroup.controllers").is_file():
                v2 = candidate
                break
        except (OSError, ValueError):
            continue
    return Mounts(v1_memory=v1, v2=v2)


@dataclass(frozen=True)
class Membership:
    """A process's groups as /proc/<pid>/cgroup prints them."""

    v1_memory: str | None  # the path on the v1 line whose controllers include "memory"
    v2: str | None  # the path on the "0::" line


def parse_proc_cgroup(text: str | None) -> Membership:
    """``hierarchy-id:controllers:path`` lines -> the v1 memory path and the cgroup2 path (either may be None).

    A cgroup2 path of a removed group carries a `` (deleted)`` suffix; it is dropped here and the
    directory lookup then fails, which reports the group as missing rather than guessing.
    """
    v1: str | None = None
    v2: str | None = None
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        path = path.removesuffix(" (deleted)")
        if not path.startswith("/"):
            continue
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return Membership(v1_memory=v1, v2=v2)


def clean_cgroup_path(path: str) -> str | None:
    """Normalise a cgroup path (``/a//b/`` -> ``/a/b``); None if it could escape the hierarchy or is garbage."""
    if not path or "\x00" in path or not path.startswith("/"):
        return None
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        return None
    return "/" + "/".join(parts)


@dataclass(frozen=True)
class _Target:
    path: str
    version: Literal["v1", "v2", "hybrid", "none"]
    memory_dir: Path | None  # where the memory files are (v1 or v2 group)
    memory_kind: str | None  # "v1" | "v2"
    pressure_dir: Path | None
    pressure_reason: str | None  # why pressure_dir is None
    group_reason: str | None = None  # why memory_dir is None


class CgroupSampler:
    """Samples the memory cgroups of ``pids`` and the explicitly named ``cgroups``."""

    def __init__(
        self,
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        *,
        pids: Sequence[int] = (),
        cgroups: Sequence[str] = (),
    ) -> None:
        self.proc_root = proc_root
        self.sys_root = sys_root
        self.pids = tuple(pids)
        self.cgroups = tuple(cgroups)
        self.unresolved: dict[int, str] = {}  # pid -> why it produced no snapshot, last sample

    def sample(self, now: float | None = None) -> list[CgroupSnapshot]:
        ts = time.time() if now is None else now
        try:
            mounts = discover_mounts(self.sys_root)
            targets = self._targets(mounts)
        except Exception as exc:  # resolution is written not to raise; keep the promise if it does
            self.unresolved = {pid: f"sampler error: {type(exc).__name__}" for pid in self.pids}
            return []
        snapshots: list[CgroupSnapshot] = []
        for target in targets:
            snap = CgroupSnapshot(ts=ts, path=target.path, version=target.version)
            try:
                self._fill(snap, target)
            except Exception as exc:
                snap.missing.setdefault("group", f"sampler error: {type(exc).__name__}")
            snapshots.append(snap)
        return snapshots

    # ------------------------------------------------------------------ resolution

    def _targets(self, mounts: Mounts) -> list[_Target]:
        self.unresolved = {}
        seen: set[tuple[str, str]] = set()
        targets: list[_Target] = []

        def add(target: _Target) -> None:
            key = (target.memory_kind or target.version, target.path)
            if key not in seen:
                seen.add(key)
                targets.append(target)

        for raw in self.cgroups:
            path = clean_cgroup_path(raw) if isinstance(raw, str) else None
            if path is None:
                add(_Target(str(raw), "none", None, None, None, None, "not an absolute cgroup path"))
                continue
            add(self._target_for_path(path, mounts))
        for pid in self.pids:
            target = self._target_for_pid(pid, mounts)
            if target is not None:
                add(target)
        return targets

    def _target_for_path(self, path: str, mounts: Mounts) -> _Target:
        if mounts.v1_memory is not None:
            v1_dir = under(mounts.v1_memory, path)
            if _is_dir(v1_dir):
                return self._v1_target(path, v1_dir, mounts, self._twin_of_v1_group(v1_dir, path, mounts))
        if mounts.v2 is not None:
            v2_dir = under(mounts.v2, path)
            if _is_dir(v2_dir):
                return _Target(path, "v2", v2_dir, "v2", v2_dir, None)
        where = [f"{m} ({name})" for m, name in ((mounts.v1_memory, "v1 memory"), (mounts.v2, "cgroup2")) if m is not None]
        reason = f"not found under {' or '.join(where)}" if where else f"no cgroup hierarchy under {self.sys_root}/fs/cgroup"
        return _Target(path, "none", None, None, None, None, reason)

    def _target_for_pid(self, pid: int, mounts: Mounts) -> _Target | None:
        result = read_text(under(self.proc_root, str(pid), "cgroup"))
        if result.text is None:
            self.unresolved[pid] = result.error or "unreadable"
            return None
        member = parse_proc_cgroup(result.text)
        v1_path = clean_cgroup_path(member.v1_memory) if member.v1_memory else None
        v2_path = clean_cgroup_path(member.v2) if member.v2 else None
        if v1_path is not None:
            if mounts.v1_memory is None:
                return _Target(v1_path, "none", None, None, None, None,
                               f"cgroup v1 memory hierarchy not mounted at {self.sys_root}/fs/cgroup/memory")  # fmt: skip
            twin: tuple[Path | None, str | None]
            if mounts.v2 is None:
                twin = (None, None)
            elif v2_path is None:
                twin = (None, f"/proc/{pid}/cgroup has no cgroup2 (0::) line")
            else:
                twin = (under(mounts.v2, v2_path), None)
            v1_dir = under(mounts.v1_memory, v1_path)
            if not _is_dir(v1_dir):
                return _Target(v1_path, "none", None, None, None, None, f"{v1_dir} does not exist (group removed?)")
            return self._v1_target(v1_path, v1_dir, mounts, twin)
        if v2_path is not None and mounts.v2 is not None:
            v2_dir = under(mounts.v2, v2_path)
            if not _is_dir(v2_dir):
                return _Target(v2_path, "none", None, None, None, None, f"{v2_dir} does not exist (group removed?)")
            return _Target(v2_path, "v2", v2_dir, "v2", v2_dir, None)
        self.unresolved[pid] = f"no memory cgroup in /proc/{pid}/cgroup"
        return None

    def _v1_target(self, path: str, v1_dir: Path, mounts: Mounts, twin: tuple[Path | None, str | None]) -> _Target:
        if mounts.v2 is None:
            return _Target(path, "v1", v1_dir, "v1", None, "no cgroup2 hierarchy mounted (v1 has no per-group PSI)")
        twin_dir, reason = twin
        return _Target(path, "hybrid", v1_dir, "v1", twin_dir, reason)

    def _twin_of_v1_group(self, v1_dir: Path, path: str, mounts: Mounts) -> tuple[Path | None, str | None]:
        """The cgroup2 group of a process in this v1 group; else a cgroup2 group at the same path."""
        if mounts.v2 is None:
            return None, None
        procs = read_text(v1_dir / "cgroup.procs", max_bytes=4096)
        first = (procs.text or "").split("\n", 1)[0].strip()
        if first.isascii() and first.isdigit() and (not procs.truncated or "\n" in (procs.text or "")):
            member = parse_proc_cgroup(read_text(under(self.proc_root, first, "cgroup")).text)
            v2_path = clean_cgroup_path(member.v2) if member.v2 else None
            if v2_path is not None and _is_dir(under(mounts.v2, v2_path)):
                return under(mounts.v2, v2_path), None
        same = under(mounts.v2, path)
        if _is_dir(same):
            return same, None
        return None, "no process in the group to locate its cgroup2 twin, and no cgroup2 group at the same path"

    # ------------------------------------------------------------------ reading

    def _fill(self, snap: CgroupSnapshot, target: _Target) -> None:
        if target.memory_dir is None:
            snap.missing["group"] = target.group_reason or "not found"
            return
        if target.memory_kind == "v1":
            self._fill_v1(snap, target.memory_dir)
        else:
            self._fill_v2(snap, target.memory_dir)
        if target.pressure_dir is not None:
            text, reason = _read(target.pressure_dir / "memory.pressure", target.path)
            snap.pressure = parse_psi(text)
            if snap.pressure is None:
                snap.missing["pressure"] = reason or "no parseable some/full line in memory.pressure"
        else:
            snap.missing["pressure"] = target.pressure_reason or "no cgroup2 group to read memory.pressure from"
        self._working_set(snap)

    def _fill_v2(self, snap: CgroupSnapshot, d: Path) -> None:
        snap.usage_bytes = _int_field(snap, "usage_bytes", d / "memory.current")
        snap.peak_bytes = _int_field(snap, "peak_bytes", d / "memory.peak")
        snap.swap_bytes = _int_field(snap, "swap_bytes", d / "memory.swap.current")
        for name, file in (("limit_bytes", "memory.max"), ("high_bytes", "memory.high"),
                           ("low_bytes", "memory.low"), ("min_bytes", "memory.min")):  # fmt: skip
            text, reason = _read(d / file, snap.path)
            ok, value = parse_limit(text)
            if ok:
                setattr(snap, name, value)
            else:
                snap.missing[name] = reason or f"{file} is neither a number nor 'max'"
        snap.events = _keyed_field(snap, "events", d / "memory.events")
        snap.events_local = _keyed_field(snap, "events_local", d / "memory.events.local")
        snap.stat = _keyed_field(snap, "stat", d / "memory.stat")

    def _fill_v1(self, snap: CgroupSnapshot, d: Path) -> None:
        snap.usage_bytes = _int_field(snap, "usage_bytes", d / "memory.usage_in_bytes")
        snap.peak_bytes = _int_field(snap, "peak_bytes", d / "memory.max_usage_in_bytes")
        limit = _int_field(snap, "limit_bytes", d / "memory.limit_in_bytes")
        snap.limit_bytes = None if limit is None or limit >= V1_UNLIMITED_THRESHOLD else limit
        failcnt = _int_field(snap, "events.max", d / "memory.failcnt")
        if failcnt is not None:
            snap.events["max"] = failcnt
        oom = _keyed_field(snap, "oom_control", d / "memory.oom_control")
        if "oom_kill" in oom:
            snap.events["oom_kill"] = oom["oom_kill"]
        elif oom:
            snap.missing["events.oom_kill"] = "memory.oom_control has no oom_kill (kernel < 4.13)"
        if oom.get("under_oom") in (0, 1):
            snap.under_oom = bool(oom["under_oom"])
        elif oom:
            snap.missing["under_oom"] = "memory.oom_control has no under_oom 0|1"
        if "oom_control" in snap.missing:
            snap.missing["under_oom"] = snap.missing["events.oom_kill"] = snap.missing.pop("oom_control")
        raw = _keyed_field(snap, "stat", d / "memory.stat")
        snap.stat, swap = map_v1_stat(raw)
        if swap is not None:
            snap.swap_bytes = swap
        elif raw:
            snap.missing["swap_bytes"] = "memory.stat has no swap (swap accounting off)"
        elif "stat" in snap.missing:
            snap.missing["swap_bytes"] = "memory.stat unreadable"

    def _working_set(self, snap: CgroupSnapshot) -> None:
        inactive = snap.stat.get("inactive_file")
        if snap.usage_bytes is None:
            snap.missing.setdefault("working_set_bytes", "usage unknown")
        elif inactive is None:
            snap.missing.setdefault("working_set_bytes", "memory.stat has no inactive_file")
        else:
            snap.working_set_bytes = max(snap.usage_bytes - inactive, 0)


def map_v1_stat(raw: dict[str, int]) -> tuple[dict[str, int], int | None]:
    """v1 memory.stat -> (stat with v2 key names, swap bytes or None). See the module docstring."""
    hierarchical = {k[len("total_") :]: v for k, v in raw.items() if k.startswith("total_")}
    source = hierarchical or raw
    stat: dict[str, int] = {}
    for key, value in source.items():
        if key in _V1_STAT_EXCLUDED:
            continue
        stat[V1_STAT_RENAMES.get(key, key)] = value
    return stat, source.get("swap")


def procs_in(group_dir: str | Path) -> list[int]:
    """The PIDs in a cgroup directory now (its ``cgroup.procs``; v1 and v2 alike), [] when it is gone or unreadable.

    The one reader for everything that must act on a group's processes by PID -- killing what a scenario or a
    gate's neighbour left in its group -- rather than by name. A group holds any number of processes, so the
    file is read whole (no read cap)."""
    try:
        text = (Path(group_dir) / "cgroup.procs").read_text()
    except OSError:
        return []
    return [int(word) for word in text.split() if word.isdigit()]


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _read(path: Path, group: str) -> tuple[str | None, str | None]:
    """Text of a cgroup file, or (None, reason). A truncated read is an error: these files are small."""
    result = read_text(path)
    if result.text is None:
        if result.errno == _ENOENT and group == "/":
            return None, f"the root cgroup has no {path.name}"
        return None, result.error or "unreadable"
    if result.truncated:
        return None, f"larger than the read cap, not a cgroup file ({path})"
    return result.text, None


def _int_field(snap: CgroupSnapshot, name: str, path: Path) -> int | None:
    text, reason = _read(path, snap.path)
    value = parse_int(text)
    if value is None or value < 0:
        snap.missing[name] = reason or f"{path.name} is not a non-negative integer"
        return None
    return value


def _keyed_field(snap: CgroupSnapshot, name: str, path: Path) -> dict[str, int]:
    text, reason = _read(path, snap.path)
    values = {k: v for k, v in parse_flat_keyed(text).items() if v >= 0}  # the kernel clamps these at 0
    if not values:
        snap.missing[name] = reason or f"no 'key value' lines in {path.name}"
    return values
