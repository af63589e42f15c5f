"""``diag snapshot``: one consistent snapshot of the host, its watched groups, processes and GPUs, now."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from diag.cli.sampling import Cgroups, ModelExt, Pids, ProcRoot, SysRoot, TopN, sampler_config


def snapshot(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document instead of tables.")] = False,
    proc_root: ProcRoot = Path("/proc"),
    sys_root: SysRoot = Path("/sys"),
    pid: Pids = None,
    cgroup: Cgroups = None,
    top: TopN = 10,
    model_ext: ModelExt = None,
    gpu: Annotated[bool, typer.Option("--gpu/--no-gpu", help="Query NVML.")] = True,
) -> None:
    """Take one snapshot now: host memory and PSI, watched cgroups, top processes and model holders, GPUs.

    Fields that could not be read are shown as missing with the reason, never as zero. A --pid that does
    not exist or a --cgroup that is not found is said so on stderr (with the hierarchies searched).

    Exit status: 0 the snapshot was taken; 1 targets were given with --pid/--cgroup and none of them
    exists (the snapshot is still printed); 2 an option is invalid.

    Examples:\n
      diag snapshot\n
      diag snapshot --pid $(pgrep -f vllm | head -1) --json | jq .cgroups
    """
    from collectors.snapshot import SnapshotTaker

    taker = SnapshotTaker(sampler_config(proc_root, sys_root, pid, cgroup, top, model_ext, kmsg=False, gpu=gpu))
    try:
        snap = taker.take()
    finally:
        taker.close()
    if as_json:
        from diag.views.snapshot import snapshot_document

        json.dump(snapshot_document(snap), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        from diag.views.snapshot import render_snapshot

        render_snapshot(snap)
    scope = snap.scope
    if scope is not None:
        for line in scope.missing:
            typer.secho(f"diag snapshot: not found: {line}", err=True, fg=typer.colors.YELLOW)
        if not scope.resolved_pids and not scope.resolved_cgroups:
            typer.secho("diag snapshot: none of the processes or groups asked for exists", err=True, fg=typer.colors.RED)
            raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``snapshot`` to the ``diag`` app."""
    app.command("snapshot")(snapshot)
