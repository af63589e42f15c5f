"""The Jira sink against local servers speaking Jira Cloud's REST v3 as of 2025 (CHANGE-2046: the old search
endpoints answer 410 Gone) and Jira Data Center 10.x's REST v2 (``tests/triage/wire_jira.py``): which API is used
is chosen from the server's own ``serverInfo``, asked once; Cloud gets Atlassian Document Format and the enhanced
search, Data Center wiki markup and ``/rest/api/2/search``; a deployment forced wrongly fails for good and shows
it, instead of retrying forever; a lost create is found again despite Cloud's lagging search."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from diag.triage.outbox import Dispatcher, marker
from diag.triage.sinks import JiraSink, Notice
from diag.triage.sinks.text import adf, code, link, para, text
from diag.triage.store import get_incident
from tests.triage.ticketkit import Crash, DiesAfterCreate, drain, fire, outbox, resolve, store, wait_until
from tests.triage.wire_jira import JiraCloud, JiraDataCenter, adf_problems, adf_text

pytestmark = pytest.mark.process

EMAIL, CLOUD_TOKEN = "bot@example.com", "cloud-token"


@pytest.fixture
def cloud():
    server = JiraCloud()
    yield server
    server.close()


@pytest.fixture
def datacenter():
    server = JiraDataCenter()
    yield server
    server.close()


def cloud_sink(server: JiraCloud, **kw) -> JiraSink:
    return JiraSink(server.url, "OPS", user=EMAIL, token=CLOUD_TOKEN, **kw)


def old_search_calls(server) -> list:
    return [r for r in server.requests if r.path in ("/rest/api/2/search", "/rest/api/3/search")]


def test_cloud_is_chosen_from_server_info_and_gets_adf_and_the_enhanced_search(tmp_path, cloud):
    db, policy, path = store(tmp_path, ("jira",))
    d = Dispatcher(path, {"jira": cloud_sink(cloud)}, page_url="http://triage.local:9095", start=False)
    fire(db, policy, 100.0, summary="KV cache\nfull", description="pages *evicted* <fast>")
    drain(d)
    (issue,) = cloud.issues.values()
    assert issue["summary"] == "[llm-diag] KV cache full (alertname=KVCachePressure job=llm instance=10.0.0.5:8000)"
    description = issue["description"]
    assert adf_problems(description) == []
    nodes = json.dumps(description)
    assert '{"type": "text", "text": "alertname=KVCachePressure", "marks": [{"type": "code"}]}' in nodes
    assert '"href": "http://triage.local:9095/incidents/1"' in nodes  # a link mark, not a bare string
    assert "pages *evicted* <fast>" in adf_text(description)  # text stays text: no markup leaks into ADF
    assert issue["labels"] == [marker(db.execute("SELECT * FROM incidents").fetchone())]

    resolve(db, policy, 100.0, 200.0)
    drain(d)
    assert issue["status"] == "Done" and adf_problems(issue["comments"][-1]) == []
    assert "Resolved" in adf_text(issue["comments"][-1])
    fire(db, policy, 300.0)
    drain(d)
    assert issue["status"] == "To Do" and "reopened" in adf_text(issue["comments"][-1])

    assert len(cloud.seen("GET", "/rest/api/2/serverInfo")) == 1  # asked once, on first use
    assert old_search_calls(cloud) == []  # the removed search (410 on Cloud) is never reached
    assert [r.method for r in cloud.seen(path_prefix="/rest/api/3/search/jql")] == ["POST"]
    assert {r.path.split("/")[3] for r in cloud.requests if r.path.startswith("/rest/api/") and "serverInfo" not in r.path} == {
        "3"
    }
    assert len(cloud.issues) == 1
    d.close()
    db.close()


@pytest.mark.parametrize("deployment_type", ["DataCenter", "Server"])
def test_data_center_is_chosen_from_server_info_and_gets_v2_and_wiki_markup(tmp_path, deployment_type):
    dc = JiraDataCenter(deployment_type=deployment_type)
    db, policy, path = store(tmp_path, ("jira",))
    d = Dispatcher(path, {"jira": JiraSink(dc.url, "OPS", token="dc-pat")}, page_url="http://triage.local:9095", start=False)
    try:
        fire(db, policy, 100.0, summary="KV cache full", description="pages [evicted] {fast}")
        drain(d)
        (issue,) = dc.issues.values()
        assert isinstance(issue["description"], str)
        assert "{{alertname=KVCachePressure}}" in issue["description"]
        assert "[http://triage.local:9095/incidents/1|http://triage.local:9095/incidents/1]" in issue["description"]
        assert r"pages \[evicted\] \{fast\}" in issue["description"]  # alert text cannot inject markup
        resolve(db, policy, 100.0, 200.0)
        drain(d)
        assert issue["status"] == "Done" and isinstance(issue["comments"][-1], str)
        fire(db, policy, 300.0)
        drain(d)
        assert issue["status"] == "To Do"
        assert [r.path for r in dc.requests if r.path.startswith("/rest/api/3")] == []
        assert len(dc.seen("POST", "/rest/api/2/search")) == 1
        assert len(dc.seen("GET", "/rest/api/2/serverInfo")) == 1
    finally:
        d.close()
        db.close()
        dc.close()


def test_a_cloud_server_refuses_a_plain_string_description_as_the_real_one_does(cloud):
    auth = httpx.BasicAuth(EMAIL, CLOUD_TOKEN)
    fields = {"project": {"key": "OPS"}, "summary": "s", "issuetype": {"name": "Bug"}, "description": "plain text"}
    r = httpx.post(f"{cloud.url}/rest/api/3/issue", json={"fields": fields}, auth=auth)
    assert r.status_code == 400 and "Atlassian Document" in r.text
    fields["description"] = adf((para(text("ok "), code("a=b"), link("x", "https://x.test")),))
    assert httpx.post(f"{cloud.url}/rest/api/3/issue", json={"fields": fields}, auth=auth).status_code == 201
    assert httpx.post(f"{cloud.url}/rest/api/2/search", json={"jql": "project = OPS"}, auth=auth).status_code == 410


def test_datacenter_forced_on_cloud_fails_for_good_and_says_so(tmp_path, cloud):
    db, policy, path = store(tmp_path, ("jira",))
    d = Dispatcher(path, {"jira": cloud_sink(cloud, deployment="datacenter")}, base_backoff_s=0.01, start=False)
    fire(db, policy, 100.0)
    resolve(db, policy, 100.0, 200.0)
    drain(d)
    drain(d)
    create, close = outbox(db)
    assert create["failed_at"] is not None and create["done_at"] is None
    assert "HTTP 410" in create["last_error"] and "search/jql" in create["last_error"]
    assert close["failed_at"] is not None and "never created" in close["last_error"]
    assert len(old_search_calls(cloud)) == 1  # one refusal, not a retry loop
    assert cloud.issues == {}
    view = get_incident(db, 1)
    assert view is not None and [f["action"] for f in view.ticket_failures] == ["create", "close"]
    (event,) = [e for e in view.events if e["kind"] == "ticket_failed"]
    assert "jira create failed, not retried" in event["text"] and "410" in event["text"]
    d.close()
    db.close()


def test_cloud_forced_on_data_center_fails_for_good(tmp_path, datacenter):
    db, policy, path = store(tmp_path, ("jira",))
    d = Dispatcher(path, {"jira": JiraSink(datacenter.url, "OPS", token="dc-pat", deployment="cloud")}, start=False)
    fire(db, policy, 100.0)
    drain(d)
    (create,) = outbox(db)
    assert create["failed_at"] is not None and "HTTP 404" in create["last_error"]
    assert datacenter.seen("GET", "/rest/api/2/serverInfo") == []  # forced: not asked
    d.close()
    db.close()


def test_a_server_info_outage_is_retried_like_any_sink_error(tmp_path, cloud):
    cloud.fail(503, times=2, when=lambda r: r.path.endswith("/serverInfo"), headers={"Retry-After": "0"})
    db, policy, path = store(tmp_path, ("jira",))
    d = Dispatcher(path, {"jira": cloud_sink(cloud)}, base_backoff_s=0.01)
    try:
        fire(db, policy, time.time())
        wait_until(lambda: db.execute("SELECT COUNT(*) FROM tickets").fetchone()[0] == 1)
        assert len(cloud.seen("GET", "/rest/api/2/serverInfo")) == 3
        (create,) = outbox(db)
        assert create["attempts"] == 3 and create["failed_at"] is None
    finally:
        d.close()
        db.close()


def test_cloud_lookup_follows_next_page_token_and_takes_the_oldest(cloud):
    sink = cloud_sink(cloud)
    notice = Notice("create", "llmdiag-abc-g1", "t", (para(text("b")),))
    first = sink.create(notice)
    sink.create(notice)  # a second issue with the same marker (made by hand, say)
    cloud.page_size = 1
    assert sink.find("llmdiag-abc-g1") == first
    tokens = [r.body.get("nextPageToken") for r in cloud.seen("POST", "/rest/api/3/search/jql")]
    assert tokens == [None, "1"]


def test_close_repeated_after_it_went_through_is_done_not_an_error(cloud):
    sink = cloud_sink(cloud)
    ticket = sink.create(Notice("create", "m", "t", (para(text("b")),)))
    sink.close(ticket, Notice("close", "m", "t", ()))
    sink.close(ticket, Notice("close", "m", "t", ()))  # a retry: "Done" is no longer offered, the issue is done
    assert cloud.issues[ticket.external_id]["status"] == "Done"


def test_a_create_lost_in_a_crash_is_found_once_cloud_search_has_caught_up(tmp_path):
    cloud = JiraCloud(search_lag_s=1.0)  # a new issue stays invisible to the enhanced search for 1 s
    db, policy, path = store(tmp_path, ("jira",))
    try:
        fire(db, policy, time.time())
        dying = Dispatcher(path, {"jira": DiesAfterCreate(cloud_sink(cloud, settle_s=2.0))}, start=False)
        with pytest.raises(Crash):
            dying.drain_once()
        assert len(cloud.issues) == 1 and db.execute("SELECT COUNT(*) FROM tickets").fetchone()[0] == 0
        restarted = Dispatcher(path, {"jira": cloud_sink(cloud, settle_s=2.0)}, base_backoff_s=0.01)
        try:
            wait_until(lambda: db.execute("SELECT COUNT(*) FROM tickets").fetchone()[0] == 1, timeout_s=20)
        finally:
            restarted.close()
        assert len(cloud.issues) == 1  # found, not created again
        assert db.execute("SELECT external_id FROM tickets").fetchone()[0] == "OPS-1"
        texts = [r[0] for r in db.execute("SELECT text FROM events WHERE kind = 'ticket'")]
        assert texts == ["jira ticket OPS-1 found (created before a restart)"]
    finally:
        db.close()
        cloud.close()


def test_tokens_go_in_headers_only(tmp_path, cloud, caplog):
    cloud.fail(400, doc={"errorMessages": ["nope"], "errors": {}}, when=lambda r: r.path == "/rest/api/3/issue")
    db, policy, path = store(tmp_path, ("jira",))
    d = Dispatcher(path, {"jira": cloud_sink(cloud)}, start=False)
    with caplog.at_level("DEBUG"):
        fire(db, policy, 100.0)
        drain(d)
    stored = json.dumps(
        [dict(r) for r in db.execute("SELECT * FROM outbox")] + [dict(r) for r in db.execute("SELECT * FROM events")]
    )
    assert "nope" in stored and CLOUD_TOKEN not in stored and CLOUD_TOKEN not in caplog.text
    d.close()
    db.close()
