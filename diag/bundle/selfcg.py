"""Keep the bundle process out of the memory cgroup it diagnoses.

Why: a collector charged to the sick group competes for the very memory that is short -- it
thrashes along with the service, may be OOM-killed before it writes anything, and its own reads
perturb the numbers it reports (so: never run the collector inside the cgroup it is
diagnosing). If our memory cgroup is a watched group or inside one, we move ourselves
to the watched group's parent (or the root) when we may (root), and otherwise say so loudly.

v1 moves a process by writing its pid to another group's ``cgroup.procs``; so does v2, where the
"no internal processes" rule can refuse a parent that delegates memory to children -- hence the
fall-back to the root group, which is exempt. Charges already made stay with the old group (v1
without ``move_charge_at_immigrate``); what matters is that new allocations do not.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from collectors.cgroup import clean_cgroup_path, discover_mounts, parse_proc_cgroup
from collectors.procfs import under


@dataclass
class SelfCgroup:
    hierarchy: str | None  # "v1" (memory controller) | "v2" | None (no memory cgroup found)
    before: str | None
    inside: str | None = None  # the watched group we were in (or under)
    moved_to: str | None = None
    after: str | None = None
    warning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def own_memory_cgroup(proc_root: str = "/proc", sys_root: str = "/sys") -> tuple[str | None, str | None, Path | None]:
    """(hierarchy, path, hierarchy root) of this process's memory cgroup."""
    try:
        text = Path(under(proc_root, "self", "cgroup")).read_text()
    except OSError:
        return None, None, None
    member = parse_proc_cgroup(text)
    mounts = discover_mounts(sys_root)
    if member.v1_memory and mounts.v1_memory is not None:
        return "v1", clean_cgroup_path(member.v1_memory), mounts.v1_memory
    if member.v2 and mounts.v2 is not None:
        return "v2", clean_cgroup_path(member.v2), mounts.v2
    return None, None, None


def _inside(own: str, group: str) -> bool:
    if group == "/":  # everything is under the root; the root has no limit to compete for
        return False
    return own == group or own.startswith(group.rstrip("/") + "/")


def _parent(path: str) -> str:
    head = path.rstrip("/").rsplit("/", 1)[0]
    return head or "/"


def leave_watched(watched: Iterable[str], proc_root: str = "/proc", sys_root: str = "/sys") -> SelfCgroup:
    """Move this process out of any watched memory group (to its parent, else the root) when root."""
    hierarchy, own, root = own_memory_cgroup(proc_root, sys_root)
    state = SelfCgroup(hierarchy, own)
    if own is None or root is None:
        return state
    groups = [g for g in (clean_cgroup_path(w) for w in watched) if g]
    inside = next((g for g in groups if _inside(own, g)), None)
    if inside is None:
        state.after = own
        return state
    state.inside = inside
    if os.geteuid() != 0:
        state.after = own
        state.warning = (
            f"this process runs inside the watched cgroup {inside} and cannot leave it (not root): its own memory "
            "is charged to the group it diagnoses; run diag bundle as root or from outside the service's cgroup"
        )
        return state
    errors = []
    for target in dict.fromkeys((_parent(inside), "/")):
        try:
            (under(root, target) / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as exc:
            errors.append(f"{target}: {os.strerror(exc.errno) if exc.errno else exc}")
            continue
        state.moved_to = target
        break
    _, state.after, _ = own_memory_cgroup(proc_root, sys_root)
    if state.moved_to is None:
        state.warning = f"inside the watched cgroup {inside} and could not move out ({'; '.join(errors)})"
    return state
