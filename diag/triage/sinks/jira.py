"""Jira, Cloud and Data Center: the same tickets through the API each one has.

Which one: the server says so itself -- ``GET /rest/api/2/serverInfo`` answers ``deploymentType`` ``Cloud``, or
``Server`` / ``DataCenter`` for a self-hosted Jira. It is asked once, on first use (a failure there is a sink
error like any other, retried while it is transient); ``--jira-deployment cloud|datacenter`` skips the question.

Jira Cloud (REST v3):
- lookup: ``POST /rest/api/3/search/jql`` -- the enhanced search, paginated by ``nextPageToken``. The older
  ``/rest/api/2/search`` and ``/rest/api/3/search`` answer 410 Gone on Cloud since 2025 (Atlassian CHANGE-2046).
  This search is eventually consistent: an issue created seconds ago may not be found yet, so after a create
  whose answer was lost the outbox waits ``lookup_settle_s`` before it trusts "not found" (see outbox);
- ``POST /rest/api/3/issue`` and ``POST /rest/api/3/issue/{key}/comment`` with descriptions and comments in
  Atlassian Document Format (a plain string is a 400 there);
- authentication: Basic with the account's e-mail ($JIRA_USER) and an API token.

Jira Data Center / Server (REST v2): ``POST /rest/api/2/search`` (JQL, ``startAt`` paging), ``POST
/rest/api/2/issue``, ``POST /rest/api/2/issue/{key}/comment`` with wiki-markup text; Bearer with a personal
access token, or Basic with a user.

Both: the marker label is found with ``labels = "<marker>"``; closing and reopening use the transitions named by
``--jira-resolve-transition`` / ``--jira-reopen-transition`` (``GET|POST .../issue/{key}/transitions``). When
the named transition is not offered because the issue is already where it would lead (a retry after the
transition went through), that counts as done; otherwise it is a permanent error -- the workflow has no such
transition, and retrying cannot add one.
"""

from __future__ import annotations

import base64
from typing import Any

from diag.triage.sinks.base import Http, Notice, SinkError, Ticket, field_of, one_line
from diag.triage.sinks.text import adf, jira_wiki

DEPLOYMENTS = ("auto", "cloud", "datacenter")
SUMMARY_LIMIT = 255
PAGE_SIZE = 50
MAX_PAGES = 20
CLOUD_SETTLE_S = 30.0  # how long a new issue may stay invisible to Cloud's enhanced search
DATACENTER_SETTLE_S = 10.0  # a Data Center cluster replicates its index between nodes asynchronously


