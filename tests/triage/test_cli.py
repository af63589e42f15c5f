"""``diag triage serve`` refuses bad options before starting (one line, exit 2, naming the option and only values it
accepts); ``diag tickets list|show|close``; a store that is not readable (one line for the readers; moved aside by
``serve``, or refused when it is another program's database); ``--no-diagnosis`` said everywhere an incident is."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from diag.cli.main import app
from diag.triage import lifecycle, payload
from diag.triage.store import connect, transaction
from tests.triage.helpers import FIXTURE, alert, body, receiver
from tests.triage.ticketkit import wait_until
from tests.triage.wire_github import GitHub

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--listen", "nonsense"], "expected HOST:PORT"),
        (["--listen", "0.0.0.0:9095", "--no-diagnosis"], "not loopback"),
        (["--prometheus", "http://a:9090", "--recorder", "/x"], "one of --prometheus, --recorder"),
        (["--prometheus", "ftp://a"], "base URL"),
        (["--no-diagnosis", "--recorder", "/x"], "cannot be combined"),
        (["--recorder", "/nonexistent/recorder.db"], "no flight recorder"),
        (["--no-diagnosis", "--hold-down", "soon"], "soon"),
        (["--no-diagnosis", "--key-labels", "bad-label"], "not a label name"),
        (["--no-diagnosis", "--bundle-on", "always"], "--bundle-on"),
        (["--no-diagnosis", "--bundle-on", "page"], "cannot apply"),
        (["--no-diagnosis", "--bundle-dir", "/tmp"], "only with --bundle-on page"),
        (["--no-diagnosis", "--selector-labels", "job"], "only with --prometheus"),
        (["--no-diagnosis", "--max-body", "10"], "--max-body"),
        (["--no-diagnosis", "--github-repo", "acme/x", "--github-token-env", "LLMDIAG_TEST_UNSET_VAR"], "LLMDIAG_TEST_UNSET_VAR"),
        (["--no-diagnosis", "--jira-project", "OPS"], "only with --jira-url"),
        (["--no-diagnosis", "--correlate-labels", "inst-ance"], "--correlate-labels 'inst-ance'"),
        (["--no-diagnosis", "--ticket-hold", "30s"], "cannot apply with --no-diagnosis"),
    ],
)
def test_serve_refuses_bad_options_with_one_line(tmp_path, args, says):
    result = runner.invoke(app, ["triage", "serve", "--db", str(tmp_path / "t.db"), *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert not (tmp_path / "t.db").exists()  # refused before anything started


def test_tickets_list_show_close(tmp_path):
    db_path = tmp_path / "t.db"
    db = connect(db_path)
    with transaction(db):
        lifecycle.apply(db, lifecycle.Policy(), payload.parse(FIXTURE.read_bytes()), 1000.0)
    db.close()
    listed = runner.invoke(app, ["tickets", "list", "--db", str(db_path), "--json"])
    assert listed.exit_code == 0
    (row,) = json.loads(listed.output)
    assert row["status"] == "open" and row["alert_count"] == 1
    shown = runner.invoke(app, ["tickets", "show", str(row["id"]), "--db", str(db_path), "--json"])
    doc = json.loads(shown.output)
    assert doc["alerts"][0]["fingerprint"] == "4eb55a262f4fff97" and doc["events"][0]["kind"] == "opened"
    text = runner.invoke(app, ["tickets", "show", str(row["id"]), "--db", str(db_path)])
    assert "Timeline:" in text.output and "ErrorBudgetBurnFast" in text.output
    closed = runner.invoke(app, ["tickets", "close", str(row["id"]), "--db", str(db_path), "--wontfix", "--note", "noisy"])
    assert closed.exit_code == 0 and "closed as wontfix" in closed.output
    listed = json.loads(runner.invoke(app, ["tickets", "list", "--db", str(db_path), "--json", "--status", "closed"]).output)
    assert listed[0]["resolution"] == "wontfix"
    missing = runner.invoke(app, ["tickets", "show", "999", "--db", str(db_path)])
    assert missing.exit_code == 2 and "no incident 999" in missing.output
    nodb = runner.invoke(app, ["tickets", "list", "--db", str(tmp_path / "none.db")])
    assert nodb.exit_code == 2 and "no triage store" in nodb.output
    bad = runner.invoke(app, ["tickets", "list", "--db", str(db_path), "--status", "weird"])
    assert bad.exit_code == 2


NOISE = bytes(range(256)) * 40


def _foreign_db(path: Path) -> bytes:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE records (ts REAL, kind TEXT)")
    db.commit()
    db.close()
    return path.read_bytes()


@pytest.mark.parametrize("command", [["list"], ["show", "1"], ["close", "1"], ["retry", "1"]])
@pytest.mark.parametrize("kind", ["noise", "foreign"])
def test_readers_on_a_file_that_is_not_a_store_say_so_in_one_line(tmp_path, command, kind):
    path = tmp_path / "triage.db"
    before = path.write_bytes(NOISE) and NOISE if kind == "noise" else _foreign_db(path)
    result = runner.invoke(app, ["tickets", *command, "--db", str(path)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output and str(path) in lines[0]
    assert "is not a readable triage store" in lines[0] and "--db" in lines[0]
    assert ("Move it aside" in lines[0]) == (kind == "noise")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["triage.db"]


@pytest.mark.process
def test_serve_moves_a_damaged_store_aside_and_starts_afresh(tmp_path):
    path = tmp_path / "triage.db"
    path.write_bytes(NOISE)
    (tmp_path / "triage.db-wal").write_bytes(b"stale wal")
    with receiver(path, "--no-diagnosis") as rx:
        moved = [p for p in tmp_path.iterdir() if p.name.startswith("triage.db.corrupt-")]
        assert sorted(p.name.endswith("-wal") for p in moved) == [False, True]
        original = next(p for p in moved if not p.name.endswith("-wal"))
        assert original.read_bytes() == NOISE  # kept for inspection, not deleted
        log = rx.log.read_text()
        assert "WARNING" in log and "moved it aside to" in log and str(original) in log
        assert rx.post(body(alert({"alertname": "X", "job": "llm", "instance": "a"}))).status_code == 200
        page = httpx.get(f"{rx.url}/", timeout=10).text
        assert "was started afresh" in page and original.name in page


def test_serve_refuses_another_programs_database(tmp_path):
    path = tmp_path / "recorder.db"
    before = _foreign_db(path)
    result = runner.invoke(app, ["triage", "serve", "--db", str(path), "--no-diagnosis"])
    assert result.exit_code == 2 and "refusing to touch another program's database" in result.output
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["recorder.db"]


@pytest.mark.process
def test_no_diagnosis_is_said_on_startup_incident_ticket_and_page(tmp_path):
    github = GitHub()
    path = tmp_path / "triage.db"
    db = connect(path)
    with transaction(db):  # an incident left waiting by an earlier run that diagnosed
        lifecycle.apply(db, lifecycle.Policy(), payload.parse(FIXTURE.read_bytes()), 1000.0)
    db.close()
    args = ("--no-diagnosis", "--hold-down", "1h", "--github-repo", "acme/incidents", "--github-url", github.url)
    try:
        with receiver(path, *args, env={"GITHUB_TOKEN": "gh-token"}) as rx:
            assert "diagnosis off (--no-diagnosis)" in rx.log.read_text()
            assert rx.post(body(alert({"alertname": "X", "job": "llm", "instance": "a"}))).status_code == 200
            wait_until(lambda: github.issues)  # the new incident's ticket (the earlier one had no sink configured)
            rows = httpx.get(f"{rx.url}/api/incidents", timeout=10).json()
            assert sorted((r["id"], r["diag_state"]) for r in rows) == [(1, "off"), (2, "off")]
            (issue,) = github.issues.values()
            assert "not diagnosed (--no-diagnosis)" in issue["body"] and "still running" not in issue["body"]
            page = httpx.get(f"{rx.url}/", timeout=10).text
            assert page.count("not diagnosed (--no-diagnosis)") == 2 and "diagnosing" not in page
            assert "Not diagnosed (--no-diagnosis)" in httpx.get(f"{rx.url}/incidents/2", timeout=10).text
            shown = runner.invoke(app, ["tickets", "show", "1", "--db", str(path)])
            assert "not diagnosed (--no-diagnosis)" in shown.output and "still running" not in shown.output
            listed = runner.invoke(app, ["tickets", "list", "--db", str(path)], env={"COLUMNS": "250"})
            assert listed.output.count("not diagnosed (--no-diagnosis)") == 2
    finally:
        github.close()


@pytest.mark.parametrize(
    ("option", "value", "accepted"),
    [
        ("--hold-down", "5q", ["5m", "90s", "1h"]),
        ("--reopen-window", "soon", ["24h", "12h", "7d"]),
        ("--flap-window", "0", ["1h", "30m", "2h"]),
        ("--lookback", "-5m", ["30m", "1h", "90m"]),
        ("--correlate-window", "later", ["30m", "10m", "1h"]),
        ("--max-body", "1GiB", ["1MiB", "256KiB", "8MiB"]),
        ("--max-body", "lots", ["1MiB", "256KiB", "8MiB"]),
    ],
)
def test_duration_and_size_options_name_themselves_and_suggest_what_they_accept(tmp_path, option, value, accepted):
    result = runner.invoke(app, ["triage", "serve", "--db", str(tmp_path / "t.db"), "--no-diagnosis", option, value])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = result.output.strip()
    assert line.startswith(f"diag: {option} {value!r}:")
    for example in accepted:  # every suggestion is itself accepted
        ok = runner.invoke(app, ["triage", "serve", "--db", str(tmp_path / "t.db"), "--listen", "x", option, example])
        assert "--listen" in ok.output and option not in ok.output  # got past this option, stopped at the next check
        assert example in line


def _defaults(**overrides: object) -> dict:
    """``serve``'s options at their defaults (as Typer would pass them), with some overridden."""
    import inspect

    from diag.cli.triage import serve

    opts = {}
    for name, param in inspect.signature(serve).parameters.items():
        default = param.default
        opts[name] = getattr(default, "default", default)
    return {**opts, **overrides}


def test_joining_and_the_ticket_hold_reach_the_policy(tmp_path):
    from diag.cli.triage import _serve_config

    recorder = tmp_path / "recorder.db"
    recorder.write_bytes(b"")
    diagnosing = _serve_config(**_defaults(db=tmp_path / "t.db", recorder=recorder, listen="127.0.0.1:0")).policy
    assert diagnosing.correlate_labels == ("instance", "model|model_name")
    assert (diagnosing.correlate_window_s, diagnosing.ticket_hold_s) == (1800.0, 120.0)
    blind = _serve_config(**_defaults(db=tmp_path / "t.db", no_diagnosis=True, correlate_labels="none")).policy
    assert (blind.correlate_labels, blind.ticket_hold_s) == ((), 0.0)  # no diagnosis: nothing to wait for
