"""``diag gate``: the rollout check -- a stepped load from a spec, each step judged on latency, errors and the
host's memory, with the rules' diagnosis of every failure. Everything is checked before the first request."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from diag.cli import options as opts
from diag.cli.errors import fail
from diag.units import is_loopback

PROBE_S = 5.0


def _target(text: str, allow_remote: bool) -> str:
    """A base URL (the spec's endpoint is appended); loopback only unless ``--allow-remote``."""
    opts.http_url("--target", text)
    parts = urlsplit(text)
    if parts.query or parts.fragment:
        raise opts.OptionError(f"--target {text!r}: a base URL without ?query or #fragment; use e.g. http://127.0.0.1:8000")
    if not allow_remote and not is_loopback(parts.hostname or ""):
        raise opts.OptionError(
            f"--target {text!r}: not a loopback address; a gate sends real load, so another host needs --allow-remote"
        )
    return text.rstrip("/")


def _probe(target: str) -> tuple[bool, str]:
    """Whether something answers HTTP at the target (any status; nothing at all: exit 2), and whether it serves
    Prometheus text at /metrics -- with, when it does not, what the gate says instead of the engine's counters.

    Why a note and not a failure: many engines (llama-cpp-python's server among them) expose no /metrics; the gate
    still judges every step on the client's figures and the host's samples, and the reader learns that the
    diagnosis had no engine-side counters (queue depth, KV cache) to go on."""
    import httpx

    try:
        with httpx.Client(timeout=PROBE_S, trust_env=False) as client:
            client.get(target + "/")
            try:
                resp = client.get(target + "/metrics")
            except httpx.HTTPError as exc:
                return False, f"GET /metrics failed ({type(exc).__name__})"
            head = resp.text[:4096] if resp.status_code == 200 else ""
            if "# TYPE " in head or "# HELP " in head:
                return True, ""
            got = f"HTTP {resp.status_code}" if resp.status_code != 200 else "HTTP 200 without Prometheus text"
            return False, f"GET /metrics: {got}"
    except httpx.HTTPError as exc:
        fail(f"--target {target}: nothing answers there ({type(exc).__name__}: {exc}); start the server first")


def _metrics_note(serves: bool, why: str, scrape: bool) -> str:
    if serves and scrape:
        return ""
    if serves:
        return "the target's /metrics were not scraped (--no-scrape): the diagnosis has no engine-side counters"
    return (f"the target serves no Prometheus metrics ({why}): the engine's own counters (queue, KV cache, tokens) "
            "are not in the diagnosis; each step is judged on the client's figures and the host's samples")  # fmt: skip


def gate(
    spec: Annotated[Path, typer.Option(readable=False, help="The gate's spec (YAML): steps and their criteria.")],
    target: Annotated[str, typer.Option(help="Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000.")],
    pid: Annotated[
        list[int] | None, typer.Option("--pid", help="The service's process (repeatable): its OOM kills and memory.")
    ] = None,
    cgroup: Annotated[
        list[str] | None, typer.Option("--cgroup", help="The service's cgroup (repeatable), e.g. /system.slice/vllm.service.")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the result as JSON to this file.")] = None,
    recorder: Annotated[
        Path | None,
        typer.Option(
            help="Flight recorder the gate's agent writes (kept; an instrumented service may write it too). "
            "Default: a temporary one, removed at the end."
        ),
    ] = None,
    scrape: Annotated[
        bool, typer.Option(help="Scrape the target's /metrics during the run when it serves Prometheus text.")
    ] = True,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="Allow a target that is not a loopback address.")] = False,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Also write the result as one self-contained HTML page: the table, each step's "
            "diagnosis, charts of load, latency, memory PSI and the target's memory with the step boundaries.",
        ),
    ] = None,
    bundle_dir: Annotated[
        Path | None,
        typer.Option(
            "--bundle-dir",
            help="Where the bundle of the first failed step goes (made if missing). "
            "Default: the --json file's folder, else the current directory.",
        ),
    ] = None,
    no_bundle: Annotated[bool, typer.Option("--no-bundle", help="Take no bundle when a step fails.")] = False,
    unit: Annotated[
        str | None,
        typer.Option(
            "--unit",
            help="The service's systemd unit (instead of --pid/--cgroup): its cgroup and MainPID from "
            "`systemctl show`, its Memory* settings in the infrastructure gate.",
        ),
    ] = None,
) -> None:
    """Run the spec's load steps against the target and judge each step; PASS only if every criterion holds.

    Each step sends its load (open loop: Poisson arrivals at `rate`, latency counted from the scheduled
    time; closed loop: `concurrency` clients), while the host agent samples memory, PSI, OOM kills and
    the backend's /metrics; then the step's criteria are judged and the rules engine diagnoses the step's
    window, so a FAIL names the criterion and why (e.g. queue_backlog). A target that serves no Prometheus
    /metrics (llama-cpp-python's server) is a note, not a failure; a failed step the host's side explains
    nothing of is then diagnosed from the client's figures. A progress line per step, then a table of steps x
    criteria. Ctrl-C stops the load and still reports the steps that ran.

    At the first failed step the gate takes an incident bundle of the run so far (`diag bundle` over the
    gate's flight recorder, the --pid/--cgroup targets watched) before the next step, and names it in the
    output and the JSON (`"bundle"`); a bundle that cannot be written is a note, never a change of the exit
    status. --no-bundle takes none.

    Before the steps, two gates. The infrastructure gate reads the host and the target's cgroup (cgroup
    version and memory controller, memory accounting, PSI, swap policy, effective memory.max/high/low/min,
    with --unit the unit's settings, systemd-oomd): each check PASS, WARN, NOT AVAILABLE, or FAIL where the
    spec's `infrastructure:` section requires it. The application gate (the spec's `application:`) polls
    readiness, then sends one short request, one long prefill and N simultaneous requests; a failed
    readiness stops the run before the load. `graceful_termination` (needs one --pid or --unit) runs last:
    SIGTERM with requests in flight, which must complete, and the process must exit in time.

    With a `neighbour:` section, a bounded memory hog runs in a sibling of the service's memory cgroup during
    the step it names, and the gate judges whether the service's protection held; where that cannot run (no
    root, no --pid/--cgroup, no memory hierarchy) it is NOT RUN with the reason, and the gate does not pass.

    Exit status: 0 both gates and every criterion of every step passed; 1 a check or criterion failed, the
    run was interrupted or the neighbour check was not run; 2 bad input (an option, the spec, a unit
    systemctl cannot show, a target that does not answer).

    Example:\n
      diag gate --spec docs/gate-example.yaml --target http://127.0.0.1:8000 --cgroup /system.slice/llm.service
    """
    from diag.gate.spec import SpecError, load_spec

    try:
        opts.existing_file("--spec", spec)
        base = _target(target, allow_remote)
        if unit is not None and (pid or cgroup):
            raise opts.OptionError("--unit: give the unit, or --pid/--cgroup, not both (the unit names its cgroup and MainPID)")
        pids = opts.pids(pid)
        for p in pids:
            if not Path(f"/proc/{p}").exists():
                raise opts.OptionError(f"--pid {p}: no such process")
        cgroups = opts.cgroups(cgroup)
        if json_out is not None:
            _writable("--json", opts.writable_file_path("--json", json_out, "gate.json").parent)
        if recorder is not None:
            opts.writable_file_path("--recorder", recorder)
        if html is not None:
            _writable("--html", opts.writable_file_path("--html", html, "gate.html").parent)
        bundles = None if no_bundle else _bundle_dir(bundle_dir, json_out)
    except opts.OptionError as exc:
        fail(str(exc))
    try:
        parsed = load_spec(spec)
    except SpecError as exc:
        fail(f"--spec {exc}" if str(exc).startswith(str(spec)) else f"--spec {spec}: {exc}")
    extra = _systemd(unit, parsed, pids)
    pids, cgroups = (*pids, *extra.pids), (*cgroups, *extra.cgroups)
    serves_metrics, why = _probe(base)
    note = _metrics_note(serves_metrics, why, scrape)
    _run(parsed, base, pids, cgroups, json_out, recorder, scrape and serves_metrics, html, bundles, extra, note)


