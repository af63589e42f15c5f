"""The ``diag`` command line.

Each command is a thin shell over a library call, so everything it does can also be done from
Python. Bad input gets one clear line on stderr and exit code 2 (typer's convention for usage
errors), never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from collectors.processes import DEFAULT_MODEL_EXTENSIONS
from collectors.recorder import ENV_RECORDER, default_recorder_path
from collectors.snapshot import SamplerConfig
from diag.cli import options as opts
from diag.cli.errors import OneLineUsageErrors
from diag.live_diagnosis import DiagnoseEvery, start_live_diagnosis
from diag.units import format_bytes, format_duration, parse_duration

if TYPE_CHECKING:
    from collectors.agent import ListenAddress

DEFAULT_LISTEN = "127.0.0.1:9464"

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
    cls=OneLineUsageErrors,
)

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


def _fail(message: str) -> NoReturn:
    typer.secho(f"diag: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def _config(
    proc_root: Path, sys_root: Path, pids: list[int] | None, cgroups: list[str] | None, top: int,
    model_ext: list[str] | None, *, kmsg: bool, gpu: bool,
) -> SamplerConfig:  # fmt: skip
    """Every sampling option checked (exit 2 with the accepted forms) before a sampler is built."""
    if not (proc_root / "meminfo").exists() and not (proc_root / "pressure").exists():
        _fail(f"--proc-root {proc_root}: no meminfo or pressure/ there; is this a /proc tree?")
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
        _fail(str(exc))
    return config


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

    Fields that could not be read are shown as missing with the reason, never as zero. A --pid that does
    not exist or a --cgroup that is not found is said so on stderr (with the hierarchies searched).

    Exit status: 0 the snapshot was taken; 1 targets were given with --pid/--cgroup and none of them
    exists (the snapshot is still printed); 2 an option is invalid.

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


INTERVAL_EXAMPLES = ("500ms", "1s", "5s")
RETENTION_EXAMPLES = ("30m", "2h", "1d")
MAX_SIZE_EXAMPLES = ("64MiB", "256MiB", "1GiB")
SINCE_EXAMPLES = ("30m", "2h", "1d")
LISTEN_EXAMPLES = ("127.0.0.1:9464", "127.0.0.1:0", "off")


def _listen_address(text: str, parse: type[ListenAddress]) -> ListenAddress:
    """``--listen``'s HOST:PORT, with the reason and accepted forms in one line when it is not one."""
    try:
        return parse.parse(text)
    except ValueError as exc:
        reason = str(exc).replace(f"listen address {text!r}", "").lstrip(": ").split(", e.g.")[0] or "not HOST:PORT"
        raise opts.OptionError(
            f"--listen {text!r}: {reason}; use e.g. {opts.listing(LISTEN_EXAMPLES)} (port 0: any free port)"
        ) from None


@dataclass(frozen=True)
class _CollectPlan:
    """``diag collect``'s options, all checked: what the agent will do, decided before it does anything."""

    interval_s: float
    once: bool
    address: ListenAddress | None
    recorder: Path
    retention_s: float
    max_size_bytes: int
    retention_text: str
    max_size_text: str


