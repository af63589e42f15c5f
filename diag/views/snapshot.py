"""Render a snapshot for people (rich tables) and for programs (one JSON document).

Outputs are thin: they show what the samplers recorded and say what is missing; they do not
re-derive anything beyond unit formatting.
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from collectors.records import Psi
from collectors.snapshot import Snapshot
from diag.units import format_bytes


def snapshot_document(snap: Snapshot) -> dict[str, Any]:
    """The ``diag snapshot --json`` document: the records as the flight recorder stores them, plus derived counts."""
    return {
        "ts": snap.ts,
        "duration_s": round(snap.duration_s, 6),
        "host": snap.host.to_dict(),
        "cgroups": [c.to_dict() for c in snap.cgroups],
        "processes": [p.to_dict() for p in snap.processes],
        "model_processes": snap.model_processes(),
        "gpu": snap.gpu.to_dict(),
        "oom_events": [o.to_dict() for o in snap.ooms],
        "errors": snap.errors,
        "scope": snap.scope.to_dict() if snap.scope is not None else None,
    }


def _psi_cell(psi: Psi | None) -> str:
    if psi is None:
        return "-"
    parts = []
    for kind, line in (("some", psi.some), ("full", psi.full)):
        if line is not None:
            parts.append(f"{kind} {line.avg10:.2f}/{line.avg60:.2f}/{line.avg300:.2f}%")
    return "  ".join(parts) or "-"


def _missing(missing: dict[str, str]) -> Text | None:
    if not missing:
        return None
    return Text("missing: " + "; ".join(f"{k} ({v})" for k, v in sorted(missing.items())), style="yellow")


def render_snapshot(snap: Snapshot, console: Console | None = None) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped to a file or a ticket: don't squeeze to 80 columns
            console = Console(width=max(console.width, 160))
    when = dt.datetime.fromtimestamp(snap.ts, tz=dt.UTC).isoformat(timespec="seconds")
    parts: list[Any] = [Text(f"llm-diag snapshot {when} (took {snap.duration_s * 1000:.1f} ms)", style="bold")]

    host = snap.host
    mem = Table(title="Host memory", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("total", "available", "free", "cached", "inactive file", "dirty", "swap used"):
        mem.add_column(col, justify="right", no_wrap=True, min_width=9)
    m = host.memory
    swap_used = m["swap_total"] - m["swap_free"] if "swap_total" in m and "swap_free" in m else None
    available = format_bytes(m.get("available")) + (" (est.)" if host.memory_available_estimated else "")
    mem.add_row(
        format_bytes(m.get("total")), available, format_bytes(m.get("free")), format_bytes(m.get("cached")),
        format_bytes(m.get("inactive_file")), format_bytes(m.get("dirty")), format_bytes(swap_used),
    )  # fmt: skip
    parts.append(mem)

    psi = Table(title="Pressure (avg10/avg60/avg300)", title_justify="left", box=box.SIMPLE_HEAD)
    psi.add_column("resource")
    psi.add_column("PSI")
    for resource in ("cpu", "memory", "io"):
        psi.add_row(resource, _psi_cell(host.psi.get(resource)))
    vm = host.vmstat
    psi.caption = "vmstat: " + ", ".join(
        f"{k}={vm[k]}" for k in ("pgmajfault", "pswpin", "pswpout", "oom_kill", "workingset_refault_file") if k in vm
    )
    parts.append(psi)
    if (note := _missing(host.missing)) is not None:
        parts.append(note)

    if snap.cgroups:
        cg = Table(title="Watched cgroups", title_justify="left", box=box.SIMPLE_HEAD)
        cg.add_column("cgroup", overflow="fold", min_width=12)
        for col in ("ver", "usage", "working set", "limit", "peak", "max/failcnt", "oom_kill", "mem PSI"):
            cg.add_column(col, justify="left" if col == "ver" else "right", no_wrap=True)
        for c in snap.cgroups:
            if c.version == "none":  # never a row of dashes and "unlimited": that reads as "no limit"
                cg.add_row(Text(c.path, style="red"), Text("NOT FOUND", style="red"), *["-"] * 7)
                continue
            cg.add_row(
                c.path, c.version, format_bytes(c.usage_bytes), format_bytes(c.working_set_bytes),
                "unlimited" if c.limit_bytes is None else format_bytes(c.limit_bytes), format_bytes(c.peak_bytes),
                str(c.events.get("max", "-")), str(c.events.get("oom_kill", "-")), _psi_cell(c.pressure),
            )  # fmt: skip
        parts.append(cg)
    else:
        parts.append(Text("Watched cgroups: none (give --pid or --cgroup; by default the groups of model-holding processes)"))

    procs = Table(title="Processes (top by RSS, plus model holders)", title_justify="left", box=box.SIMPLE_HEAD)
    # On a narrow terminal keep what matters most for "who holds the memory": RSS and USS.
    columns = ("pid", "comm", "rss", "pss", "uss", "swap", "majflt") if console.width >= 110 else ("pid", "comm", "rss", "uss")
    rows = []
    for p in snap.processes:
        cmdline = " ".join(p.cmdline.split())  # no newlines or tabs from a `python -c` script
        if p.model_files:
            cmdline = f"[model: {', '.join(os.path.basename(f) for f in p.model_files)}] {cmdline}"
        cells = {
            "pid": str(p.pid), "comm": p.comm[:12], "rss": format_bytes(p.rss_bytes), "pss": format_bytes(p.pss_bytes),
            "uss": format_bytes(p.uss_bytes), "swap": format_bytes(p.swap_bytes),
            "majflt": "-" if p.major_faults is None else str(p.major_faults),
        }  # fmt: skip
        rows.append(([cells[c] for c in columns], cmdline))
    # Fixed widths: rich would otherwise squeeze the numbers rather than the command line.
    widths = [max([len(col)] + [len(r[0][i]) for r in rows]) for i, col in enumerate(columns)]
    for col, width in zip(columns, widths, strict=True):
        procs.add_column(col, justify="left" if col == "comm" else "right", no_wrap=True, width=width)
    cmd_width = max(12, min(100, console.width - sum(w + 3 for w in widths) - 6))
    procs.add_column("command line (secrets redacted)", no_wrap=True, overflow="ellipsis", width=cmd_width)
    for cells_, cmdline in rows:
        procs.add_row(*cells_, Text(cmdline))  # Text: a command line is not rich markup
    parts.append(procs)
    models = snap.model_processes()
    if models:
        parts.append(Text("Model files held: " + ", ".join(f"{k} × {v} processes" for k, v in sorted(models.items()))))

    gpu = snap.gpu
    if gpu.available:
        g = Table(title=f"GPUs (driver {gpu.driver_version})", title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("gpu", "name", "total", "used", "free", "reserved", "util"):
            g.add_column(col)
        for d in gpu.devices:
            util = "-" if d.utilization_gpu_ratio is None else f"{d.utilization_gpu_ratio:.0%}"
            g.add_row(
                str(d.index), d.name, format_bytes(d.total_bytes), format_bytes(d.used_bytes),
                format_bytes(d.free_bytes), format_bytes(d.reserved_bytes), util,
            )  # fmt: skip
        parts.append(g)
    else:
        parts.append(Text(f"GPU: unavailable ({gpu.reason})", style="dim"))
    for oom in snap.ooms:
        parts.append(Text(f"OOM kill: {oom.task} pid {oom.pid} ({oom.constraint}, memcg {oom.task_memcg})", style="red"))
    if snap.scope is not None:
        for line in snap.scope.missing:
            parts.append(Text(f"Asked for but not found: {line}", style="red"))
    for sampler, reason in sorted(snap.errors.items()):
        parts.append(Text(f"{sampler}: {reason}", style="yellow"))
    console.print(Group(*parts))