@dataclass(frozen=True)
class _Systemd:
    """What --unit adds to the run: the unit's cgroup and main PID, the unit itself, oomd, the PID to terminate."""

    pids: tuple[int, ...] = ()
    cgroups: tuple[str, ...] = ()
    unit: object = None
    oomd: object = None
    terminate_pid: int | None = None


def _systemd(unit: str | None, parsed, pids: tuple[int, ...]) -> _Systemd:  # type: ignore[no-untyped-def]
    """Resolve --unit with systemctl (exit 2 when it is absent or fails), ask about systemd-oomd where systemd
    runs, and choose the one process graceful_termination may signal (refused here when there is none)."""
    from diag.gate.unit import OomdState, UnitError, oomd_state, show_unit

    info = None
    if unit is not None:
        try:
            info = show_unit(unit)
        except UnitError as exc:
            fail(str(exc))
    systemd_runs = info is not None or _pid1() == "systemd"
    oomd = oomd_state() if systemd_runs else OomdState(None, why=f"systemd is not PID 1 on this host ({_pid1() or '?'})")
    terminate = None
    app = parsed.application
    if app is not None and app.graceful_termination is not None:
        candidates = [info.main_pid] if info is not None and info.main_pid else list(pids)
        if len(candidates) != 1:
            why = "the unit has no MainPID" if info is not None else f"got {len(candidates)} --pid"
            fail(f"--spec application.graceful_termination: needs exactly one process to signal (--pid or --unit); {why}")
        terminate = candidates[0]
    if info is None:
        return _Systemd(oomd=oomd, terminate_pid=terminate)
    return _Systemd(tuple(p for p in [info.main_pid] if p), tuple(c for c in [info.cgroup] if c), info, oomd, terminate)


