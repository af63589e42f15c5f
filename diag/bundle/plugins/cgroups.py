"""The watched groups' own files: every readable ``memory.*`` of the v1 or v2 group, and the v2 twin's
``memory.pressure`` on a hybrid host, resolved the way ``collectors.cgroup`` resolves them."""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from collectors.cgroup import clean_cgroup_path, discover_mounts, parse_proc_cgroup
from collectors.procfs import under
from collectors.records import CgroupSnapshot
from diag.bundle.options import BundleOptions
from diag.bundle.plugin import FileCopy, Found, State

MAX_CGROUPS = 8
# A control file that refuses reads (write-only, or not supported on this kernel) is not a problem.
REFUSED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES})


@dataclass(frozen=True)
class GroupDirs:
    path: str
    memory_dir: Path | None  # v1 memory group, or the v2 group when memory is on v2
    memory_hierarchy: str  # "memory" (v1) | "unified" (v2)
    pressure_dir: Path | None  # the v2 group (or the hybrid's v2 twin) with memory.pressure


def resolve_group(snap: CgroupSnapshot, o: BundleOptions) -> GroupDirs:
    """The directories behind a watched group."""
    mounts = discover_mounts(o.sys_root)
    path = clean_cgroup_path(snap.path) or "/"
    if snap.version == "v2" and mounts.v2 is not None:
        d = under(mounts.v2, path)
        return GroupDirs(path, d, "unified", d)
    if snap.version in ("v1", "hybrid") and mounts.v1_memory is not None:
        v1 = under(mounts.v1_memory, path)
        twin = None
        if mounts.v2 is not None:
            twin = _v2_twin(v1, path, mounts.v2, o.proc_root)
        return GroupDirs(path, v1, "memory", twin)
    return GroupDirs(path, None, "memory", None)


def _v2_twin(v1_dir: Path, path: str, v2_root: Path, proc_root: str) -> Path | None:
    try:
        with open(v1_dir / "cgroup.procs", encoding="ascii", errors="replace") as fh:
            first = fh.readline().strip()
    except OSError:
        first = ""
    if first.isdigit():
        try:
            member = parse_proc_cgroup(Path(under(proc_root, first, "cgroup")).read_text())
        except OSError:
            member = None
        v2_path = clean_cgroup_path(member.v2) if member and member.v2 else None
        if v2_path and under(v2_root, v2_path).is_dir():
            return under(v2_root, v2_path)
    same = under(v2_root, path)
    return same if same.is_dir() else None


def _readable_memory_files(d: Path) -> list[Path]:
    """``memory.*`` files a read cannot change or block on (write-only control files are skipped)."""
    files = []
    for entry in sorted(os.scandir(d), key=lambda e: e.name):
        if not entry.name.startswith("memory."):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & stat.S_IRUSR:
            files.append(Path(entry.path))
    return files


def group_files(state: State) -> Found:
    groups = state.cgroups[:MAX_CGROUPS]
    if not groups:
        return Found(skipped="no watched cgroup (pass --pid or --cgroup; by default the model holders' groups)")
    found = Found(notes={"groups": [g.path for g in groups]})
    for snap in groups:
        dirs = resolve_group(snap, state.options)
        if dirs.memory_dir is None:
            found.problems.append(f"{snap.path}: no memory group found ({snap.missing.get('group', snap.version)})")
            continue
        rel_root = f"raw/cgroup/{dirs.memory_hierarchy}{dirs.path.rstrip('/')}"
        found.files += [FileCopy(str(p), f"{rel_root}/{p.name}") for p in _readable_memory_files(dirs.memory_dir)]
        if dirs.pressure_dir is not None and dirs.pressure_dir != dirs.memory_dir:
            rel_twin = f"raw/cgroup/unified{str(dirs.pressure_dir).split('/unified', 1)[-1].rstrip('/')}"
            found.files.append(FileCopy(str(dirs.pressure_dir / "memory.pressure"), f"{rel_twin}/memory.pressure"))
    return found
