"""GitHub Issues (REST API version 2022-11-28), the endpoints the outbox needs and nothing else.

- lookup: ``GET /repos/{owner}/{repo}/issues?labels=MARKER&state=all`` -- a label filter on the issue list,
  consistent at once (GitHub's full-text search is not); the list also returns pull requests, which are skipped;
- ``POST /repos/{owner}/{repo}/issues`` (title, body in Markdown, labels: the marker) -> 201;
- ``POST /repos/{owner}/{repo}/issues/{number}/comments`` -> 201;
- ``PATCH /repos/{owner}/{repo}/issues/{number}`` with ``state`` and ``state_reason`` (``completed``,
  ``not_planned`` for won't-fix, ``reopened``) -> 200.

Labels set on a new issue need push access: GitHub silently drops them otherwise, and then the marker lookup
cannot find the issue again, so the token must be allowed to label (fine-grained: Issues read/write).
"""

from __future__ import annotations

import re

from diag.triage.sinks.base import Http, Notice, SinkError, Ticket, field_of, one_line
from diag.triage.sinks.text import markdown

API_VERSION = "2022-11-28"
_REPO_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
TITLE_LIMIT = 256
BODY_LIMIT = 65_000  # GitHub refuses bodies over 65 536 characters


class GitHubSink:
    name = "github"
    lookup_settle_s = 0.0

    def __init__(self, repo: str, token: str, api_url: str = "https://api.github.com") -> None:
        if not _REPO_RE.match(repo):
            raise ValueError(f"--github-repo {repo!r}: expected OWNER/NAME")
        self.repo = repo
        headers = {"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": API_VERSION}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.http = Http(api_url, headers)

    def find(self, marker: str) -> Ticket | None:
        params = {"labels": marker, "state": "all", "sort": "created", "direction": "asc", "per_page": 100}
        issues = self.http.json("GET", f"/repos/{self.repo}/issues", "GitHub issue lookup", params=params)
        if not isinstance(issues, list):
            raise SinkError("GitHub issue lookup: the answer is not a list: not the documented API", permanent=True)
        found = [i for i in issues if isinstance(i, dict) and "pull_request" not in i and "number" in i]
        if not found:
            return None
        first = min(found, key=lambda i: int(i["number"]))
        return Ticket(str(first["number"]), str(first.get("html_url") or ""))

    def create(self, notice: Notice) -> Ticket:
        title = one_line(notice.title, TITLE_LIMIT)
        body = {"title": title, "body": markdown(notice.doc)[:BODY_LIMIT], "labels": [notice.marker]}
        issue = self.http.json("POST", f"/repos/{self.repo}/issues", "GitHub issue create", json=body)
        return Ticket(str(field_of(issue, "number", "GitHub issue create")), str(issue.get("html_url") or ""))

    def comment(self, ticket: Ticket, notice: Notice) -> None:
        if notice.doc:
            path = f"/repos/{self.repo}/issues/{ticket.external_id}/comments"
            self.http.call("POST", path, "GitHub comment", json={"body": markdown(notice.doc)[:BODY_LIMIT]})

    def _state(self, ticket: Ticket, state: str, reason: str, what: str) -> None:
        path = f"/repos/{self.repo}/issues/{ticket.external_id}"
        self.http.call("PATCH", path, what, json={"state": state, "state_reason": reason})  # idempotent: safe to repeat

    def close(self, ticket: Ticket, notice: Notice) -> None:
        self._state(ticket, "closed", "not_planned" if notice.wontfix else "completed", "GitHub close")
        self.comment(ticket, notice)

    def reopen(self, ticket: Ticket, notice: Notice) -> None:
        self._state(ticket, "open", "reopened", "GitHub reopen")
        self.comment(ticket, notice)