def _jql_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class JiraSink:
    name = "jira"

    def __init__(
        self,
        url: str,
        project: str,
        *,
        user: str = "",
        token: str = "",
        issue_type: str = "Bug",
        resolve_transition: str = "Done",
        reopen_transition: str = "To Do",
        deployment: str = "auto",
        settle_s: float | None = None,
    ) -> None:
        if not project:
            raise ValueError("--jira-project is required with --jira-url")
        if deployment not in DEPLOYMENTS:
            raise ValueError(f"--jira-deployment {deployment!r}: expected one of {', '.join(DEPLOYMENTS)}")
        headers = {"Accept": "application/json"}
        if user and token:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()
        elif token:
            headers["Authorization"] = f"Bearer {token}"
        self.project = project
        self.issue_type = issue_type
        self.resolve_transition = resolve_transition
        self.reopen_transition = reopen_transition
        self.base = url.rstrip("/")
        self.http = Http(self.base, headers)
        self._deployment = None if deployment == "auto" else deployment
        self._settle_s = settle_s

    # ------------------------------------------------------------------ which Jira

    @property
    def deployment(self) -> str:
        """``cloud`` or ``datacenter``, from ``serverInfo`` the first time it is needed."""
        if self._deployment is None:
            info = self.http.json("GET", "/rest/api/2/serverInfo", "Jira serverInfo")
            kind = str(info.get("deploymentType", "")) if isinstance(info, dict) else ""
            if kind == "Cloud":
                self._deployment = "cloud"
            elif kind in ("Server", "DataCenter"):
                self._deployment = "datacenter"
            else:
                raise SinkError(
                    f"Jira serverInfo: deploymentType {kind or '(none)'!r} is neither Cloud nor Server/DataCenter;"
                    " pass --jira-deployment cloud or datacenter",
                    permanent=True,
                )
        return self._deployment

    @property
    def lookup_settle_s(self) -> float:
        if self._settle_s is not None:
            return self._settle_s
        return CLOUD_SETTLE_S if self.deployment == "cloud" else DATACENTER_SETTLE_S

    @property
    def api(self) -> str:
        return "/rest/api/3" if self.deployment == "cloud" else "/rest/api/2"

    def _text(self, notice: Notice) -> Any:
        return adf(notice.doc) if self.deployment == "cloud" else jira_wiki(notice.doc)

    def _ticket(self, key: str) -> Ticket:
        return Ticket(key, f"{self.base}/browse/{key}")

    # ------------------------------------------------------------------ lookup

    def _search_pages(self, jql: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        if self.deployment == "cloud":
            token: str | None = None
            for _ in range(MAX_PAGES):
                body: dict[str, Any] = {"jql": jql, "fields": ["created"], "maxResults": PAGE_SIZE}
                if token:
                    body["nextPageToken"] = token
                page = self.http.json("POST", "/rest/api/3/search/jql", "Jira search", json=body)
                found += [i for i in (page.get("issues") or []) if isinstance(i, dict)]
                token = page.get("nextPageToken")
                if not token or page.get("isLast", False):
                    break
            return found
        start = 0
        for _ in range(MAX_PAGES):
            body = {"jql": jql, "fields": ["created"], "maxResults": PAGE_SIZE, "startAt": start}
            page = self.http.json("POST", "/rest/api/2/search", "Jira search", json=body)
            issues = [i for i in (page.get("issues") or []) if isinstance(i, dict)]
            found += issues
            start += len(issues)
            if not issues or start >= int(page.get("total") or 0):
                break
        return found

    def find(self, marker: str) -> Ticket | None:
        jql = f"project = {_jql_string(self.project)} AND labels = {_jql_string(marker)} ORDER BY created ASC"
        issues = [i for i in self._search_pages(jql) if i.get("key") or i.get("id")]
        if not issues:
            return None
        first = min(issues, key=lambda i: int(i["id"]) if str(i.get("id", "")).isdigit() else 1 << 62)
        return self._ticket(str(first.get("key") or first["id"]))

    # ------------------------------------------------------------------ actions

    def create(self, notice: Notice) -> Ticket:
        fields = {
            "project": {"key": self.project},
            "summary": one_line(notice.title, SUMMARY_LIMIT),
            "description": self._text(notice),
            "issuetype": {"name": self.issue_type},
            "labels": [notice.marker],
        }
        issue = self.http.json("POST", f"{self.api}/issue", "Jira create", json={"fields": fields})
        return self._ticket(str(field_of(issue, "key", "Jira create")))

    def comment(self, ticket: Ticket, notice: Notice) -> None:
        if notice.doc:
            path = f"{self.api}/issue/{ticket.external_id}/comment"
            self.http.call("POST", path, "Jira comment", json={"body": self._text(notice)})

    def _status_category(self, key: str) -> str:
        issue = self.http.json("GET", f"{self.api}/issue/{key}", "Jira issue status", params={"fields": "status"})
        status = ((issue.get("fields") or {}).get("status") or {}) if isinstance(issue, dict) else {}
        return str((status.get("statusCategory") or {}).get("key") or "")

    def _transition(self, key: str, name: str, *, done_when_closed: bool) -> None:
        found = self.http.json("GET", f"{self.api}/issue/{key}/transitions", "Jira transitions")
        offered = [t for t in found.get("transitions") or [] if isinstance(t, dict)]
        for t in offered:
            if str(t.get("name", "")).lower() == name.lower():
                body = {"transition": {"id": str(t["id"])}}
                self.http.call("POST", f"{self.api}/issue/{key}/transitions", "Jira transition", json=body)
                return
        if (self._status_category(key) == "done") == done_when_closed:
            return  # already where the transition leads: an earlier attempt went through
        names = ", ".join(str(t.get("name")) for t in offered)
        raise SinkError(f"Jira issue {key} offers no transition {name!r} (it offers: {names or 'none'}); set"
                        f" --jira-{'resolve' if done_when_closed else 'reopen'}-transition", permanent=True)  # fmt: skip

    def close(self, ticket: Ticket, notice: Notice) -> None:
        """Closes through the configured transition either way (the won't-fix reason is in the comment that
        follows): which resolution a transition sets is the Jira workflow's business."""
        self._transition(ticket.external_id, self.resolve_transition, done_when_closed=True)
        self.comment(ticket, notice)

    def reopen(self, ticket: Ticket, notice: Notice) -> None:
        self._transition(ticket.external_id, self.reopen_transition, done_when_closed=False)
        self.comment(ticket, notice)
