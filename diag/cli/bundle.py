"""``diag bundle``: the command an on-call engineer runs on the sick machine.

Wiring: ``register(app)`` adds the command to a Typer app (``diag/cli/main.py`` calls it). Progress goes
to stderr; stdout gets the verdict and the paths, so ``diag bundle | tail -1`` is the archive.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from diag.bundle.options import BundleOptions


def bundle(
    out: Annotated[
        Path, typer.Option("--out", help="Folder in which the bundle folder and .tar.gz are created (made if missing).")
    ] = Path("."),
    since: Annotated[str, typer.Option(help="History to include from the flight recorder, e.g. 30m, 2h.")] = "30m",
    recorder: Annotated[
        Path | None,
        typer.Option(readable=False, help="Flight recorder to read (default: $LLMDIAG_RECORDER or the agent's)."),
    ] = None,
    deadline: Annotated[str, typer.Option(help="Hard limit for the whole bundle, e.g. 30s, 2m.")] = "30s",
    no_tar: Annotated[bool, typer.Option("--no-tar", help="Write the folder only, no .tar.gz.")] = False,
    pid: Annotated[
        list[int] | None,
        typer.Option("--pid", help="Watch this process and its memory cgroup (repeatable). Default: the model holders."),
    ] = None,
    cgroup: Annotated[
        list[str] | None, typer.Option("--cgroup", help="Watch this cgroup, as /proc/<pid>/cgroup prints it (repeatable).")
    ] = None,
    unit: Annotated[
        str | None, typer.Option(help="systemd unit for the journal excerpt (default: the watched group's .service).")
    ] = None,
    include: Annotated[
        list[Path] | None,
        typer.Option("--include", readable=False, help="Also copy this file (tail-capped, redacted), e.g. the service's config."),
    ] = None,
    gpu: Annotated[bool, typer.Option("--gpu/--no-gpu", help="Query NVML and nvidia-smi.")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
) -> None:
    """Take an incident bundle now: volatile state first, then history, the rules' verdict and a readable report.

    Writes a folder and a .tar.gz with manifest.json (per collector: timing, timeout_hit, bytes, sha256),
    SHA256SUMS, raw/ (verbatim copies), timeline/*.jsonl, findings.json, report.md, report.html and
    redaction.json. Every collector has a timeout and the whole bundle a deadline: a hung collector is
    recorded and abandoned, never waited for. Secrets and prompts are redacted from every file.

    A part that cannot be collected (an unreadable file, no /dev/kmsg, no NVML or nvidia-smi, a flight
    recorder that is missing or not a database) is named in manifest.json, report.md and on stdout with
    its reason; the rest is still collected.

    Exit status: 0 the bundle was written (possibly with parts missing, each named with its reason);
    1 the bundle could not be written under --out; 2 an option is invalid (nothing was collected).

    Examples:\n
      diag bundle                                   # model holders' groups, last 30 min of history\n
      diag bundle --pid 4242 --since 1h --out /var/tmp\n
      diag bundle --cgroup /system.slice/vllm.service --deadline 15s
    """
    from diag.bundle.core import stderr_progress, take_bundle

    options = _options(out, since, recorder, deadline, no_tar, pid, cgroup, unit, include, gpu)
    try:
        result = take_bundle(options, None if quiet else stderr_progress)
    except OSError as exc:
        typer.secho(f"diag: cannot write the bundle under {out}: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None
    typer.echo(f"Verdict: {result.verdict} — {result.headline}")
    timeouts = [r.name for r in result.runs if r.timeout_hit]
    if timeouts:
        typer.echo(f"Timed out (data missing or partial): {', '.join(timeouts)}")
    for run in result.runs:
        if not run.timeout_hit and run.status in ("skipped", "error"):
            typer.echo(f"Missing: {run.name}: {run.reason or run.status}")
        elif not run.timeout_hit and run.reason:
            typer.echo(f"Partial: {run.name}: {run.reason}")
    typer.echo(f"Bundle: {result.root}")
    if result.archive is not None:
        typer.echo(f"Archive: {result.archive}")
    _exit_now_if_standalone()


def _options(
    out: Path, since: str, recorder: Path | None, deadline: str, no_tar: bool, pid: list[int] | None,
    cgroup: list[str] | None, unit: str | None, include: list[Path] | None, gpu: bool,
) -> BundleOptions:  # fmt: skip
    """Every option checked before anything is collected; the --out folder is created when missing."""
    from diag.bundle.options import BundleOptions
    from diag.cli import options as opts

    try:
        since_s = opts.duration("--since", since, high=400 * 86400, examples=("30m", "2h", "1d"))
        deadline_s = opts.duration("--deadline", deadline, low=2.0, high=3600, examples=("15s", "30s", "2m"))
        pids = opts.pids(pid)
        cgroups = opts.cgroups(cgroup)
        opts.unit_name(unit)
        for path in include or ():
            opts.existing_file("--include", path)
        if recorder is not None and recorder.is_dir():
            raise opts.OptionError(f"--recorder {recorder}: is a folder; give the recorder file")
        opts.out_dir("--out", out)
    except opts.OptionError as exc:
        typer.secho(f"diag: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from None
    return BundleOptions(
        out_dir=out, since_s=since_s, recorder=recorder, deadline_s=deadline_s, tar=not no_tar, pids=pids,
        cgroups=cgroups, unit=unit, includes=tuple(str(p) for p in include or ()), gpu=gpu, argv=tuple(sys.argv),
    )  # fmt: skip


def _exit_now_if_standalone() -> None:
    """Skip the interpreter's teardown when this is the ``diag`` program itself.

    Why: with numpy and matplotlib loaded, tearing the interpreter down takes ~0.4 s after
    the bundle is complete -- time an on-call engineer waits for nothing. Everything the bundle wrote
    is closed; stdout and stderr are flushed here. Only when the program is ``diag`` (the console
    script): a test runner or a Python caller keeps its normal exit.
    """
    if os.path.basename(sys.argv[0] or "") != "diag":
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(0)


def register(app: typer.Typer) -> None:
    """Add ``bundle`` to the ``diag`` app."""
    app.command("bundle")(bundle)


if __name__ == "__main__":  # pragma: no cover - ``python -m diag.cli.bundle`` works without diag/cli/main.py
    standalone = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    standalone.command()(bundle)
    standalone()