def _collect_plan(
    interval: str | None, listen: str | None, once: bool, recorder: Path | None, retention: str | None,
    max_size: str | None, samples: int | None, kmsg: bool | None, diagnose_every: float | None = None,
) -> _CollectPlan:  # fmt: skip
    """Validate every collect option (values first, then combinations); exit 2 naming the accepted forms."""
    from collectors.agent import ListenAddress

    try:
        interval_s = opts.duration("--interval", interval or "1s", low=0.01, high=3600, examples=INTERVAL_EXAMPLES)
        # Suggested retentions keep at least two samples of the interval asked for (checked below).
        kept = [e for e in RETENTION_EXAMPLES if parse_duration(e) >= 2 * interval_s] or [format_duration(2 * interval_s)]
        retention_s = opts.duration("--retention", retention or "2h", low=1, high=400 * 86400, examples=kept)
        max_size_bytes = opts.size("--max-size", max_size or "256MiB", low=64 * 1024, examples=MAX_SIZE_EXAMPLES)
        if samples is not None and samples < 1:
            raise opts.OptionError(f"--samples {samples}: at least 1 (leave it out to run until SIGTERM)")
        if retention_s < 2 * interval_s:
            raise opts.OptionError(f"--retention {retention or '2h'} keeps less than two samples of --interval "
                                   f"{interval or '1s'}; use e.g. {opts.listing(kept)}")  # fmt: skip
        address = None
        if listen is not None and listen.lower() != "off":
            address = _listen_address(listen, ListenAddress)
        elif listen is None and not once:
            address = ListenAddress.parse(DEFAULT_LISTEN)
        path = opts.writable_file_path("--recorder", recorder) if recorder is not None else default_recorder_path()
        if once:
            opts.refuse(
                {"--interval": interval is not None, "--listen": listen is not None, "--recorder": recorder is not None,
                 "--retention": retention is not None,
                 "--max-size": max_size is not None, "--samples": samples is not None, "--kmsg": kmsg is True,
                 "--diagnose-every": diagnose_every is not None},
                "with --once (it prints one exposition and records nothing)",
            )  # fmt: skip
    except opts.OptionError as exc:
        _fail(str(exc))
    return _CollectPlan(interval_s, once, address, path, retention_s, max_size_bytes, retention or "2h",
                        max_size or "256MiB")  # fmt: skip


@app.command()
def collect(
    interval: Annotated[str | None, typer.Option(help="Sampling interval, e.g. 1s, 500ms, 5s (10ms to 1h). Default: 1s.")] = None,
    listen: Annotated[
        str | None,
        typer.Option(
            help=f"Serve Prometheus /metrics here (HOST:PORT; port 0: a free one). 'off' disables. Default: {DEFAULT_LISTEN}."
        ),
    ] = None,
    once: Annotated[bool, typer.Option("--once", help="Print one exposition to stdout and exit (records nothing).")] = False,
    recorder: Annotated[
        Path | None,
        typer.Option(
            readable=False, help=f"Flight recorder file (SQLite). Default: ${ENV_RECORDER} or the user state directory."
        ),
    ] = None,
    retention: Annotated[str | None, typer.Option(help="Keep this much history, e.g. 2h, 30m, 1d. Default: 2h.")] = None,
    max_size: Annotated[
        str | None, typer.Option("--max-size", help="Cap on the recorder's size on disk, e.g. 256MiB (at least 64KiB).")
    ] = None,
    samples: Annotated[
        int | None, typer.Option(help="Stop after this many samples, at least 1 (default: run until SIGTERM).")
    ] = None,
    proc_root: ProcRoot = Path("/proc"),
    sys_root: SysRoot = Path("/sys"),
    pid: Pids = None,
    cgroup: Cgroups = None,
    top: TopN = 10,
    model_ext: ModelExt = None,
    kmsg: Annotated[
        bool | None, typer.Option("--kmsg/--no-kmsg", help="Watch /dev/kmsg for kernel OOM kills (root). Default: on.")
    ] = None,
    gpu: Annotated[bool, typer.Option("--gpu/--no-gpu", help="Query NVML.")] = True,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each sample to stderr.")] = False,
    diagnose_every: DiagnoseEvery = None,
) -> None:
    """Run the host agent: sample every INTERVAL, write the flight recorder, serve /metrics.

    The recorder keeps RETENTION of history within MAX_SIZE (oldest trimmed first) and survives kill -9.
    On a full disk it drops its oldest rows to make room and keeps sampling; a recorder file that is not
    a database (or is deleted or replaced while running) is moved aside as <name>.corrupt-<UTC time> and
    a fresh one started. A --pid or --cgroup that does not exist yet is warned about and looked for again
    every sample. Stop it with SIGTERM or Ctrl-C; the current sample is finished and the recorder closed.

    Exit status: 0 stopped (signal or --samples); 2 an option is invalid or cannot apply (e.g. --retention
    with --once), the address cannot be bound, or no recorder can be created at the path.

    Examples:\n
      diag collect                                   # 1 Hz, http://127.0.0.1:9464/metrics\n
      diag collect --once --proc-root /host/proc     # one exposition, e.g. from a container\n
      diag collect --pid 4242 --retention 6h --max-size 1GiB
    """
    every_s: float | None = diagnose_every  # type: ignore[assignment]  # the option's callback made it seconds
    plan = _collect_plan(interval, listen, once, recorder, retention, max_size, samples, kmsg, every_s)
    config = _config(proc_root, sys_root, pid, cgroup, top, model_ext, kmsg=kmsg is not False and not once, gpu=gpu)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    if plan.once:
        _collect_once(config)
    else:
        _run_agent(plan, config, samples, verbose, every_s)


