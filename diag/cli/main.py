"""The ``diag`` command line: the root app, and every command group registered on it (one module each in
``diag.cli``).

Each command is a thin shell over a library call, so everything it does can also be done from
Python. Bad input gets one clear line on stderr and exit code 2 (typer's convention for usage
errors), never a traceback.
"""

from __future__ import annotations

import typer

from diag.cli.errors import OneLineUsageErrors

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


def _register_subcommands() -> None:
    """Every command group, in the order ``diag --help`` lists them."""
    from diag.cli.alerts import register as register_alerts
    from diag.cli.analyze import register as register_analyze
    from diag.cli.bundle import register as register_bundle
    from diag.cli.collect import register as register_collect
    from diag.cli.compact import register as register_compact
    from diag.cli.dashboards import register as register_dashboards
    from diag.cli.demo import register as register_demo
    from diag.cli.gate import register as register_gate
    from diag.cli.snapshot import register as register_snapshot
    from diag.cli.triage import register as register_triage
    from diag.cli.wrap import register as register_wrap

    register_snapshot(app)
    register_collect(app)
    register_compact(app)
    register_analyze(app)
    register_alerts(app)
    register_bundle(app)
    register_demo(app)
    register_gate(app)
    register_dashboards(app)
    register_triage(app)
    register_wrap(app)


_register_subcommands()


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
