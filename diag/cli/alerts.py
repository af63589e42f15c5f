"""``diag alerts``: generate SLO and cause alerts from a spec, check them, run their promtool tests.

Glue only: the generator lives in ``alerts/`` (which reads only the rules' levels from ``diag``); this module
hands it the rules engine's incident classes, reads a live /metrics when asked, and runs promtool.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from alerts.generate import Generated

app = typer.Typer(
    name="alerts",
    help=(
        "Generate Prometheus SLO burn-rate alerts, cause alerts and an Alertmanager routing snippet from an SLO spec.\n\n"
        "Examples:\n\n"
        "  diag alerts                               # regenerate alerts/generated/ from alerts/slo.yaml\n\n"
        "  diag alerts --check                       # exit 1 when alerts/generated/ is stale (CI)\n\n"
        "  diag alerts --slo my-slo.yaml --out /etc/prometheus/llm-diag\n\n"
        "  diag alerts --slo alerts/slo-vllm.yaml --metrics-url http://127.0.0.1:8000/metrics --out ./vllm-alerts\n\n"
        "  diag alerts test                          # run the generated promtool unit tests"
    ),
    invoke_without_command=True,
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(message: str) -> None:
    typer.secho(f"diag alerts: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def _live_buckets(url: str) -> dict[str, tuple[float, ...]]:
    from alerts.spec import live_histogram_buckets

    if not url.startswith(("http://", "https://")):
        _fail(f"--metrics-url {url!r}: give an http(s) URL of a /metrics endpoint")
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        _fail(f"--metrics-url {url}: cannot read it: {getattr(exc, 'reason', exc)}")
    try:
        return live_histogram_buckets(text)
    except ValueError as exc:
        _fail(f"--metrics-url {url}: not a Prometheus text exposition: {exc}")
    raise AssertionError  # unreachable


def generate_files(slo: Path | None, metrics_url: str | None = None) -> Generated:
    """Load and validate the spec, then render every file (raises SpecError / UnknownIncidentClass)."""
    from alerts.generate import render
    from alerts.spec import DEFAULT_SPEC_PATH, SpecError, load_spec, parse_spec, read_spec_document
    from diag.rules.classes import INCIDENT_CLASSES

    path = slo or DEFAULT_SPEC_PATH
    if metrics_url is None:
        spec = load_spec(path)
    else:
        load_spec(path)  # file, YAML and catalog errors first, with their own messages
        try:
            spec = parse_spec(read_spec_document(path), _live_buckets(metrics_url))
        except SpecError as exc:
            raise SpecError(f"{path}: {exc}") from None
    source = "alerts/slo.yaml" if slo is None else path.name
    return render(spec, INCIDENT_CLASSES, source)


@app.callback()
def alerts(
    ctx: typer.Context,
    slo: Annotated[Path | None, typer.Option("--slo", help="SLO spec (YAML). Default: the shipped alerts/slo.yaml.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the files here. Default: alerts/generated/.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Write nothing; exit 1 when the files in --out are stale.")] = False,
    metrics_url: Annotated[
        str | None, typer.Option("--metrics-url", help="Also check latency thresholds against this live /metrics.")
    ] = None,
) -> None:
    """Generate the rule files (see the examples above)."""
    if ctx.invoked_subcommand is not None:
        if slo or out or check or metrics_url:
            _fail("--slo/--out/--check/--metrics-url go without a subcommand (`diag alerts test --dir DIR`)")
        return
    from alerts.cause_rules import UnknownIncidentClass
    from alerts.generate import DEFAULT_OUT, stale, write
    from alerts.links import BrokenLink
    from alerts.spec import SpecError

    if slo is not None and not slo.is_file():
        _fail(f"--slo {slo}: no such file")
    target = out or DEFAULT_OUT
    if target.exists() and not target.is_dir():
        _fail(f"--out {target}: exists and is not a directory")
    try:
        generated = generate_files(slo, metrics_url)
    except (SpecError, UnknownIncidentClass, BrokenLink) as exc:
        _fail(str(exc))
        return
    for warning in generated.warnings:
        typer.secho(f"diag alerts: warning: {warning}", err=True, fg=typer.colors.YELLOW)
    if check:
        try:
            bad = stale(generated, target)
        except OSError as exc:
            _fail(f"--out {target}: cannot read: {exc.strerror or exc} ({exc.filename or target})")
        if bad:
            typer.secho(f"diag alerts: {target} is stale ({', '.join(bad)}); run `diag alerts` and commit", err=True,
                        fg=typer.colors.RED)  # fmt: skip
            raise typer.Exit(1)
        typer.echo(f"diag alerts: {target} is up to date ({len(generated.files)} files)", err=True)
        return
    try:
        write(generated, target)
    except OSError as exc:  # not writable, a file where a directory goes, disk full
        _fail(f"--out {target}: cannot write: {exc.strerror or exc} ({exc.filename or target})")
    typer.echo(f"diag alerts: wrote {len(generated.files)} files to {target}", err=True)


def run_promtool_tests(directory: Path) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` on every generated test file of a directory (raises FileNotFoundError without promtool)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise FileNotFoundError("promtool is not installed (Debian: apt-get install prometheus)")
    tests = sorted((directory / "tests").glob("*.test.yaml"))
    if not tests:
        raise FileNotFoundError(f"no generated tests in {directory / 'tests'}; run `diag alerts --out {directory}`")
    return subprocess.run([promtool, "test", "rules", *map(str, tests)], capture_output=True, text=True, check=False)


@app.command("test")
def test_cmd(
    directory: Annotated[Path | None, typer.Option("--dir", help="Generated directory. Default: alerts/generated/.")] = None,
) -> None:
    """Run the generated promtool unit tests (`promtool test rules`); exit 1 when one fails.

    Examples:\n
      diag alerts test\n
      diag alerts --out /tmp/a --slo my.yaml && diag alerts test --dir /tmp/a
    """
    from alerts.generate import DEFAULT_OUT

    target = directory or DEFAULT_OUT
    if not target.is_dir():
        _fail(f"--dir {target}: no such directory")
    try:
        result = run_promtool_tests(target)
    except FileNotFoundError as exc:
        _fail(str(exc))
        return
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    raise typer.Exit(0 if result.returncode == 0 else 1)


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="alerts")