def _collect_once(config: SamplerConfig) -> None:
    from collectors.exporter import exposition
    from collectors.snapshot import SnapshotTaker

    taker = SnapshotTaker(config)
    try:
        snap = taker.take()
        sys.stdout.write(exposition(snap).decode())
    finally:
        taker.close()
    if snap.scope is not None:
        for line in snap.scope.missing:
            typer.secho(f"diag collect: not found: {line}", err=True, fg=typer.colors.YELLOW)


def _run_agent(
    plan: _CollectPlan, config: SamplerConfig, samples: int | None, verbose: bool, diagnose_every_s: float | None
) -> None:
    from collectors.agent import Agent
    from collectors.recorder import open_for_writing
    from collectors.snapshot import SnapshotTaker

    try:
        flight, moved_aside = open_for_writing(plan.recorder, plan.retention_s, plan.max_size_bytes)
    except (OSError, ValueError, sqlite3.Error) as exc:
        _fail(f"cannot open or create the flight recorder {plan.recorder}: {exc}")
    taker = SnapshotTaker(config)

    def progress(snap: object) -> None:
        if verbose:
            logging.info("sample %d written (%s)", agent.samples, format_bytes(flight.size_bytes()))

    agent = Agent(taker, interval_s=plan.interval_s, recorder=flight, on_sample=progress)
    if moved_aside is not None:
        agent.count_reset("corrupt")
        typer.echo(f"diag collect: {plan.recorder} was not a readable database: moved it to {moved_aside} "
                   "(kept) and started a fresh recorder", err=True)  # fmt: skip
    agent.install_signal_handlers()
    start_live_diagnosis(agent, plan.recorder, diagnose_every_s)
    if plan.address is not None:
        try:
            agent.serve(plan.address)
        except OSError as exc:
            agent.close()
            _fail(f"cannot listen on {plan.address.host}:{plan.address.port}: {exc}")
    where = f"http://{plan.address.host}:{agent.bound_port}/metrics" if plan.address else "no /metrics"
    typer.echo(
        f"diag collect: sampling every {plan.interval_s:g}s, recorder {plan.recorder} (keep {plan.retention_text}, "
        f"max {plan.max_size_text}), {where}; pid {os.getpid()}",
        err=True,
    )
    try:
        agent.run(max_samples=samples)
    finally:
        agent.close()
    typer.echo(f"diag collect: stopped after {agent.samples} samples", err=True)


def _analysis_source(
    recorder: Path | None, bundle: Path | None, prometheus: str | None, selector: str | None, since: str | None
) -> tuple[str, float]:
    """Which source to read (checked: exactly one, each with only the options that apply to it) and the window."""
    try:
        given = {"--recorder": recorder is not None, "--bundle": bundle is not None, "--prometheus": prometheus is not None}
        if sum(given.values()) > 1:
            got = ", ".join(k for k, v in given.items() if v)
            raise opts.OptionError(f"give one of --recorder, --bundle, --prometheus (got {got})")
        since_s = opts.duration("--since", since or "1h", high=400 * 86400, examples=SINCE_EXAMPLES)
        if prometheus is None:
            opts.refuse({"--selector": selector is not None}, "without --prometheus (it selects series in Prometheus)")
        if bundle is not None:
            opts.refuse({"--since": since is not None}, "with --bundle (a bundle holds the window it was taken with)")
            opts.bundle_path("--bundle", bundle)
            return "bundle", since_s
        if prometheus is not None:
            opts.http_url("--prometheus", prometheus)
            return "prometheus", since_s
        if recorder is not None:
            opts.existing_file("--recorder", recorder)
    except opts.OptionError as exc:
        _fail(str(exc))
    return "recorder", since_s


