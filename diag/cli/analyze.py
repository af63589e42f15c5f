"""``diag analyze``: the rules on a window of records -- the flight recorder, a bundle, or Prometheus -- and the verdict."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Annotated

import typer

from collectors.recorder import default_recorder_path
from diag.cli import options as opts
from diag.cli.errors import fail

SINCE_EXAMPLES = ("30m", "2h", "1d")


def _check_fleet(prometheus: str | None, selector: str | None, fleet: str | None, by: str | None,
                 jobs: int | None, bundle: Path | None, recorder: Path | None) -> None:  # fmt: skip
    """``--fleet`` only on the Prometheus path, instead of ``--selector``; ``--by`` a label name; ``--jobs`` in range."""
    from diag.sources.fleet import check_label

    if fleet is None:
        opts.refuse({"--by": by is not None, "--jobs": jobs is not None}, "without --fleet (they shape a fleet analysis)")
        return
    opts.refuse({"--recorder": recorder is not None, "--bundle": bundle is not None},
                "with --fleet (a fleet is read from Prometheus: give --prometheus URL)")  # fmt: skip
    if prometheus is None:
        raise opts.OptionError("--fleet needs --prometheus URL (the fleet's series are read from Prometheus)")
    opts.refuse({"--selector": selector is not None}, "with --fleet (--fleet is the selector: every target it matches)")
    if not fleet.strip().strip("{}").strip():
        raise opts.OptionError("--fleet '': give label matchers for the fleet, e.g. 'job=\"llm\"'")
    if by is not None:
        try:
            check_label(by)
        except ValueError as exc:
            raise opts.OptionError(f"{exc}; use e.g. instance or host") from None
    if jobs is not None:
        opts.number("--jobs", jobs, low=1, high=256, meaning="worker processes running the rules", examples=("1", "2"))


def prometheus_headers(prometheus: str | None, header: list[str] | None, tenant: str | None) -> dict[str, str]:
    """``--header``/``--tenant`` as request headers, checked (values never shown); only with ``--prometheus``."""
    from diag.sources.prometheus import request_headers

    if prometheus is None:
        opts.refuse({"--header": bool(header), "--tenant": tenant is not None},
                    "without --prometheus (they go with its queries)")  # fmt: skip
        return {}
    try:
        return request_headers(header or (), tenant)
    except ValueError as exc:
        raise opts.OptionError(str(exc)) from None


def _analysis_source(
    recorder: Path | None,
    bundle: Path | None,
    prometheus: str | None,
    selector: str | None,
    since: str | None,
    fleet: tuple[str | None, str | None, int | None] = (None, None, None),
    auth: tuple[list[str] | None, str | None] = (None, None),
) -> tuple[str, float, dict[str, str]]:
    """Which source to read (checked: exactly one, each with only the options that apply to it), the window, and
    the request headers of the Prometheus path."""
    try:
        _check_fleet(prometheus, selector, *fleet, bundle, recorder)
        headers = prometheus_headers(prometheus, *auth)
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
            return "bundle", since_s, headers
        if prometheus is not None:
            opts.http_url("--prometheus", prometheus)
            return "prometheus", since_s, headers
        if recorder is not None:
            opts.existing_file("--recorder", recorder)
    except opts.OptionError as exc:
        fail(str(exc))
    return "recorder", since_s, headers


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
    fleet: Annotated[
        str | None,
        typer.Option(
            help="With --prometheus: label matchers for a whole fleet, e.g. 'job=\"llm\"': "
            "every target diagnosed in one pass, a ranked table."
        ),
    ] = None,
    by: Annotated[
        str | None, typer.Option(help="With --fleet: the label naming a target (default instance, its port dropped).")
    ] = None,
    jobs: Annotated[
        int | None, typer.Option(help="With --fleet: worker processes running the rules (default: the CPUs available).")
    ] = None,
    header: Annotated[
        list[str] | None,
        typer.Option(
            help="With --prometheus: an HTTP header for every query, 'Name: value' (repeatable), e.g. "
            "'Authorization: Bearer <token>'. Never printed.",
            metavar="'NAME: VALUE'",
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option(help="With --prometheus: the tenant, sent as X-Scope-OrgID (Mimir, Cortex, Thanos receive).", metavar="ID"),
    ] = None,
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

    Fleet (--fleet): each signal is queried once for every matching target and split by the --by label; the
    rules run per target in worker processes; the table ranks sick targets first, by confidence. A target
    with too little data is listed as "too_little_data". JSON: {"selector", "by", "window", "step_s",
    "queries", "source", "counts", "targets": [{"target", "verdict", "class", "confidence", "evidence",
    "points", "analysis"}]}. Progress goes to stderr.

    Exit status: 0 analysed; 2 an option is invalid or cannot apply, or the source cannot be read (no
    recorder, a recorder file that is not a database, a folder that is not a bundle, Prometheus unreachable).

    Examples:\n
      diag analyze --since 30m\n
      diag analyze --bundle ./llm-diag-bundle-20261130T1200Z --json\n
      diag analyze --prometheus http://127.0.0.1:9090 --selector 'job="llm-api"'\n
      diag analyze --prometheus http://127.0.0.1:9090 --fleet 'job="llm-api"' --by host\n
      diag analyze --prometheus https://mimir.example/prometheus --tenant team-a --header "Authorization: Bearer $TOKEN"
    """
    from diag.rules.engine import analyze as run_rules

    kind, since_s, headers = _analysis_source(recorder, bundle, prometheus, selector, since, (fleet, by, jobs),
                                              (header, tenant))  # fmt: skip
    if fleet is not None:
        assert prometheus is not None
        _analyze_fleet(prometheus, fleet, by or "instance", jobs, since_s, as_json, headers)
        return
    timeline = _load_timeline(kind, recorder, bundle, prometheus, selector or "", since_s, headers)
    result = run_rules(timeline)
    if as_json:
        json.dump(result.to_dict(), sys.stdout, indent=2, allow_nan=False, default=str)
        sys.stdout.write("\n")
    else:
        from diag.views.analysis import render_analysis

        render_analysis(result)


