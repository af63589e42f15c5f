"""How the outbox treats what trackers answer, against the wire-level stand-ins (GitHub REST 2022-11-28, GitLab 17.x
REST v4, Jira Cloud REST v3 and Data Center 10.x REST v2 -- see ``tests/triage/wire_*.py``):

- a permanent refusal (4xx other than 408/409/429) stops the retries: the action is marked failed, not deleted,
  and the failure is on the incident -- an event, ``diag tickets show`` (text and ``--json``), ``/api/incidents/ID``
  and the page; the actions after a failed create are marked failed without a request; ``diag tickets retry``
  queues them again;
- 429 waits as long as ``Retry-After`` says (seconds or an HTTP date);
- 5xx is retried with backoff until it succeeds;
- the receiver dying between "the tracker created it" and "we stored its id" still yields one ticket, for every
  sink that has a lookup.
"""

from __future__ import annotations

import email.utils
import json
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from diag.cli.main import app
from diag.triage.lifecycle import Policy
from diag.triage.outbox import Dispatcher
from diag.triage.server import Receiver, ReceiverConfig
from diag.triage.sinks import GitHubSink, GitLabSink, JiraSink
from diag.triage.store import connect
from tests.triage.helpers import alert, body
from tests.triage.ticketkit import LABELS, Crash, DiesAfterCreate, drain, fire, outbox, resolve, store, wait_until
from tests.triage.wire_github import GitHub
from tests.triage.wire_gitlab import GitLab
from tests.triage.wire_jira import JiraCloud, JiraDataCenter

pytestmark = pytest.mark.process

runner = CliRunner()


@pytest.fixture
def github():
    server = GitHub()
    yield server
    server.close()


