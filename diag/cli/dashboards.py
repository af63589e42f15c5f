"""``diag dashboards``: generate, check and preview the Grafana dashboards.

A thin shell over ``dashboards.generate`` (files), ``dashboards.lint`` (the ported linter rules)
and ``diag.views.dashboards_preview`` (a page drawn from a real Prometheus).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dashboards.paths import GRAFANA_DASHBOARDS_DIR, PROVISIONING_FILE

HELP = f"""Write the Grafana dashboards (JSON + a provisioning file), check them, or preview them.

Grafana reads them from {GRAFANA_DASHBOARDS_DIR} (the path the generated {PROVISIONING_FILE} names): \
write them there with --out, and put {PROVISIONING_FILE} in Grafana's provisioning/dashboards/ directory.

Examples:

  diag dashboards                      # regenerate dashboards/generated/

  diag dashboards --check              # exit 1 when the committed JSON is stale or breaks a lint rule

  diag dashboards --out {GRAFANA_DASHBOARDS_DIR}

  diag dashboards preview --prometheus http://127.0.0.1:9090 --since 1h --out preview.html
"""

dashboards_app = typer.Typer(help=HELP, add_completion=False, pretty_exceptions_enable=False)


def _fail(message: str) -> None:
    typer.secho(f"diag dashboards: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


@dashboards_app.callback(invoke_without_command=True)
def generate(
    ctx: typer.Context,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Directory for the JSON and provisioning.yaml (default: the package's dashboards/generated/)."
        ),
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; exit 1 listing every stale file or lint violation (what CI runs).")
    ] = False,
) -> None:
    """Write (or --check) the dashboards and the Grafana provisioning file."""
    from dashboards.generate import DEFAULT_OUT

    if ctx.invoked_subcommand is not None:
        if out is not None or check:
            _fail(f"--out/--check apply to generation, not to `{ctx.invoked_subcommand}`; give them without it")
        return
    target = out or DEFAULT_OUT
    if target.exists() and not target.is_dir():
        _fail(f"--out {target}: not a directory")
    try:
        from dashboards.generate import stale, write
        from dashboards.lint import lint
    except ValueError as exc:  # an unknown metric or a broken grid: the generator refuses to build
        _fail(str(exc))
    if check:
        _check(target, stale, lint)
        return
    try:
        paths = write(target)
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    for p in paths:
        typer.echo(str(p))


def _check(target: Path, stale, lint) -> None:  # type: ignore[no-untyped-def]
    import json

    try:
        problems = stale(target)
    except ValueError as exc:
        _fail(str(exc))
    for path in sorted(target.glob("*.json")):
        problems += [str(v) for v in lint(json.loads(path.read_text()))]
    if problems:
        for p in problems:
            typer.echo(p, err=True)
        typer.echo(f"dashboards in {target} are stale or break lint rules: run `diag dashboards` and commit", err=True)
        raise typer.Exit(1)
    typer.echo(f"dashboards in {target} are up to date and lint-clean")


@dashboards_app.command("preview")
def preview_cmd(
    prometheus: Annotated[str, typer.Option("--prometheus", help="Prometheus base URL, e.g. http://127.0.0.1:9090.")],
    out: Annotated[Path, typer.Option("--out", help="The HTML file to write.")],
    since: Annotated[str, typer.Option("--since", help="How far back: 30m, 1h, 6h, 1d.")] = "1h",
    header: Annotated[
        list[str] | None,
        typer.Option("--header", help="An HTTP header for every query (repeatable). Never printed.", metavar="'NAME: VALUE'"),
    ] = None,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="The tenant, sent as X-Scope-OrgID (Mimir, Cortex, Thanos).", metavar="ID")
    ] = None,
) -> None:
    """Render every panel's queries from a real Prometheus into one self-contained HTML page."""
    from diag.sources.prometheus import request_headers
    from diag.units import parse_duration

    if not prometheus.startswith(("http://", "https://")):
        _fail(f"--prometheus {prometheus!r}: give a URL such as http://127.0.0.1:9090")
    try:
        headers = request_headers(header or (), tenant)
    except ValueError as exc:
        _fail(str(exc))
    try:
        since_s = parse_duration(since)
    except ValueError as exc:
        _fail(f"--since: {exc}")
    if out.suffix.lower() not in (".html", ".htm"):
        _fail(f"--out {out}: the preview is an HTML page; name it *.html")
    if not out.parent.is_dir():
        _fail(f"--out {out}: directory {out.parent} does not exist")
    import httpx

    from diag.views.dashboards_preview import PreviewError, preview

    try:
        text, results = preview(prometheus, since_s, headers)
    except (PreviewError, httpx.HTTPError) as exc:
        _fail(f"--prometheus {prometheus}: {exc}")
    out.write_text(text)
    empty = sum(1 for r in results if not r.series)
    typer.echo(f"{out}: {len(results)} panels, {empty} without data")


def register(app: typer.Typer) -> None:
    app.add_typer(dashboards_app, name="dashboards")
