"""``diag triage serve`` refuses bad options before starting (one line, exit 2); ``diag tickets list|show|close``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from diag.cli import app
from diag.triage import lifecycle, payload
from diag.triage.store import connect, transaction
from tests.triage.helpers import FIXTURE

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
