"""``diag triage serve`` (the Alertmanager receiver) and ``diag tickets list|show|close``.

Wiring: ``register(app)`` adds both groups to the ``diag`` Typer app. Every option is validated
before anything starts; bad input is one line on stderr and exit 2.

A store that is not readable: the readers (``tickets list|show|close|retry``) say so in one line naming the
file and exit 2 -- they never change it. ``triage serve`` moves a damaged store aside (``<name>.corrupt-<UTC
time>`` with its -wal/-shm, as the flight recorder does) and starts a new one with a loud warning, because the
receiver's first duty is to be there when Alertmanager posts: a receiver that refuses to start loses every alert
until a person steps in, while the old file is kept for inspection and the trackers' marker lookup still finds
the tickets of incidents that fire again. A healthy SQLite database of something else is refused instead
(exit 2): it is another program's file given as ``--db`` by mistake, and moving it would break that program.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

ENV_DB = "LLMDIAG_TRIAGE_DB"

triage_app = typer.Typer(
    name="triage",
    help="Alertmanager auto-triage: one diagnosed, deduplicated incident (and ticket) per problem.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
tickets_app = typer.Typer(
    name="tickets",
    help="The incidents the triage receiver recorded: list, show, close (as fixed or won't-fix).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

Db = Annotated[
    str | None,
    typer.Option(
        "--db",
        help=f"Incident store: a SQLite file, or postgresql://USER@HOST:PORT/DB for several receivers on one store "
        f"(password from PGPASSWORD or ~/.pgpass). Default: ${ENV_DB}, else /var/lib/llm-diag/triage.db as root, "
        "~/.local/state/llm-diag/triage.db as a user.",
    ),
]


def _fail(message: str) -> None:
    typer.secho(f"diag: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def _target(db: str | None) -> Path | str:
    """``--db`` as the store's location: a PostgreSQL URL kept as it is (a Path would fold its ``//``), else a path."""
    from diag.triage.store import store_target

    return store_target(db or os.environ.get(ENV_DB) or default_db_path())


def _shown(target: Path | str) -> str:
    """The store's location for a message: a URL without its password."""
    from diag.triage.pg import redact

    return redact(str(target))


def default_db_path() -> Path:
    """``$LLMDIAG_TRIAGE_DB``, else ``triage.db`` beside the flight recorder (``/var/lib/llm-diag`` for root)."""
    env = os.environ.get(ENV_DB)
    if env:
        return Path(env)
    from collectors.recorder import state_dir

    return state_dir() / "triage.db"


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9095")
    return host, int(port)


def _duration(option: str, value: str, examples: str) -> float:
    from diag.units import parse_duration

    try:
        return parse_duration(value)
    except ValueError:
        raise ValueError(
            f"{option} {value!r}: expected a positive duration, a number with a unit ms, s, m, h or d, e.g. {examples}"
        ) from None


def _correlate_labels(value: str) -> tuple[str, ...]:
    from diag.triage.keys import parse_key_labels

    try:
        return parse_key_labels(value)
    except ValueError as exc:
        raise ValueError(str(exc).replace("--key-labels", f"--correlate-labels {value!r}") + " (or 'none')") from None


def _body_size(value: str) -> int:
    from diag.units import parse_size

    message = f"--max-body {value!r}: expected a size between 1KiB and 64MiB, e.g. 1MiB, 256KiB or 8MiB"
    try:
        size = parse_size(value)
    except ValueError:
        raise ValueError(message) from None
    if not 1024 <= size <= 64 << 20:
        raise ValueError(message)
    return size