@app.command()
def analyze(
    recorder: Annotated[Path | None, typer.Option(readable=False, help="Flight recorder to read (default: the agent's).")] = None,
    bundle: Annotated[
        Path | None,
        typer.Option(readable=False, help="Analyse an incident bundle instead: its folder or its .tar.gz (read in place)."),
    ] = None,
    prometheus: Annotated[str | None, typer.Option(help="Prometheus base URL: the fleet-scale path (query_range).")] = None,
    selector: Annotated[
        str | None,
        typer.Option(help='With --prometheus: label matchers for the service, e.g. \'job="llm",instance="10.0.0.5:9464"\'.'),
    ] = None,
    since: Annotated[str | None, typer.Option(help="How far back to look, e.g. 30m, 2h (default 1h; not with --bundle).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The documented JSON document instead of text.")] = False,
) -> None:
    """Classify what the records show: the verdict first, findings with evidence, and what could not be evaluated.

    Verdict: an incident class when a finding reaches confidence 0.5
    (other findings at 0.5 or more are "contributing").
    "inconclusive" when findings reach only 0.3 (the "suspects", with their
    confidence) or a rule had too little data to judge ("too_little_data":
    what it had and what it needs). "healthy" only when no rule found anything
    at 0.3 or more and none lacked data. Rules whose signals are absent are
    listed as not evaluated, with where the signal would come from.

    The service is what `diag collect --pid/--cgroup` named, else the
    processes writing service records, else model-file holders inside the
    watched groups; a neighbour is never taken for the service.

    JSON: {"verdict": {"primary", "contributing", "suspects", "too_little_data",
    "meaning"}, "findings": [{"class", "rule", "confidence", "summary",
    "evidence", "rules_out", "remediation", "start", "end"}],
    "not_evaluated": [{"rule", "class", "missing", "why"}]}

    Exit status: 0 analysed; 2 an option is invalid or cannot apply, or the source cannot be read (no
    recorder, a recorder file that is not a database, a folder that is not a bundle, Prometheus unreachable).

    Examples:\n
      diag analyze --since 30m\n
      diag analyze --bundle ./llm-diag-bundle-20261130T1200Z --json\n
      diag analyze --prometheus http://127.0.0.1:9090 --selector 'job="llm-api"'
    """
    from diag.rules.engine import analyze as run_rules

    kind, since_s = _analysis_source(recorder, bundle, prometheus, selector, since)
    timeline = _load_timeline(kind, recorder, bundle, prometheus, selector or "", since_s)
    result = run_rules(timeline)
    if as_json:
        json.dump(result.to_dict(), sys.stdout, indent=2, allow_nan=False, default=str)
        sys.stdout.write("\n")
    else:
        from diag.views.analysis import render_analysis

        render_analysis(result)


def _load_timeline(kind: str, recorder: Path | None, bundle: Path | None, prometheus: str | None, selector: str,
                   since_s: float):  # type: ignore[no-untyped-def]  # fmt: skip
    from collectors.recorder import RecorderCorrupt
    from diag.sources import load_bundle, load_prometheus, load_recorder

    path = recorder or default_recorder_path()
    try:
        if kind == "bundle":
            assert bundle is not None
            return load_bundle(bundle)
        if kind == "prometheus":
            assert prometheus is not None
            return load_prometheus(prometheus, selector=selector, since_s=since_s)
        if not path.exists():
            _fail(f"no flight recorder at {path}; run `diag collect` first, or pass --recorder/--bundle/--prometheus")
        return load_recorder(path, since_s=since_s)
    except (RecorderCorrupt, sqlite3.DatabaseError) as exc:
        _fail(f"{exc if isinstance(exc, RecorderCorrupt) else f'{path} is not a readable flight recorder ({exc})'}. "
              "Move it aside (a running `diag collect` does so itself on its next start) and analyse a bundle "
              "or Prometheus instead, or pass --recorder with another file")  # fmt: skip
    except (OSError, ValueError) as exc:
        _fail(str(exc))


def _register_subcommands() -> None:
    from diag.cli.alerts import register as register_alerts
    from diag.cli.bundle import register as register_bundle
    from diag.cli.dashboards import register as register_dashboards
    from diag.cli.demo import register as register_demo
    from diag.cli.triage import register as register_triage

    register_alerts(app)
    register_bundle(app)
    register_demo(app)
    register_dashboards(app)
    register_triage(app)


_register_subcommands()


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