def _pid1() -> str:
    try:
        return Path("/proc/1/comm").read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _writable(option: str, folder: Path, default: str = "") -> None:
    """``folder``, or the nearest of its parents that exists, must let this user create files in it."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise opts.OptionError(f"{option} {folder}: not a folder{default}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise opts.OptionError(f"{option}: cannot write in {folder} (permission denied){default}")


def _bundle_dir(given: Path | None, json_out: Path | None) -> Path:
    """The folder for the first failed step's bundle: --bundle-dir, else beside --json, else the current one --
    checked now, so a failed step's bundle is not lost to a bad folder after minutes of load."""
    if given is not None:
        opts.folder_path("--bundle-dir", given)
        _writable("--bundle-dir", given)
        return given
    folder = json_out.parent if json_out is not None else Path.cwd()
    why = f" (the default folder for a failed step's bundle, {'beside --json' if json_out else 'the current one'}); " \
          "give --bundle-dir or --no-bundle"  # fmt: skip
    _writable("--bundle-dir", folder, why)
    return folder


def _run(parsed, base: str, pids: tuple[int, ...], cgroups: tuple[str, ...], json_out: Path | None,  # type: ignore[no-untyped-def]
         recorder: Path | None, scrape: bool, html: Path | None, bundles: Path | None,
         systemd: _Systemd, metrics_note: str = "") -> None:  # fmt: skip
    from diag.gate.report import render
    from diag.gate.runner import RunOptions, run_gate

    def progress(line: str) -> None:
        typer.echo(line, err=True)

    with contextlib.ExitStack() as stack:
        if recorder is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="llmdiag-gate-"))
            recorder = Path(tmp) / "gate-recorder.db"
        run = RunOptions(
            base,
            recorder,
            pids,
            cgroups,
            (base + "/metrics",) if scrape else (),
            bundle_dir=bundles,
            unit=systemd.unit,
            oomd=systemd.oomd,
            terminate_pid=systemd.terminate_pid,
            notes=(metrics_note,) if metrics_note else (),
        )  # type: ignore[arg-type]
        progress(f"gate: {len(parsed.steps)} steps, {parsed.total_s:g} s of load against {base}{parsed.endpoint}")
        report = run_gate(parsed, run, progress)
        typer.echo(render(report))
        if json_out is not None:
            body = json.dumps(report.to_dict(), indent=2, allow_nan=False, default=str)
            try:
                json_out.parent.mkdir(parents=True, exist_ok=True)
                json_out.write_text(body + "\n", encoding="utf-8")
            except OSError as exc:
                typer.echo(f"diag: --json {json_out}: cannot write ({os.strerror(exc.errno or 0)})", err=True)
        if html is not None:
            _write_html(html, report, recorder, pids, cgroups)
    sys.stdout.flush()
    raise typer.Exit(report.exit_code)


def _write_html(path: Path, report, recorder: Path, pids: tuple[int, ...], cgroups: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    """The page, from the report and the recorder's samples over the run (read before a temporary one is removed)."""
    from diag.cli.gate_html import render_html, run_timeline

    tl, why = run_timeline(recorder, report)
    page = render_html(report, tl, pids=pids, cgroups=cgroups, notes=[why] if why else [])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        typer.echo(f"diag: --html {path}: cannot write ({os.strerror(exc.errno or 0)})", err=True)
        return
    typer.echo(f"html: {path}")


def register(app: typer.Typer) -> None:
    """Add ``gate`` to the ``diag`` app."""
    app.command("gate")(gate)
