"""The watched processes' own /proc files: status, cgroup, OOM score, smaps_rollup, limits.

Never ``environ`` (secrets live there) and never ``cmdline`` (the snapshot's samples carry the redacted argv).
"""

from __future__ import annotations

from collectors.procfs import under
from diag.bundle.plugin import FileCopy, Found, State

PID_FILES = ("status", "cgroup", "oom_score", "oom_score_adj", "smaps_rollup", "limits")


def watched_pids(state: State) -> list[int]:
    """``--pid`` first, then the processes the snapshot saw holding a model file."""
    o = state.options
    pids = list(dict.fromkeys([*o.pids, *(p.pid for p in state.processes if p.model_files)]))
    return pids[: o.max_watched_pids]


def pid_files(state: State) -> Found:
    pids = watched_pids(state)
    if not pids:
        return Found(skipped="no watched process (pass --pid; by default the model holders)")
    root = state.options.proc_root
    files = [FileCopy(str(under(root, str(pid), name)), f"raw/proc/{pid}/{name}") for pid in pids for name in PID_FILES]
    return Found(files, notes={"pids": pids})