def _env(name: str, option: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise ValueError(f"{option}: the environment variable {name} is empty or unset")
    return value


@triage_app.command("serve")
def serve(
    listen: Annotated[str, typer.Option(help="Address to listen on, HOST:PORT. Loopback by default.")] = "127.0.0.1:9095",
    db: Db = None,
    prometheus: Annotated[str | None, typer.Option(help="Diagnose from this Prometheus (base URL): the fleet path.")] = None,
    recorder: Annotated[Path | None, typer.Option(help="Diagnose from this flight recorder (default: the agent's).")] = None,
    header: Annotated[
        list[str] | None,
        typer.Option(
            help="With --prometheus: an HTTP header for its queries (repeatable). Never printed.", metavar="'NAME: VALUE'"
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option(help="With --prometheus: the tenant, sent as X-Scope-OrgID (Mimir, Cortex, Thanos).", metavar="ID"),
    ] = None,
    no_diagnosis: Annotated[bool, typer.Option("--no-diagnosis", help="Record and file incidents without diagnosing.")] = False,
    selector_labels: Annotated[
        str, typer.Option(help="With --prometheus: alert labels that select the service's series, comma-separated.")
    ] = "job,instance",
    key_labels: Annotated[
        str,
        typer.Option(help="Labels that identify an incident, comma-separated; a|b = the first present of a, b."),
    ] = "diag_class|slo|alertname,job,instance,model|model_name",
    correlate_labels: Annotated[
        str,
        typer.Option(
            help="Incidents of one class join into one when these labels do not disagree (a|b: either name); "
            "'none' keeps every key its own incident."
        ),
    ] = "instance,model|model_name",
    correlate_window: Annotated[
        str, typer.Option(help="Incidents of one class join only when opened within this long of each other (e.g. 30m).")
    ] = "30m",
    ticket_hold: Annotated[
        str,
        typer.Option(
            help="With a diagnosis, a new incident's tickets wait for it at most this long, so alerts about one problem "
            "join before anything is filed (0s: file at once)."
        ),
    ] = "2m",
    hold_down: Annotated[str, typer.Option(help="Resolved only after this long without a new firing (e.g. 5m, 1h).")] = "5m",
    reopen_window: Annotated[
        str, typer.Option(help="Firing again within this long reopens; later opens a new incident (e.g. 24h, 7d).")
    ] = "24h",
    flap_window: Annotated[str, typer.Option(help="Window in which state changes are counted for flapping.")] = "1h",
    claim_lease: Annotated[
        str,
        typer.Option(
            help="With a postgresql:// store: how long a receiver's claim on a ticket action holds; a receiver that "
            "dies mid-send has its actions taken over by the others this long after (longer than a tracker request)."
        ),
    ] = "60s",
    flap_threshold: Annotated[int, typer.Option(min=2, help="State changes within --flap-window that mark flapping.")] = 4,
    lookback: Annotated[str, typer.Option(help="Diagnose from startsAt minus this much, up to now.")] = "30m",
    max_body: Annotated[str, typer.Option(help="Largest webhook body accepted (413 above); 1KiB to 64MiB.")] = "1MiB",
    token_env: Annotated[
        str, typer.Option(help="Require 'Authorization: Bearer <token>' when this environment variable is set.")
    ] = "LLMDIAG_TRIAGE_TOKEN",
    bundle_on: Annotated[
        str, typer.Option(help="'page': run `diag bundle` for incidents with severity=page; 'never'.")
    ] = "never",
    bundle_dir: Annotated[Path | None, typer.Option(help="Where --bundle-on writes bundles (default: beside the store).")] = None,
    github_repo: Annotated[str | None, typer.Option(help="File incidents as GitHub issues in OWNER/NAME.")] = None,
    github_url: Annotated[str, typer.Option(help="GitHub API base URL (GitHub Enterprise: https://HOST/api/v3).")] = (
        "https://api.github.com"
    ),
    github_token_env: Annotated[str, typer.Option(help="Environment variable holding the GitHub token.")] = "GITHUB_TOKEN",
    jira_url: Annotated[
        str | None, typer.Option(help="File incidents in this Jira (base URL): Cloud via REST v3, Data Center via v2.")
    ] = None,
    jira_deployment: Annotated[str, typer.Option(help="auto (ask the server's serverInfo), cloud or datacenter.")] = "auto",
    jira_project: Annotated[str, typer.Option(help="Jira project key.")] = "",
    jira_issue_type: Annotated[str, typer.Option(help="Jira issue type.")] = "Bug",
    jira_resolve_transition: Annotated[str, typer.Option(help="Jira transition that closes an issue.")] = "Done",
    jira_reopen_transition: Annotated[str, typer.Option(help="Jira transition that reopens an issue.")] = "To Do",
    jira_user_env: Annotated[str, typer.Option(help="Environment variable with the Jira user (Basic auth).")] = "JIRA_USER",
    jira_token_env: Annotated[str, typer.Option(help="Environment variable with the Jira API token / PAT.")] = "JIRA_TOKEN",
    gitlab_project: Annotated[
        str | None, typer.Option(help="File incidents as GitLab issues in this project (numeric id or group/path).")
    ] = None,
    gitlab_url: Annotated[str, typer.Option(help="GitLab base URL (self-managed: https://HOST).")] = "https://gitlab.com",
    gitlab_token_env: Annotated[str, typer.Option(help="Environment variable with the GitLab token (api scope).")] = (
        "GITLAB_TOKEN"
    ),
    ticket_webhook_url: Annotated[
        str | None, typer.Option(help="POST every ticket action as JSON to this URL (ServiceNow/PagerDuty/Keep bridges).")
    ] = None,
    ticket_webhook_token_env: Annotated[
        str, typer.Option(help="Environment variable with a bearer token for --ticket-webhook-url (none by default).")
    ] = "",
    page_url: Annotated[str, typer.Option(help="This receiver's URL as people reach it, for links in tickets.")] = "",
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every delivery and action.")] = False,
) -> None:
    """Receive Alertmanager webhooks at POST /webhook; keep one diagnosed incident per problem; file tickets.

    Point Alertmanager's webhook_config url at http://HOST:PORT/webhook. Every alert is recorded (SQLite, WAL,
    fsync'd) before the answer is 2xx, so Alertmanager's retries, restarts and several HA peers make exactly one
    incident. Each incident is diagnosed in the background (`diag analyze` from 30 min before the alert started
    until now), re-diagnosed when it reopens, and shown at http://HOST:PORT/ (read-only).

    Examples:\n
      diag triage serve --recorder /var/lib/llm-diag/recorder.db\n
      diag triage serve --prometheus http://prometheus:9090 --db /var/lib/llm-diag/triage.db\n
      GITHUB_TOKEN=... diag triage serve --prometheus http://127.0.0.1:9090 --github-repo acme/llm-incidents\n
      JIRA_USER=bot@acme.com JIRA_TOKEN=... diag triage serve --jira-url https://acme.atlassian.net --jira-project OPS\n
      GITLAB_TOKEN=... diag triage serve --no-diagnosis --gitlab-project ops/llm-incidents\n
      LLMDIAG_TRIAGE_TOKEN=s3cret diag triage serve --listen 10.0.0.5:9095 --prometheus http://127.0.0.1:9090
    """
    from diag.triage.server import Receiver
    from diag.units import is_loopback

    config = _serve_config(**locals())
    if not is_loopback(config.host) and not config.token:
        _fail(f"--listen {listen}: not loopback; set ${token_env} so only Alertmanager (with the bearer token) can post")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    _prepare_store(config.db, diagnose=config.source is not None)
    try:
        receiver = Receiver(config)
    except OSError as exc:
        _fail(f"cannot start the receiver on {listen} with store {_shown(config.db)}: {exc}")
        return

    def _term(signum: int, frame: Any) -> None:
        receiver.shutdown()

    signal.signal(signal.SIGTERM, _term)
    diagnosis = f"diagnosis from {config.source.describe()}" if config.source else "diagnosis off (--no-diagnosis)"
    sinks = ", ".join(config.sinks) or "no ticket sinks"
    typer.echo(
        f"diag triage: http://{config.host}:{receiver.port}/webhook (page /), store {_shown(config.db)}, {diagnosis}, "
        f"{sinks}; pid {os.getpid()}",
        err=True,
    )
    try:
        receiver.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        receiver.close()
    typer.echo("diag triage: stopped", err=True)


def _prepare_store(path: Path | str, *, diagnose: bool) -> None:
    """Open (create, migrate) the store before the receiver starts; a damaged one is moved aside (module docstring).
    A PostgreSQL store that cannot be reached is one line and exit 2 (the server checks its own integrity)."""
    from diag.triage.store import StoreCorrupt, connect, is_shared, move_aside, set_diagnosis, set_setting, transaction

    try:
        try:
            db = connect(path)
            problem = "ok" if is_shared(db) else db.execute("PRAGMA quick_check(1)").fetchone()[0]
            if problem != "ok":
                db.close()
                raise StoreCorrupt(path, f"integrity check: {problem}")
        except StoreCorrupt as exc:
            if exc.foreign:
                _fail(f"{exc}; refusing to touch another program's database: pass --db with the triage store's path")
            if isinstance(path, str):
                _fail(f"{exc}; pass --db with the triage store's URL")
                return
            moved = move_aside(path)
            typer.secho(
                f"diag triage: WARNING: {exc}; moved it aside to {moved} (kept for inspection) and started a new, empty "
                "store: incidents recorded before are in that file, not on the page",
                err=True, fg=typer.colors.YELLOW, bold=True,
            )  # fmt: skip
            logging.getLogger(__name__).error("triage: store %s unreadable (%s), moved aside to %s", path, exc.detail, moved)
            db = connect(path)
            with transaction(db):
                set_setting(db, "previous_store", str(moved))
        try:
            set_diagnosis(db, diagnose)
        finally:
            db.close()
    except (OSError, sqlite3.Error) as exc:
        _fail(f"cannot open the triage store {_shown(path)}: {exc}")


def _serve_config(**opts: Any) -> Any:
    """Every option checked and turned into a ReceiverConfig before anything starts."""
    from diag.triage import payload
    from diag.triage.diagnosis import Source
    from diag.triage.keys import parse_key_labels
    from diag.triage.lifecycle import Policy
    from diag.triage.server import ReceiverConfig

    try:
        host, port = _listen(opts["listen"])
        if sum(x is not None for x in (opts["prometheus"], opts["recorder"])) > 1:
            raise ValueError("give one of --prometheus, --recorder")
        if opts["no_diagnosis"] and (opts["prometheus"] or opts["recorder"]):
            raise ValueError("--no-diagnosis cannot be combined with --prometheus/--recorder")
        if opts["bundle_on"] not in ("never", "page"):
            raise ValueError(f"--bundle-on {opts['bundle_on']!r}: expected 'page' or 'never'")
        if opts["bundle_on"] == "page" and opts["no_diagnosis"]:
            raise ValueError("--bundle-on page runs with the diagnosis; it cannot apply with --no-diagnosis")
        if opts["bundle_dir"] is not None and opts["bundle_on"] != "page":
            raise ValueError("--bundle-dir applies only with --bundle-on page")
        selector = tuple(s.strip() for s in opts["selector_labels"].split(",") if s.strip())
        if opts["selector_labels"] != "job,instance" and not opts["prometheus"]:
            raise ValueError("--selector-labels applies only with --prometheus")
        if not selector:
            raise ValueError("--selector-labels: give at least one label")
        policy_args = {
            "key_labels": parse_key_labels(opts["key_labels"]),
            "hold_down_s": _duration("--hold-down", opts["hold_down"], "5m, 90s or 1h"),
            "reopen_window_s": _duration("--reopen-window", opts["reopen_window"], "24h, 12h or 7d"),
            "flap_window_s": _duration("--flap-window", opts["flap_window"], "1h, 30m or 2h"),
            "flap_threshold": opts["flap_threshold"],
            "correlate_labels": () if opts["correlate_labels"].strip() == "none" else _correlate_labels(opts["correlate_labels"]),
            "correlate_window_s": _duration("--correlate-window", opts["correlate_window"], "30m, 10m or 1h"),
            "ticket_hold_s": 0.0
            if opts["ticket_hold"] in ("0", "0s")
            else _duration("--ticket-hold", opts["ticket_hold"], "2m, 30s or 0s"),
        }
        if opts["no_diagnosis"] and opts["ticket_hold"] != "2m":
            raise ValueError("--ticket-hold waits for the diagnosis; it cannot apply with --no-diagnosis")
        if opts["no_diagnosis"]:
            policy_args["ticket_hold_s"] = 0.0  # nothing to wait for
        lookback_s = _duration("--lookback", opts["lookback"], "30m, 1h or 90m")
        claim_lease_s = _duration("--claim-lease", opts["claim_lease"], "60s, 2m or 30s")
        if claim_lease_s < 1:
            raise ValueError(f"--claim-lease {opts['claim_lease']}: at least 1s")
        max_body = _body_size(opts["max_body"])
        if (opts["header"] or opts["tenant"] is not None) and not opts["prometheus"]:
            raise ValueError("--header/--tenant apply only with --prometheus (they go with its queries)")
        if opts["prometheus"]:
            if not opts["prometheus"].startswith(("http://", "https://")):
                raise ValueError(f"--prometheus {opts['prometheus']!r}: expected a base URL such as http://127.0.0.1:9090")
            from diag.sources.prometheus import request_headers

            headers = tuple(request_headers(opts["header"] or (), opts["tenant"]).items())
            source: Source | None = Source("prometheus", opts["prometheus"].rstrip("/"), selector, headers)
        elif opts["no_diagnosis"]:
            source = None
        else:
            from collectors.recorder import default_recorder_path

            path = opts["recorder"] or default_recorder_path()
            if not Path(path).exists():
                raise ValueError(f"no flight recorder at {path}; pass --recorder, --prometheus or --no-diagnosis")
            source = Source("recorder", str(path))
        sinks = _sinks(opts)
    except ValueError as exc:
        _fail(str(exc))
    db = _target(opts["db"])
    state = default_db_path().parent if isinstance(db, str) else db.parent  # bundles stay local beside a shared store
    return ReceiverConfig(  # type: ignore[no-any-return]
        host=host, port=port, db=db, policy=Policy(**policy_args, sinks=tuple(sinks)), source=source,
        token=os.environ.get(opts["token_env"], ""), max_body_bytes=max_body or payload.MAX_BODY_BYTES, sinks=sinks,
        bundle_on=opts["bundle_on"] if opts["bundle_on"] == "page" else None,
        bundle_dir=opts["bundle_dir"] or state / "bundles", page_url=opts["page_url"], lookback_s=lookback_s,
        claim_lease_s=claim_lease_s,
    )  # fmt: skip


def _sinks(opts: dict[str, Any]) -> dict[str, Any]:
    """The ticket sinks the options ask for; options of a sink that is not configured are refused."""
    from diag.cli.options import http_url
    from diag.triage.sinks import GitHubSink, GitLabSink, JiraSink, Sink, WebhookSink

    sinks: dict[str, Sink] = {}
    if opts["github_repo"]:
        sinks["github"] = GitHubSink(opts["github_repo"], _env(opts["github_token_env"], "--github-repo"), opts["github_url"])
    elif opts["github_url"] != "https://api.github.com":
        raise ValueError("--github-url applies only with --github-repo")
    if opts["jira_url"]:
        if not opts["jira_project"]:
            raise ValueError("--jira-url needs --jira-project")
        sinks["jira"] = JiraSink(
            http_url("--jira-url", opts["jira_url"]), opts["jira_project"], user=os.environ.get(opts["jira_user_env"], ""),
            token=_env(opts["jira_token_env"], "--jira-url"), issue_type=opts["jira_issue_type"],
            resolve_transition=opts["jira_resolve_transition"], reopen_transition=opts["jira_reopen_transition"],
            deployment=opts["jira_deployment"],
        )  # fmt: skip
    else:
        for name, default in (("jira_project", ""), ("jira_deployment", "auto")):
            if opts[name] != default:
                raise ValueError(f"--{name.replace('_', '-')} applies only with --jira-url")
    if opts["gitlab_project"]:
        url = http_url("--gitlab-url", opts["gitlab_url"])
        sinks["gitlab"] = GitLabSink(url, opts["gitlab_project"], _env(opts["gitlab_token_env"], "--gitlab-project"))
    else:
        for name, default in (("gitlab_url", "https://gitlab.com"), ("gitlab_token_env", "GITLAB_TOKEN")):
            if opts[name] != default:
                raise ValueError(f"--{name.replace('_', '-')} applies only with --gitlab-project")
    if opts["ticket_webhook_url"]:
        token_env = opts["ticket_webhook_token_env"]
        token = _env(token_env, "--ticket-webhook-token-env") if token_env else ""
        sinks["webhook"] = WebhookSink(opts["ticket_webhook_url"], token)
    elif opts["ticket_webhook_token_env"]:
        raise ValueError("--ticket-webhook-token-env applies only with --ticket-webhook-url")
    return sinks


def _open(path: Path | str) -> Any:
    """A reader's connection; a missing or unreadable store is one line and exit 2, and nothing is changed."""
    from diag.triage.store import StoreCorrupt, connect

    if isinstance(path, Path) and not path.exists():
        _fail(f"no triage store at {path}; start `diag triage serve` or pass --db")
    try:
        return connect(path)
    except StoreCorrupt as exc:
        _unreadable(path, exc)
    except sqlite3.Error as exc:
        _fail(f"cannot read the triage store {_shown(path)}: {exc}")


def _unreadable(path: Path | str, exc: sqlite3.Error) -> None:
    from diag.triage.store import StoreCorrupt

    if isinstance(exc, StoreCorrupt) and exc.foreign:
        _fail(f"{exc}; pass --db with the triage store's path")
    reason = str(exc) if isinstance(exc, StoreCorrupt) else f"{path} is not a readable triage store ({exc})"
    _fail(f"{reason}. Move it aside (a restarted `diag triage serve` does so itself and starts a new store), "
          "or pass --db with another file")  # fmt: skip


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


@tickets_app.command("list")
def list_cmd(
    db: Db = None,
    status: Annotated[str | None, typer.Option(help="Only this status: open, resolving, resolved, closed.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
) -> None:
    """The incidents, most recently changed first.

    Examples:\n
      diag tickets list\n
      diag tickets list --status open --json | jq '.[].diag_class'
    """
    from diag.triage.store import STATUSES, list_incidents

    if status is not None and status not in STATUSES:
        _fail(f"--status {status!r}: expected one of {', '.join(STATUSES)}")
    path = _target(db)
    try:
        rows = list_incidents(_open(path), status=status)
    except sqlite3.DatabaseError as exc:
        _unreadable(path, exc)
        return
    if as_json:
        json.dump(rows, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "status", "class", "title", "alerts", "reopened", "updated (UTC)")
    from diag.triage.outbox import NOT_DIAGNOSED

    for r in rows:
        state = r["status"] + (f" ({r['resolution']})" if r["resolution"] else "") + (" flapping" if r["flapping"] else "")
        state += " ticket failed" if r["ticket_failures"] else ""
        cls = r["diag_class"] or (NOT_DIAGNOSED if r["diag_state"] == "off" else f"({r['diag_state']})")
        table.add_row(str(r["id"]), state, cls, r["title"], str(r["alert_count"]), str(r["reopen_count"]), _when(r["updated_at"]))
    Console().print(table)


@tickets_app.command("show")
def show_cmd(
    incident: Annotated[int, typer.Argument(help="Incident id (from `diag tickets list`).")],
    db: Db = None,
    as_json: Annotated[bool, typer.Option("--json", help="The whole incident as JSON.")] = False,
) -> None:
    """One incident: status, diagnosis with evidence, alerts, tickets and timeline.

    Examples:\n
      diag tickets show 3\n
      diag tickets show 3 --json | jq .incident.diagnosis.findings
    """
    from diag.triage.outbox import diagnosis_text
    from diag.triage.store import get_incident

    path = _target(db)
    try:
        view = get_incident(_open(path), incident)
    except sqlite3.DatabaseError as exc:
        _unreadable(path, exc)
        return
    if view is None:
        _fail(f"no incident {incident}")
        return
    if as_json:
        json.dump(view.to_dict(), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return
    r = view.row
    typer.echo(f"Incident {r['id']}: {r['title']}")
    typer.echo(
        f"Status: {r['status']}" + (f" ({r['resolution']})" if r["resolution"] else "") + (", flapping" if r["flapping"] else "")
    )
    typer.echo(f"Reopened: {r['reopen_count']}x; started {_when(r['starts_at'])} UTC")
    typer.echo(diagnosis_text(view))
    for t in view.tickets:
        typer.echo(f"Ticket: {t['sink']} {t['external_id']} {t['url']}")
    for f in view.ticket_failures:
        typer.echo(f"Ticket failed, not retried: {f['sink']} {f['action']} at {_when(f['failed_at'])} UTC: {f['error']}")
    if view.ticket_failures:
        typer.echo(f"  (fix the cause, then `diag tickets retry {r['id']}`)")
    typer.echo(f"Alerts: {len(view.alerts)}")
    typer.echo("Timeline:")
    for e in view.events:
        typer.echo(f"  {_when(e['ts'])}  {e['kind']:<15} {e['text']}")


@tickets_app.command("close")
def close_cmd(
    incident: Annotated[int, typer.Argument(help="Incident id.")],
    db: Db = None,
    wontfix: Annotated[bool, typer.Option("--wontfix", help="Closed as won't fix: later firings never reopen it.")] = False,
    note: Annotated[str, typer.Option(help="Why (recorded on the incident and its tickets).")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="The result as JSON.")] = False,
) -> None:
    """Close an incident as fixed (it reopens if it fires again within the reopen window) or as won't-fix (never).

    The receiver forwards the close to the incident's tickets.

    Examples:\n
      diag tickets close 3\n
      diag tickets close 7 --wontfix --note "known noisy canary"
    """
    from diag.triage.lifecycle import Policy, close_by_person
    from diag.triage.store import transaction

    path = _target(db)
    conn = _open(path)
    try:
        with transaction(conn) as tx:
            result = close_by_person(tx, Policy(), incident, wontfix=wontfix, note=note, now=time.time())
    except LookupError as exc:
        _fail(str(exc).strip("'\""))
        return
    except sqlite3.DatabaseError as exc:
        _unreadable(path, exc)
        return
    if as_json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        done = "closed" if result["changed"] else "already closed"
        typer.echo(f"Incident {incident} {done} as {result['resolution']}.")


@tickets_app.command("retry")
def retry_cmd(
    incident: Annotated[int, typer.Argument(help="Incident id.")],
    db: Db = None,
    as_json: Annotated[bool, typer.Option("--json", help="The result as JSON.")] = False,
) -> None:
    """Queue an incident's failed ticket actions again, once what made the tracker refuse them is fixed.

    A tracker's permanent refusal (a wrong token, a missing project, a removed endpoint) stops the retries and
    is shown on the incident; the running receiver sends the actions queued here within a second.

    Examples:\n
      diag tickets show 3        # what failed, and why\n
      diag tickets retry 3
    """
    from diag.triage.outbox import retry_failed
    from diag.triage.store import get_incident

    path = _target(db)
    conn = _open(path)
    try:
        if get_incident(conn, incident) is None:
            _fail(f"no incident {incident}")
        count = retry_failed(conn, incident)
    except sqlite3.DatabaseError as exc:
        _unreadable(path, exc)
        return
    if as_json:
        json.dump({"id": incident, "requeued": count}, sys.stdout)
        sys.stdout.write("\n")
    else:
        typer.echo(f"Incident {incident}: {count} failed ticket action(s) queued again." if count else
                   f"Incident {incident} has no failed ticket action.")  # fmt: skip


def register(app: typer.Typer) -> None:
    app.add_typer(triage_app)
    app.add_typer(tickets_app)
