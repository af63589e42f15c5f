"""The ``diag`` command line.

Each command is a thin shell over a library call, so everything it does can also be done from
Python. Bad input gets one clear line on stderr and exit code 2 (typer's convention for usage
errors), never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from collectors.processes import DEFAULT_MODEL_EXTENSIONS
from collectors.recorder import DEFAULT_MAX_SIZE_BYTES, DEFAULT_RETENTION_S, ENV_RECORDER, default_recorder_path
from collectors.snapshot import SamplerConfig
from diag.live_diagnosis import DiagnoseEvery, start_live_diagnosis
from diag.units import format_bytes, parse_duration, parse_size

app = typer.Typer(
    name="diag",
    help=(
        "llm-diag: find out why an LLM inference backend is slow, swapping or OOM-killed.\n\n"
        "Start with `diag snapshot` (what the host looks like now) and keep `diag collect` running as the host agent "
        "(a 1 Hz flight recorder plus a Prometheus /metrics endpoint)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ProcRoot = Annotated[
    Path, typer.Option("--proc-root", help="Read /proc from here (a container reading the host's /proc, or fixtures).")
]
SysRoot = Annotated[Path, typer.Option("--sys-root", help="Read /sys (cgroupfs) from here.")]
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


def _fail(message: str) -> None:
    typer.secho(f"diag: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def _config(
    proc_root: Path, sys_root: Path, pids: list[int] | None, cgroups: list[str] | None, top: int,
    model_ext: list[str] | None, *, kmsg: bool, gpu: bool,
) -> SamplerConfig:  # fmt: skip
    if not (proc_root / "meminfo").exists() and not (proc_root / "pressure").exists():
        _fail(f"--proc-root {proc_root}: no meminfo or pressure/ there; is this a /proc tree?")
    extensions = tuple(DEFAULT_MODEL_EXTENSIONS) + tuple(e if e.startswith(".") else f".{e}" for e in (model_ext or ()))
    return SamplerConfig(
        proc_root=str(proc_root),
        sys_root=str(sys_root),
        pids=tuple(pids or ()),
        cgroups=tuple(cgroups or ()),
        top_n=top,
        model_extensions=extensions,
        kmsg_path="/dev/kmsg" if kmsg else None,
        gpu=gpu,
    )


@app.command()
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

    Fields that could not be read are shown as missing with the reason, never as zero.

    Examples:\n
      diag snapshot\n
      diag snapshot --pid $(pgrep -f vllm | head -1) --json | jq .cgroups
    """
    from collectors.snapshot import SnapshotTaker

    taker = SnapshotTaker(_config(proc_root, sys_root, pid, cgroup, top, model_ext, kmsg=False, gpu=gpu))
    try:
        snap = taker.take()
    finally:
        taker.close()
    if as_json:
        from diag.snapshot_view import snapshot_document

        json.dump(snapshot_document(snap), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        from diag.snapshot_view import render_snapshot

        render_snapshot(snap)


@app.command()
def collect(
    interval: Annotated[str, typer.Option(help="Sampling interval, e.g. 1s, 500ms, 5s.")] = "1s",
    listen: Annotated[
        str, typer.Option(help="Serve Prometheus /metrics here (HOST:PORT; port 0 picks a free one). 'off' disables.")
    ] = "127.0.0.1:9464",
    once: Annotated[bool, typer.Option("--once", help="Print one exposition to stdout and exit (records nothing).")] = False,
    recorder: Annotated[
        Path | None,
        typer.Option(help=f"Flight recorder file (SQLite). Default: ${ENV_RECORDER} or the user state directory."),
    ] = None,
    retention: Annotated[str, typer.Option(help="Keep this much history, e.g. 2h, 30m, 1d.")] = "2h",
    max_size: Annotated[str, typer.Option("--max-size", help="Cap on the recorder's size on disk, e.g. 256MiB.")] = "256MiB",
    samples: Annotated[int | None, typer.Option(help="Stop after this many samples (default: run until SIGTERM).")] = None,
    proc_root: ProcRoot = Path("/proc"),
    sys_root: SysRoot = Path("/sys"),
    pid: Pids = None,
    cgroup: Cgroups = None,
    top: TopN = 10,
    model_ext: ModelExt = None,
    kmsg: Annotated[bool, typer.Option("--kmsg/--no-kmsg", help="Watch /dev/kmsg for kernel OOM kills (root).")] = True,
    gpu: Annotated[bool, typer.Option("--gpu/--no-gpu", help="Query NVML.")] = True,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each sample to stderr.")] = False,
    diagnose_every: DiagnoseEvery = None,
) -> None:
    """Run the host agent: sample every INTERVAL, write the flight recorder, serve /metrics.

    The recorder keeps RETENTION of history within MAX_SIZE (oldest trimmed first) and survives kill -9.
    Stop it with SIGTERM or Ctrl-C; the current sample is finished and the recorder closed cleanly.

    Examples:\n
      diag collect                                   # 1 Hz, http://127.0.0.1:9464/metrics\n
      diag collect --once --proc-root /host/proc     # one exposition, e.g. from a container\n
      diag collect --pid 4242 --retention 6h --max-size 1GiB
    """
    from collectors.agent import Agent, ListenAddress
    from collectors.exporter import exposition
    from collectors.recorder import FlightRecorder
    from collectors.snapshot import SnapshotTaker

    try:
        interval_s = parse_duration(interval)
        retention_s = parse_duration(retention) if not once else DEFAULT_RETENTION_S
        max_size_bytes = parse_size(max_size) if not once else DEFAULT_MAX_SIZE_BYTES
        address = None if once or listen.lower() == "off" else ListenAddress.parse(listen)
    except ValueError as exc:
        _fail(str(exc))
        return
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    config = _config(proc_root, sys_root, pid, cgroup, top, model_ext, kmsg=kmsg and not once, gpu=gpu)
    taker = SnapshotTaker(config)
    if once:
        try:
            sys.stdout.write(exposition(taker.take()).decode())
        finally:
            taker.close()
        return

    path = recorder or default_recorder_path()
    try:
        flight = FlightRecorder(path, retention_s=retention_s, max_size_bytes=max_size_bytes)
    except (OSError, ValueError) as exc:
        taker.close()
        _fail(f"cannot open the flight recorder {path}: {exc}")
        return

    def progress(snap: object) -> None:
        if verbose:
            logging.info("sample %d written (%s)", agent.samples, format_bytes(flight.size_bytes()))

    agent = Agent(taker, interval_s=interval_s, recorder=flight, on_sample=progress)
    agent.install_signal_handlers()
    start_live_diagnosis(agent, path, diagnose_every)  # type: ignore[arg-type]  # the callback made it seconds
    if address is not None:
        try:
            agent.serve(address)
        except OSError as exc:
            agent.close()
            _fail(f"cannot listen on {listen}: {exc}")
            return
    where = f"http://{address.host}:{agent.bound_port}/metrics" if address else "no /metrics"
    typer.echo(
        f"diag collect: sampling every {interval_s:g}s, recorder {path} (keep {retention}, max {max_size}), {where}; "
        f"pid {os.getpid()}",
        err=True,
    )
    try:
        agent.run(max_samples=samples)
    finally:
        agent.close()
    typer.echo(f"diag collect: stopped after {agent.samples} samples", err=True)


@app.command()
def analyze(
    recorder: Annotated[Path | None, typer.Option(help="Flight recorder to read (default: the agent's).")] = None,
    bundle: Annotated[Path | None, typer.Option(help="Analyse an incident bundle directory instead.")] = None,
    prometheus: Annotated[str | None, typer.Option(help="Prometheus base URL: the fleet-scale path (query_range).")] = None,
    selector: Annotated[
        str, typer.Option(help='With --prometheus: label matchers for the service, e.g. \'job="llm",instance="10.0.0.5:9464"\'.')
    ] = "",
    since: Annotated[str, typer.Option(help="How far back to look, e.g. 30m, 2h.")] = "1h",
    as_json: Annotated[bool, typer.Option("--json", help="The documented JSON document instead of text.")] = False,
) -> None:
    """Classify what the records show: the verdict first, findings with evidence, and what could not be evaluated.

    JSON shape: {"verdict": {"primary", "contributing"}, "findings": [{"class", "rule", "confidence", "summary",
    "evidence", "rules_out", "remediation", "start", "end"}], "not_evaluated": [{"rule", "class", "missing"}]}

    Examples:\n
      diag analyze --since 30m\n
      diag analyze --bundle ./llm-diag-bundle-20261130T1200Z --json\n
      diag analyze --prometheus http://127.0.0.1:9090 --selector 'job="llm-api"'
    """
    from diag.loaders import load_bundle, load_recorder
    from diag.rules.engine import analyze as run_rules

    sources = [s for s in (recorder, bundle, prometheus) if s is not None]
    if len(sources) > 1:
        _fail("give one of --recorder, --bundle, --prometheus")
    try:
        since_s = parse_duration(since)
    except ValueError as exc:
        _fail(str(exc))
        return
    try:
        if bundle is not None:
            timeline = load_bundle(bundle)
        elif prometheus is not None:
            from diag.prometheus_loader import load_prometheus

            timeline = load_prometheus(prometheus, selector=selector, since_s=since_s)
        else:
            path = recorder or default_recorder_path()
            if not path.exists():
                _fail(f"no flight recorder at {path}; run `diag collect` first, or pass --recorder/--bundle/--prometheus")
            timeline = load_recorder(path, since_s=since_s)
    except (OSError, ValueError) as exc:
        _fail(str(exc))
        return
    result = run_rules(timeline)
    if as_json:
        json.dump(result.to_dict(), sys.stdout, indent=2, allow_nan=False, default=str)
        sys.stdout.write("\n")
    else:
        from diag.analysis_view import render_analysis

        render_analysis(result)


def _register_subcommands() -> None:
    from diag.alerts_cli import register as register_alerts
    from diag.bundle.cli import register as register_bundle
    from diag.demo.cli import register as register_demo

    register_alerts(app)
    register_bundle(app)
    register_demo(app)


_register_subcommands()


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
