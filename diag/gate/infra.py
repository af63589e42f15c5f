"""The infrastructure gate: read-only checks of the host and of the target's memory cgroup, before any load.

What is read (all under ``proc_root`` / ``sys_root``, so it runs on fake trees and in containers): which cgroup
version accounts the target's memory and whether the memory controller is on its group; where memory PSI can be
read (the group's own ``memory.pressure`` on cgroup2, else the host's ``/proc/pressure/memory``, else nowhere);
whether the kernel accounts memory at all (``/proc/cgroups``, and a unit's ``MemoryAccounting``); the swap policy
(swap present, the group's ``memory.swap.max`` / v1 ``memory.memsw.limit_in_bytes``, ``swappiness``); the group's
*effective* limits -- the lowest ``memory.max`` / ``memory.high`` on its path to the root, because a parent's limit
binds a child whose own file says ``max``, and a child's memory.low/min protect only as far as its parent's do
(without the ``memory_recursiveprot`` mount option) (v1: ``hierarchical_memory_limit``, and the soft limit); and with
``--unit`` what systemd applied, plus systemd-oomd's state.

Why nothing is written or signalled here: the gate runs against production-shaped hosts; it reports what it finds.
Each check is PASS / WARN / NOT AVAILABLE by what it read, and FAIL only where the spec's ``infrastructure:``
section requires it (``diag.gate.spec.InfraSpec``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from collectors.cgroup import V1_UNLIMITED_THRESHOLD, Mounts, clean_cgroup_path, discover_mounts, parse_proc_cgroup
from collectors.procfs import parse_flat_keyed, parse_int, parse_limit, parse_meminfo, parse_psi, read_text, under
from collectors.records import Psi
from diag.gate.gates import Check, GateResult, State
from diag.gate.spec import InfraSpec
from diag.gate.unit import OomdState, UnitInfo
from diag.units import format_bytes


@dataclass(frozen=True)
class Group:
    """The target's memory cgroup: where its memory files are and, for PSI, its cgroup2 group (v2 or a hybrid's twin)."""

    path: str
    kind: Literal["v1", "v2"]
    memory_dir: Path
    root: Path  # the hierarchy's root: the effective limits are read up to it
    v2_dir: Path | None
    source: str  # how it was found: "--cgroup /x", "--pid 42", "unit x.service"


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


def _twin_hint(v1_dir: Path, proc_root: str) -> str | None:
    """The cgroup2 path of the first process in a v1 group (its ``0::`` line): where a hybrid host keeps its PSI."""
    first = (read_text(v1_dir / "cgroup.procs", max_bytes=4096).text or "").split("\n", 1)[0].strip()
    if not first.isdigit():
        return None
    v2 = parse_proc_cgroup(read_text(under(proc_root, first, "cgroup")).text).v2
    return clean_cgroup_path(v2) if v2 else None


def _group_at(path: str, mounts: Mounts, source: str, proc_root: str, v2_hint: str | None = None) -> Group | str:
    """The group at ``path``: v1 memory first (memory is accounted there on a v1 or hybrid host), then cgroup2."""
    if mounts.v1_memory is not None and _is_dir(d := under(mounts.v1_memory, path)):
        twin_path = v2_hint or _twin_hint(d, proc_root) or path
        # a process in cgroup2's root has no group of its own there: the root's pressure is the whole host's
        twin = under(mounts.v2, twin_path) if mounts.v2 is not None and twin_path != "/" else None
        return Group(path, "v1", d, mounts.v1_memory, twin if twin is not None and _is_dir(twin) else None, source)
    if mounts.v2 is not None and _is_dir(d := under(mounts.v2, path)):
        return Group(path, "v2", d, mounts.v2, d, source)
    where = [f"{m}" for m in (mounts.v1_memory, mounts.v2) if m is not None]
    return f"{source}: group {path} not found under {' or '.join(where) or 'any cgroup hierarchy'}"


def resolve_group(cgroups: Sequence[str], pids: Sequence[int], mounts: Mounts, proc_root: str,
                  unit: UnitInfo | None = None) -> Group | str | None:  # fmt: skip
    """The first target's group (the unit's, else the first --cgroup, else the first --pid's); a string says why
    it could not be found; None when no target was named."""
    if unit is not None and unit.cgroup:
        return _group_at(unit.cgroup, mounts, f"unit {unit.name}", proc_root)
    for raw in cgroups:
        path = clean_cgroup_path(raw)
        return _group_at(path, mounts, f"--cgroup {raw}", proc_root) if path else f"--cgroup {raw!r}: not a cgroup path"
    for pid in [*pids, *([unit.main_pid] if unit is not None and unit.main_pid else [])]:
        text = read_text(under(proc_root, str(pid), "cgroup")).text
        if text is None:
            return f"--pid {pid}: /proc/{pid}/cgroup unreadable (process gone?)"
        member = parse_proc_cgroup(text)
        path = member.v1_memory if member.v1_memory and mounts.v1_memory is not None else member.v2
        clean = clean_cgroup_path(path) if path else None
        if clean is None:
            return f"--pid {pid}: no memory cgroup in /proc/{pid}/cgroup"
        return _group_at(clean, mounts, f"--pid {pid}", proc_root, member.v2)
    return None


def _chain(group: Group) -> list[Path]:
    """The group's directory and its ancestors below the hierarchy's root (the root has no limit files)."""
    out, d = [], group.memory_dir
    while d != group.root and group.root in d.parents:
        out.append(d)
        d = d.parent
    return out


def _effective_v2(group: Group, file: str) -> tuple[int | None, str, str]:
    """The lowest ``file`` on the path to the root: (bytes or None for none, the group that sets it, a read error)."""
    best: int | None = None
    at = ""
    for d in _chain(group):
        ok, value = parse_limit(read_text(d / file).text)
        if not ok:
            if d == group.memory_dir:
                return None, "", f"{file} unreadable at {group.path}"
            continue
        if value is not None and (best is None or value < best):
            best, at = value, "/" + str(d.relative_to(group.root)).strip(".")
    return best, at or "", ""


def _v1_value(group: Group, file: str) -> int | None:
    value = parse_int(read_text(group.memory_dir / file).text)
    return None if value is None or value >= V1_UNLIMITED_THRESHOLD else value


def _psi_now(psi: Psi) -> str:
    return f"some avg10 {psi.some.avg10:g} % now" if psi.some is not None else "readable"


def _state(ok: bool, required: bool, bad: State = "WARN") -> State:
    return "PASS" if ok else ("FAIL" if required else bad)


def _required(flag: bool, name: str) -> str:
    return f" (required: {name})" if flag else ""


# --------------------------------------------------------------------------- the checks


def _cgroup_check(req: InfraSpec, group: Group | str | None, mounts: Mounts) -> Check:
    need = _required(req.require_cgroup_v2, "require_cgroup_v2")
    if isinstance(group, str):
        return Check("cgroup", "FAIL", "target not found", group)
    if group is None:
        if mounts.v2 is not None and "memory" in (read_text(mounts.v2 / "cgroup.controllers").text or "").split():
            return Check("cgroup", "PASS", "v2 (memory controller on)", "host only: no --pid, --cgroup or --unit named")
        if mounts.v1_memory is not None:
            return Check("cgroup", _state(False, req.require_cgroup_v2), "v1 memory hierarchy",
                         f"host only: no target named; memory is accounted by cgroup v1{need}")  # fmt: skip
        return Check("cgroup", "FAIL" if req.require_cgroup_v2 else "NOT AVAILABLE", "no memory cgroup hierarchy",
                     f"neither a v1 memory nor a cgroup2 hierarchy with the memory controller{need}")  # fmt: skip
    if group.kind == "v2":
        controllers = (read_text(group.memory_dir / "cgroup.controllers").text or "").split()
        if "memory" not in controllers:
            state: State = "FAIL" if req.require_memory_accounting else "WARN"
            return Check("cgroup", state, f"v2, no memory controller on {group.path}",
                         f"{group.source}: cgroup.controllers {' '.join(controllers) or '(empty)'}; the parent's "
                         "cgroup.subtree_control does not enable memory, so the group has no memory limits or stats")  # fmt: skip
        return Check("cgroup", "PASS", f"v2, memory controller on {group.path}", group.source)
    hybrid = " (hybrid: cgroup2 mounted beside it)" if mounts.v2 is not None else ""
    return Check("cgroup", _state(False, req.require_cgroup_v2), f"v1 memory controller on {group.path}",
                 f"{group.source}; memory is accounted by cgroup v1{hybrid}: no memory.high/low/min, no per-group "
                 f"PSI from v1{need}")  # fmt: skip


def _psi_check(req: InfraSpec, group: Group | str | None, proc_root: str) -> Check:
    why_not_group = ""
    if isinstance(group, Group):
        if group.v2_dir is not None:
            res = read_text(group.v2_dir / "memory.pressure")
            psi = parse_psi(res.text)
            if psi is not None:
                return Check("psi", "PASS", f"per-group: {group.v2_dir / 'memory.pressure'}", _psi_now(psi))
            why_not_group = f"the group's memory.pressure: {res.error or 'no some/full line'}"
        else:
            why_not_group = "no cgroup2 group for the target (per-group PSI exists only in cgroup2)"
    host = under(proc_root, "pressure", "memory")
    res = read_text(host)
    psi = parse_psi(res.text)
    if psi is not None:
        if isinstance(group, Group):  # the host's stalls mix every group's: the target's own are not separable
            return Check("psi", "WARN", f"host only: {host}", f"{why_not_group}; the host's figure includes every other job")
        return Check("psi", "PASS", f"host: {host}", _psi_now(psi))
    need = _required(req.require_psi, "require_psi")
    detail = "; ".join(x for x in (why_not_group, f"{host}: {res.error or 'no some/full line'} (kernel without "
                                   "CONFIG_PSI, or booted with psi=0)") if x)  # fmt: skip
    return Check("psi", "FAIL" if req.require_psi else "NOT AVAILABLE", "not available", detail + need)


def _accounting_check(req: InfraSpec, proc_root: str, unit: UnitInfo | None) -> Check:
    need = _required(req.require_memory_accounting, "require_memory_accounting")
    table = read_text(under(proc_root, "cgroups")).text
    enabled: bool | None = None
    for line in (table or "").splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "memory":
            enabled = parts[3] == "1"
    if unit is not None and unit.properties.get("MemoryAccounting", "yes") != "yes":
        return Check("memory_accounting", _state(False, req.require_memory_accounting),
                     f"MemoryAccounting={unit.properties['MemoryAccounting']}",
                     f"unit {unit.name}: systemd does not account its memory{need}")  # fmt: skip
    if enabled is None:
        return Check("memory_accounting", "FAIL" if req.require_memory_accounting else "NOT AVAILABLE", "unknown",
                     f"{under(proc_root, 'cgroups')} has no memory line{need}")  # fmt: skip
    if not enabled:
        return Check("memory_accounting", _state(False, req.require_memory_accounting), "off",
                     f"the memory controller is disabled (cgroup_disable=memory?){need}")  # fmt: skip
    on_unit = f"; unit {unit.name}: MemoryAccounting=yes" if unit is not None and "MemoryAccounting" in unit.properties else ""
    return Check("memory_accounting", "PASS", "on", f"memory controller enabled in {under(proc_root, 'cgroups')}{on_unit}")


def _swappiness(group: Group | None, proc_root: str) -> str:
    if group is not None and group.kind == "v1":
        v = parse_int(read_text(group.memory_dir / "memory.swappiness").text)
        if v is not None:
            return f"swappiness {v} (the group's)"
    v = parse_int(read_text(under(proc_root, "sys", "vm", "swappiness")).text)
    return f"swappiness {v} (the host's)" if v is not None else "swappiness unreadable"


def _swap_check(req: InfraSpec, group: Group | str | None, proc_root: str) -> Check:
    need = _required(req.forbid_swap, "forbid_swap")
    meminfo = parse_meminfo(read_text(under(proc_root, "meminfo")).text)
    total = meminfo.get("SwapTotal")
    g = group if isinstance(group, Group) else None
    swappiness = _swappiness(g, proc_root)
    if total is None:
        return Check("swap", "FAIL" if req.forbid_swap else "NOT AVAILABLE", "unknown", f"/proc/meminfo has no SwapTotal{need}")
    if total == 0:
        return Check("swap", "PASS", f"no swap (SwapTotal 0); {swappiness}", "the target's memory cannot be swapped out")
    swap = f"swap {format_bytes(total)}"
    if g is None:
        return Check("swap", _state(False, req.forbid_swap), f"{swap}; {swappiness}",
                     f"no target group to read a swap limit from: the host may swap{need}")  # fmt: skip
    if g.kind == "v2":
        ok, limit = parse_limit(read_text(g.memory_dir / "memory.swap.max").text)
        if not ok:
            return Check("swap", _state(False, req.forbid_swap), f"{swap}; memory.swap.max unreadable; {swappiness}",
                         f"no swap accounting on {g.path} (swapaccount=0?): its swap use is unbounded{need}")  # fmt: skip
        value = f"{swap}; memory.swap.max {'max' if limit is None else format_bytes(limit)}; {swappiness}"
        if limit == 0:
            return Check("swap", "PASS", value, f"{g.path} may not swap (memory.swap.max 0)")
        return Check("swap", _state(False, req.forbid_swap), value, f"{g.path} may swap{need}")
    memsw = _v1_value(g, "memory.memsw.limit_in_bytes")
    limit = _v1_value(g, "memory.limit_in_bytes")
    has_memsw = (g.memory_dir / "memory.memsw.limit_in_bytes").exists()
    shown = "memory.memsw.limit_in_bytes " + ("absent (swap accounting off)" if not has_memsw else
                                              ("unlimited" if memsw is None else format_bytes(memsw)))  # fmt: skip
    value = f"{swap}; {shown}; {swappiness}"
    if has_memsw and memsw is not None and limit is not None and memsw <= limit:
        return Check("swap", "PASS", value, f"{g.path} may not swap (memsw limit = memory limit)")
    return Check("swap", _state(False, req.forbid_swap), value, f"{g.path} may swap{need}")


def _limits_checks(req: InfraSpec, group: Group | str | None, unit: UnitInfo | None) -> list[Check]:
    need = _required(req.require_memory_max, "require_memory_max")
    if not isinstance(group, Group):
        why = group if isinstance(group, str) else "no --pid, --cgroup or --unit named: no group to read limits from"
        return [Check("memory_max", "FAIL" if req.require_memory_max else "NOT AVAILABLE", "no target group", why + need),
                Check("memory_protection", "NOT AVAILABLE", "no target group", why)]  # fmt: skip
    systemd = f"; unit {unit.name}: MemoryMax={unit.properties.get('MemoryMax', '?')}" if unit is not None else ""
    if group.kind == "v2":
        limit, at, err = _effective_v2(group, "memory.max")
        if err:
            return [Check("memory_max", "FAIL" if req.require_memory_max else "NOT AVAILABLE", "unreadable", err + need),
                    Check("memory_protection", "NOT AVAILABLE", "unreadable", err)]  # fmt: skip
        values = {f: _effective_v2(group, f"memory.{f}")[:2] for f in ("high", "low", "min")}
        shown = ", ".join(f"{f} {'max' if v is None and f == 'high' else format_bytes(v or 0)}"
                          + (f" (at {a})" if a and a != group.path else "") for f, (v, a) in values.items())  # fmt: skip
        protection = Check("memory_protection", "PASS", shown, f"effective on {group.path}: the lowest on its path to the root")
    else:
        limit = parse_flat_keyed(read_text(group.memory_dir / "memory.stat").text).get("hierarchical_memory_limit")
        limit = None if limit is None or limit >= V1_UNLIMITED_THRESHOLD else limit
        at = "hierarchical_memory_limit"
        if limit is None:
            limit = _v1_value(group, "memory.limit_in_bytes")
            at = ""
        soft = _v1_value(group, "memory.soft_limit_in_bytes")
        protection = Check("memory_protection", "PASS", f"soft limit {'none' if soft is None else format_bytes(soft)}",
                           "cgroup v1 has no memory.high, memory.low or memory.min; its soft limit is reclaimed to "
                           "under pressure")  # fmt: skip
    if limit is None:
        return [Check("memory_max", _state(False, req.require_memory_max), "unlimited",
                      f"{group.path} and its ancestors set no hard limit: the host's OOM killer decides{systemd}{need}"),
                protection]  # fmt: skip
    if at == "hierarchical_memory_limit":
        where = f"{group.path}: memory.stat hierarchical_memory_limit (the lowest limit on its path to the root)"
    else:
        where = f"set at {at}" if at and at != group.path else f"on {group.path}"
    return [Check("memory_max", "PASS", format_bytes(limit), f"{where}{systemd}"), protection]


def _unit_check(unit: UnitInfo) -> Check:
    active = unit.properties.get("ActiveState", "?")
    ok = active == "active" and unit.main_pid is not None and unit.cgroup is not None
    why = "" if ok else f"the unit is {active}" + ("" if unit.main_pid else ", no MainPID")
    why += "" if ok or unit.cgroup else ", no ControlGroup"
    return Check("unit", "PASS" if ok else "WARN", unit.describe(), why.lstrip(", "))


def _oomd_check(oomd: OomdState, group: Group | str | None) -> Check:
    if oomd.active is None:
        return Check("systemd_oomd", "NOT AVAILABLE", "unknown", oomd.why)
    if oomd.active != "active":
        return Check("systemd_oomd", "NOT AVAILABLE", oomd.active, "systemd-oomd does not run: only the kernel's OOM killer acts")
    path = group.path if isinstance(group, Group) else None
    watched = oomd.monitors(path)
    if watched is None:
        return Check("systemd_oomd", "PASS", "active", oomd.why or "no target group to look up in oomctl")
    return Check(
        "systemd_oomd",
        "PASS" if watched else "WARN",
        "active",
        f"oomctl {'lists' if watched else 'does not list'} {path} (or a parent) among the groups it watches",
    )


def check_infrastructure(req: InfraSpec, *, pids: Sequence[int] = (), cgroups: Sequence[str] = (),
                         unit: UnitInfo | None = None, oomd: OomdState | None = None,
                         proc_root: str = "/proc", sys_root: str = "/sys") -> GateResult:  # fmt: skip
    """Every check, in a fixed order; never raises (a file that cannot be read is a check's value, with why)."""
    mounts = discover_mounts(sys_root)
    group = resolve_group(cgroups, pids, mounts, proc_root, unit)
    gate = GateResult("infrastructure")
    gate.add(_cgroup_check(req, group, mounts))
    gate.add(_accounting_check(req, proc_root, unit))
    gate.add(_psi_check(req, group, proc_root))
    gate.add(_swap_check(req, group, proc_root))
    for c in _limits_checks(req, group, unit):
        gate.add(c)
    if unit is not None:
        gate.add(_unit_check(unit))
    if oomd is not None:
        gate.add(_oomd_check(oomd, group))
    return gate
