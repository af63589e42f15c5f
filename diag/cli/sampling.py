"""The sampling options ``diag snapshot`` and ``diag collect`` share: where /proc and /sys are, what to watch,
how many processes to list, which files are model files -- declared once, and checked into one
``SamplerConfig`` before a sampler is built."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from collectors.processes import DEFAULT_MODEL_EXTENSIONS
from collectors.snapshot import SamplerConfig
from diag.cli import options as opts
from diag.cli.errors import fail

ProcRoot = Annotated[
    Path,
    typer.Option("--proc-root", readable=False, help="Read /proc from here (a container reading the host's /proc, or fixtures)."),
]
SysRoot = Annotated[Path, typer.Option("--sys-root", readable=False, help="Read /sys (cgroupfs) from here.")]
Pids = Annotated[
    list[int] | None,
    typer.Option("--pid", help="Watch this process and its memory cgroup (repeatable). Default: the model holders."),
]
Cgroups = Annotated[
    list[str] | None,
    typer.Option("--cgroup", help="Watch this cgroup, as /proc/<pid>/cgroup prints it, e.g. /system.slice/vllm.service."),
]
TopN = Annotated[int, typer.Option("--top", min=0, help="How many processes to list by RSS (model holders always listed).")]
ModelExt = Annotated[
    list[str] | None,
    typer.Option("--model-ext", help=f"Extra model file extension (repeatable). Built in: {' '.join(DEFAULT_MODEL_EXTENSIONS)}"),
]


def sampler_config(
    proc_root: Path, sys_root: Path, pids: list[int] | None, cgroups: list[str] | None, top: int,
    model_ext: list[str] | None, *, kmsg: bool, gpu: bool,
) -> SamplerConfig:  # fmt: skip
    """Every sampling option checked (exit 2 with the accepted forms) before a sampler is built."""
    if not (proc_root / "meminfo").exists() and not (proc_root / "pressure").exists():
        fail(f"--proc-root {proc_root}: no meminfo or pressure/ there; is this a /proc tree?")
    try:
        opts.existing_dir("--sys-root", sys_root)
        config = SamplerConfig(
            proc_root=str(proc_root),
            sys_root=str(sys_root),
            pids=opts.pids(pids),
            cgroups=opts.cgroups(cgroups),
            top_n=top,
            model_extensions=tuple(DEFAULT_MODEL_EXTENSIONS) + opts.model_extensions(model_ext),
            kmsg_path="/dev/kmsg" if kmsg else None,
            gpu=gpu,
        )
    except opts.OptionError as exc:
        fail(str(exc))
    return config
