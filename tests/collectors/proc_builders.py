"""Synthetic /proc/<pid> trees for the process-sampler tests: stat, smaps_rollup, cgroup, cmdline, maps, fd links.

Shared by several test modules (test modules never import each other).
"""

from __future__ import annotations

import os
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def stat_line(
    pid: int, comm: str = "proc", *, ppid: int = 1, flags: int = 0, start: int = 1000, vsize: int = 1 << 30, rss_pages: int = 100
) -> str:
    fields = ["S", ppid, pid, pid, 0, -1, flags, 11, 0, 2, 0, 5, 3, 0, 0, 20, 0, 4, 0, start, vsize, rss_pages]
    return f"{pid} ({comm}) " + " ".join(str(f) for f in fields) + " 18446744073709551615 0 0\n"


def rollup(pss_kb: int = 50, swap_kb: int = 0) -> str:
    return (
        "00400000-ffffffffff601000 ---p 00000000 00:00 0                          [rollup]\n"
        f"Rss:  {pss_kb + 10} kB\nPss:  {pss_kb} kB\nShared_Clean: 4 kB\nPrivate_Clean: 20 kB\n"
        f"Private_Dirty: 30 kB\nSwap:  {swap_kb} kB\n"
    )


def make_proc(
    root: Path,
    pid: int,
    *,
    comm: str = "proc",
    rss_pages: int = 100,
    flags: int = 0,
    start: int = 1000,
    cmdline: bytes | None = None,
    maps: str = "",
    fd_targets: tuple[str, ...] = (),
) -> Path:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(stat_line(pid, comm, flags=flags, start=start, rss_pages=rss_pages))
    (d / "smaps_rollup").write_text(rollup())
    (d / "cgroup").write_text("4:memory:/svc\n0::/\n")
    (d / "cmdline").write_bytes(cmdline if cmdline is not None else f"{comm}\0--port\08000\0".encode())
    (d / "maps").write_text(maps)
    fd = d / "fd"
    fd.mkdir(exist_ok=True)
    for i, target in enumerate(fd_targets):
        link = fd / str(i)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target)
    return d


def maps_line(path: str) -> str:
    return f"7f0000000000-7f0000100000 r--p 00000000 fd:01 1234                       {path}\n"
