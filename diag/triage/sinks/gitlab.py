"""GitLab Issues (REST API v4, as in GitLab 17.x), the endpoints the outbox needs and nothing else.

- lookup: ``GET /api/v4/projects/{id}/issues?labels=MARKER&scope=all&state=all`` -- a label filter on the
  project's issue list (a database query, consistent at once);
- ``POST /api/v4/projects/{id}/issues`` (title, description in Markdown, labels: the marker; GitLab creates the
  label) -> 201 with ``iid`` and ``web_url``;
- ``POST /api/v4/projects/{id}/issues/{iid}/notes`` -> 201;
- ``PUT /api/v4/projects/{id}/issues/{iid}`` with ``state_event`` ``close`` or ``reopen`` -> 200 (repeating it
  is harmless, so a retry after a lost answer is safe).

The project is its numeric id or its path (``group/sub/project``), sent URL-encoded as the API requires.
Authentication: the ``PRIVATE-TOKEN`` header (a personal, group or project access token with ``api`` scope).
GitLab has no "won't fix" state: such a close is an ordinary close whose note says so.
"""

from __future__ import annotations

from urllib.parse import quote

from diag.triage.sinks.base import Http, Notice, SinkError, Ticket, field_of, one_line
from diag.triage.sinks.text import markdown

TITLE_LIMIT = 255
BODY_LIMIT = 1_000_000  # GitLab's limit is 1 048 576 characters


def project_ref(project: str) -> str:
    """The ``:id`` path segment: a numeric id as is, a path URL-encoded (``group%2Fproject``), once."""
    project = project.strip().strip("/")
    if not project:
        raise ValueError("--gitlab-project: give the project's numeric id or its path, e.g. group/llm-incidents")
    if project.isdigit() or "%2F" in project.upper():
        return project
    return quote(project, safe="")


class GitLabSink:
    name = "gitlab"
    lookup_settle_s = 0.0

    def __init__(self, url: str, project: str, token: str) -> None:
        self.project = project_ref(project)
        headers = {"Accept": "application/json"}
        if token:
            headers["PRIVATE-TOKEN"] = token
        self.http = Http(url.rstrip("/") + "/api/v4", headers)
        self.base = f"/projects/{self.project}/issues"

    def find(self, marker: str) -> Ticket | None:
        params = {"labels": marker, "scope": "all", "state": "all", "order_by": "created_at", "sort": "asc", "per_page": 100}
        issues = self.http.json("GET", self.base, "GitLab issue lookup", params=params)
        if not isinstance(issues, list):
            raise SinkError("GitLab issue lookup: the answer is not a list: not the documented API", permanent=True)
        found = [i for i in issues if isinstance(i, dict) and "iid" in i]
        if not found:
            return None
        first = min(found, key=lambda i: int(i["iid"]))
        return Ticket(str(first["iid"]), str(first.get("web_url") or ""))

    def create(self, notice: Notice) -> Ticket:
        body = {
            "title": one_line(notice.title, TITLE_LIMIT),
            "description": markdown(notice.doc)[:BODY_LIMIT],
            "labels": notice.marker,
        }
        issue = self.http.json("POST", self.base, "GitLab issue create", json=body)
        return Ticket(str(field_of(issue, "iid", "GitLab issue create")), str(issue.get("web_url") or ""))

    def comment(self, ticket: Ticket, notice: Notice) -> None:
        if notice.doc:
            body = {"body": markdown(notice.doc)[:BODY_LIMIT]}
            self.http.call("POST", f"{self.base}/{ticket.external_id}/notes", "GitLab note", json=body)

    def close(self, ticket: Ticket, notice: Notice) -> None:
        self.http.call("PUT", f"{self.base}/{ticket.external_id}", "GitLab close", json={"state_event": "close"})
        self.comment(ticket, notice)

    def reopen(self, ticket: Ticket, notice: Notice) -> None:
        self.http.call("PUT", f"{self.base}/{ticket.external_id}", "GitLab reopen", json={"state_event": "reopen"})
        self.comment(ticket, notice)
