"""Ticket sinks: GitHub Issues and Jira (REST v2), the few endpoints the outbox needs.

Exactly one ticket per incident, even when the receiver dies between "the tracker created it" and
"we stored its id": every ticket carries a marker label (``llmdiag-<key>-g<generation>``) and the
outbox asks ``find(marker)`` before ``create``. That lookup is a label filter (GitHub's issue list,
Jira's JQL ``labels =``), which is consistent immediately -- GitHub's full-text search is not.

Endpoints used (and nothing else):
- GitHub: ``GET /repos/{o}/{r}/issues?labels=M&state=all``, ``POST /repos/{o}/{r}/issues``,
  ``POST /repos/{o}/{r}/issues/{n}/comments``, ``PATCH /repos/{o}/{r}/issues/{n}`` (state, state_reason).
- Jira: ``POST /rest/api/2/search`` (JQL), ``POST /rest/api/2/issue``, ``POST /rest/api/2/issue/{k}/comment``,
  ``GET|POST /rest/api/2/issue/{k}/transitions``.
Tokens come from the environment and are never logged or stored.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Protocol

import httpx

TIMEOUT_S = 10.0


class SinkError(RuntimeError):
    """The tracker did not do what was asked (down, refused, rate-limited): retry later."""


@dataclass(frozen=True)
class Ticket:
    external_id: str
    url: str


class Sink(Protocol):
    name: str

    def find(self, marker: str) -> Ticket | None: ...
    def create(self, marker: str, title: str, body: str) -> Ticket: ...
    def comment(self, external_id: str, body: str) -> None: ...
    def close(self, external_id: str, *, wontfix: bool) -> None: ...
    def reopen(self, external_id: str) -> None: ...


def _check(resp: httpx.Response, what: str) -> httpx.Response:
    if resp.status_code >= 300:
        raise SinkError(f"{what}: HTTP {resp.status_code} {resp.text[:200]!r}")
    return resp


class _Http:
    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=TIMEOUT_S, trust_env=False)

    def call(self, method: str, path: str, what: str, **kwargs: object) -> httpx.Response:
        try:
            return _check(self.client.request(method, path, **kwargs), what)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            raise SinkError(f"{what}: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        self.client.close()


class GitHubSink:
    name = "github"

    def __init__(self, repo: str, token: str, api_url: str = "https://api.github.com") -> None:
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise ValueError(f"--github-repo {repo!r}: expected OWNER/NAME")
        self.repo = repo
        headers = {"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": "2022-11-28"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.http = _Http(api_url, headers)

    def find(self, marker: str) -> Ticket | None:
        resp = self.http.call(
            "GET", f"/repos/{self.repo}/issues", "GitHub issue lookup", params={"labels": marker, "state": "all"}
        )
        issues = resp.json()
        if not isinstance(issues, list):
            raise SinkError("GitHub issue lookup: not a list")
        if not issues:
            return None
        first = min(issues, key=lambda i: int(i["number"]))
        return Ticket(str(first["number"]), str(first.get("html_url", "")))

    def create(self, marker: str, title: str, body: str) -> Ticket:
        resp = self.http.call(
            "POST", f"/repos/{self.repo}/issues", "GitHub issue create", json={"title": title, "body": body, "labels": [marker]}
        )
        issue = resp.json()
        return Ticket(str(issue["number"]), str(issue.get("html_url", "")))

    def comment(self, external_id: str, body: str) -> None:
        self.http.call("POST", f"/repos/{self.repo}/issues/{external_id}/comments", "GitHub comment", json={"body": body})

    def close(self, external_id: str, *, wontfix: bool) -> None:
        reason = "not_planned" if wontfix else "completed"
        self.http.call(
            "PATCH", f"/repos/{self.repo}/issues/{external_id}", "GitHub close", json={"state": "closed", "state_reason": reason}
        )

    def reopen(self, external_id: str) -> None:
        self.http.call(
            "PATCH",
            f"/repos/{self.repo}/issues/{external_id}",
            "GitHub reopen",
            json={"state": "open", "state_reason": "reopened"},
        )


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
    ) -> None:
        if not project:
            raise ValueError("--jira-project is required with --jira-url")
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
        self.http = _Http(self.base, headers)

    def find(self, marker: str) -> Ticket | None:
        jql = f'project = "{self.project}" AND labels = "{marker}" ORDER BY created ASC'
        resp = self.http.call("POST", "/rest/api/2/search", "Jira lookup", json={"jql": jql, "fields": ["key"], "maxResults": 1})
        issues = resp.json().get("issues") or []
        if not issues:
            return None
        key = str(issues[0]["key"])
        return Ticket(key, f"{self.base}/browse/{key}")

    def create(self, marker: str, title: str, body: str) -> Ticket:
        fields = {
            "project": {"key": self.project},
            "summary": title[:250],
            "description": body,
            "issuetype": {"name": self.issue_type},
            "labels": [marker],
        }
        key = str(self.http.call("POST", "/rest/api/2/issue", "Jira create", json={"fields": fields}).json()["key"])
        return Ticket(key, f"{self.base}/browse/{key}")

    def comment(self, external_id: str, body: str) -> None:
        self.http.call("POST", f"/rest/api/2/issue/{external_id}/comment", "Jira comment", json={"body": body})

    def _transition(self, external_id: str, name: str) -> None:
        found = self.http.call("GET", f"/rest/api/2/issue/{external_id}/transitions", "Jira transitions").json()
        for t in found.get("transitions") or []:
            if str(t.get("name", "")).lower() == name.lower():
                self.http.call(
                    "POST",
                    f"/rest/api/2/issue/{external_id}/transitions",
                    "Jira transition",
                    json={"transition": {"id": t["id"]}},
                )
                return
        names = ", ".join(str(t.get("name")) for t in found.get("transitions") or [])
        raise SinkError(f"Jira issue {external_id} offers no transition {name!r} (it offers: {names or 'none'})")

    def close(self, external_id: str, *, wontfix: bool) -> None:
        """Closes through the configured transition either way (the won't-fix reason is in the comment that follows):
        which resolution a transition sets is the Jira workflow's business, not something REST v2 lets us pick."""
        self._transition(external_id, self.resolve_transition)

    def reopen(self, external_id: str) -> None:
        self._transition(external_id, self.reopen_transition)