def _analyze_fleet(url: str, selector: str, by: str, jobs: int | None, since_s: float, as_json: bool,
                   headers: dict[str, str]) -> None:  # fmt: skip
    """Every target of the fleet: one query set, the rules per target in worker processes, the ranked table."""
    from diag.cli.fleet import default_jobs, judge_fleet, progress
    from diag.sources.fleet import load_fleet
    from diag.views.fleet import fleet_document, render_fleet

    try:
        fleet = load_fleet(url, selector=selector, by=by, since_s=since_s, progress=progress, headers=headers)
    except ValueError as exc:
        fail(str(exc))
    if fleet.unlabelled:
        progress(f"{fleet.unlabelled} series without the label {by!r} were left out")
    rows = judge_fleet(fleet.targets, jobs or default_jobs(), progress)
    meta = {"selector": fleet.selector, "by": by, "window": {"start": fleet.window[0], "end": fleet.window[1]},
            "step_s": fleet.step, "queries": fleet.queries, "source": f"prometheus:{url}"}  # fmt: skip
    if as_json:
        json.dump(fleet_document(rows, meta), sys.stdout, indent=2, allow_nan=False, default=str)
        sys.stdout.write("\n")
    else:
        render_fleet(rows, meta)


def _load_timeline(kind: str, recorder: Path | None, bundle: Path | None, prometheus: str | None, selector: str,
                   since_s: float, headers: dict[str, str]):  # type: ignore[no-untyped-def]  # fmt: skip
    from collectors.recorder import RecorderCorrupt
    from diag.sources import load_bundle, load_prometheus, load_recorder

    path = recorder or default_recorder_path()
    try:
        if kind == "bundle":
            assert bundle is not None
            return load_bundle(bundle)
        if kind == "prometheus":
            assert prometheus is not None
            return load_prometheus(prometheus, selector=selector, since_s=since_s, headers=headers)
        if not path.exists():
            fail(f"no flight recorder at {path}; run `diag collect` first, or pass --recorder/--bundle/--prometheus")
        return load_recorder(path, since_s=since_s)
    except (RecorderCorrupt, sqlite3.DatabaseError) as exc:
        fail(f"{exc if isinstance(exc, RecorderCorrupt) else f'{path} is not a readable flight recorder ({exc})'}. "
              "Move it aside (a running `diag collect` does so itself on its next start) and analyse a bundle "
              "or Prometheus instead, or pass --recorder with another file")  # fmt: skip
    except (OSError, ValueError) as exc:
        fail(str(exc))


def register(app: typer.Typer) -> None:
    """Add ``analyze`` to the ``diag`` app."""
    app.command("analyze")(analyze)