def test_a_permanent_refusal_stops_and_is_shown_on_the_incident_the_cli_the_api_and_the_page(tmp_path, github):
    github.fail(404, times=1, doc={"message": "Not Found", "status": "404"}, when=lambda r: r.method == "POST")
    config = ReceiverConfig(
        host="127.0.0.1", port=0, db=tmp_path / "triage.db", policy=Policy(hold_down_s=0, sinks=("github",)),
        sinks={"github": GitHubSink("acme/incidents", "gh-token", github.url)},
    )  # fmt: skip
    rx = Receiver(config)
    threading.Thread(target=rx.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{rx.port}"
    db = connect(config.db)
    try:
        assert httpx.post(f"{url}/webhook", json=body(alert(LABELS, starts=100.0)), timeout=10).status_code == 200
        wait_until(lambda: outbox(db)[0]["failed_at"])
        assert httpx.post(f"{url}/webhook", json=body(alert(LABELS, "resolved", starts=100.0)), timeout=10).status_code == 200
        wait_until(lambda: len(outbox(db)) == 2 and outbox(db)[1]["failed_at"])
        assert len(github.seen("POST")) == 1 and github.issues == {}
        idle = Dispatcher(config.db, config.sinks, start=False)
        assert idle.due(time.time() + 10**9) == []  # nothing of it will ever be due again
        idle.close()
        create, close = outbox(db)
        assert create["done_at"] is None and "HTTP 404: Not Found" in create["last_error"]
        assert close["done_at"] is None and "never created" in close["last_error"]

        api = httpx.get(f"{url}/api/incidents/1", timeout=10).json()
        assert [(f["sink"], f["action"]) for f in api["ticket_failures"]] == [("github", "create"), ("github", "close")]
        assert any(e["kind"] == "ticket_failed" and "404" in e["text"] for e in api["events"])
        detail = httpx.get(f"{url}/incidents/1", timeout=10).text
        assert "github create\nfailed, not retried" in detail and "HTTP 404: Not Found" in detail
        assert "diag tickets retry 1" in detail
        assert "ticket failed" in httpx.get(f"{url}/", timeout=10).text
        assert httpx.get(f"{url}/api/incidents", timeout=10).json()[0]["ticket_failures"] == 2

        shown = runner.invoke(app, ["tickets", "show", "1", "--db", str(config.db)])
        assert shown.exit_code == 0 and "Ticket failed, not retried: github create" in shown.output
        as_json = json.loads(runner.invoke(app, ["tickets", "show", "1", "--db", str(config.db), "--json"]).output)
        assert as_json["ticket_failures"][0]["error"].startswith("GitHub issue create: HTTP 404")
        listed = runner.invoke(app, ["tickets", "list", "--db", str(config.db)], env={"COLUMNS": "200"})
        assert "ticket failed" in listed.output

        # the cause is gone (the injected 404 was used up): a person queues the actions again
        retried = runner.invoke(app, ["tickets", "retry", "1", "--db", str(config.db)])
        assert retried.exit_code == 0 and "2 failed ticket action(s) queued again" in retried.output
        wait_until(lambda: all(r["done_at"] for r in outbox(db)))
        (issue,) = github.issues.values()
        assert issue["state"] == "closed" and httpx.get(f"{url}/api/incidents/1", timeout=10).json()["ticket_failures"] == []
    finally:
        db.close()
        rx.close()


@pytest.mark.parametrize("retry_after", ["7", "date"])
def test_429_waits_as_long_as_retry_after_says(tmp_path, github, retry_after):
    value = email.utils.formatdate(time.time() + 30, usegmt=True) if retry_after == "date" else retry_after
    github.fail(429, headers={"Retry-After": value}, doc={"message": "slow down"})
    db, policy, path = store(tmp_path, ("github",))
    d = Dispatcher(path, {"github": GitHubSink("acme/incidents", "gh-token", github.url)}, base_backoff_s=0.01, start=False)
    fire(db, policy, 100.0)
    before = time.time()
    drain(d)
    after = time.time()
    (row,) = outbox(db)
    assert row["failed_at"] is None and "429" in row["last_error"]
    # Judged against the clock readings either side of the attempt, not against a fixed slack around one of them:
    # the request, its parse and the store write fall somewhere between, and on a loaded host that can take longer
    # than a fixed half second. A wait misread (the 10 ms backoff instead, a second short, seconds taken for
    # minutes) lands outside.
    if retry_after == "date":  # that instant (the date has whole seconds), give or take the time the attempt took
        due = email.utils.parsedate_to_datetime(value).timestamp()
        assert due - (after - before) <= row["next_at"] <= due + (after - before), (row["next_at"], due, after - before)
    else:  # 7 s from the moment it failed
        assert before + 7 <= row["next_at"] <= after + 7, (row["next_at"] - before, after - before)
    drain(d)
    assert len(github.requests) == 1  # not before that
    d.close()
    db.close()


def test_429_then_the_retry_after_passes_and_the_ticket_is_made(tmp_path, github):
    github.fail(429, headers={"Retry-After": "1"}, doc={"message": "slow down"})
    db, policy, path = store(tmp_path, ("github",))
    d = Dispatcher(path, {"github": GitHubSink("acme/incidents", "gh-token", github.url)}, base_backoff_s=0.01)
    try:
        fire(db, policy, time.time())
        wait_until(lambda: github.issues)
        first, *rest = github.requests
        later = next(r for r in rest if r.method == "GET")
        assert later.at - first.at >= 1.0  # the 10 ms backoff would have come back at once
    finally:
        d.close()
        db.close()


def test_5xx_is_retried_until_it_succeeds(tmp_path, github):
    for status in (500, 502, 503):
        github.fail(status, when=lambda r: r.method == "POST")
    db, policy, path = store(tmp_path, ("github",))
    d = Dispatcher(path, {"github": GitHubSink("acme/incidents", "gh-token", github.url)}, base_backoff_s=0.02)
    try:
        fire(db, policy, time.time())
        resolve(db, policy, time.time(), time.time())
        wait_until(lambda: all(r["done_at"] for r in outbox(db)))
        create, _close = outbox(db)
        assert create["attempts"] == 4 and create["failed_at"] is None and create["last_error"] is None
        assert len(github.issues) == 1 and github.issues[1]["state"] == "closed"
    finally:
        d.close()
        db.close()


def _github():
    server = GitHub()
    return server, lambda: GitHubSink("acme/incidents", "gh-token", server.url), lambda: len(server.issues)


def _gitlab():
    server = GitLab()
    return server, lambda: GitLabSink(server.url, "ops/llm-incidents", "gl-token"), lambda: len(server.issues)


def _jira_dc():
    server = JiraDataCenter()
    return server, lambda: JiraSink(server.url, "OPS", token="dc-pat", settle_s=0.5), lambda: len(server.issues)


def _jira_cloud():
    server = JiraCloud(search_lag_s=0.5)
    sink = lambda: JiraSink(server.url, "OPS", user="bot@example.com", token="cloud-token", settle_s=1.0)  # noqa: E731
    return server, sink, lambda: len(server.issues)


@pytest.mark.parametrize("tracker", [_github, _gitlab, _jira_dc, _jira_cloud], ids=["github", "gitlab", "jira-dc", "jira-cloud"])
def test_a_crash_between_create_and_store_still_yields_one_ticket(tmp_path, tracker):
    server, make_sink, count = tracker()
    name = make_sink().name
    db, policy, path = store(tmp_path, (name,))
    try:
        fire(db, policy, time.time())
        resolve(db, policy, time.time(), time.time())
        with pytest.raises(Crash):
            drain(Dispatcher(path, {name: DiesAfterCreate(make_sink())}, start=False))
        assert count() == 1 and not db.execute("SELECT COUNT(*) FROM tickets").fetchone()[0]
        restarted = Dispatcher(path, {name: make_sink()}, base_backoff_s=0.01)
        try:
            wait_until(lambda: all(r["done_at"] for r in outbox(db)))
        finally:
            restarted.close()
        assert count() == 1
        assert "found (created before a restart)" in db.execute("SELECT text FROM events WHERE kind = 'ticket'").fetchone()[0]
    finally:
        db.close()
        server.close()
