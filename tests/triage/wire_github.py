"""GitHub Issues at the wire, following the GitHub REST API version 2022-11-28 (docs.github.com/rest/issues):
``X-GitHub-Api-Version`` must name a supported version (400 otherwise); ``Authorization: Bearer`` (or ``token``)
checked (401 "Bad credentials"); ``GET /repos/{o}/{r}/issues`` filters by ``labels`` and ``state`` (default
``open``) and, as the real endpoint does, also returns pull requests (marked by a ``pull_request`` key);
``POST .../issues`` needs a title and creates labels of at most 50 characters (422 otherwise) and returns the
issue with label objects; ``POST .../issues/{n}/comments`` needs a body; ``PATCH .../issues/{n}`` takes
``state`` open|closed and ``state_reason`` completed|not_planned|reopened (422 otherwise); an unknown repository
is 404 "Not Found".
"""

from __future__ import annotations

import re
from typing import Any

from tests.triage.wire import Answer, Request, WireServer

VERSIONS = ("2022-11-28", "2026-03-10")
DOCS = "https://docs.github.com/rest"


class GitHub(WireServer):
    def __init__(self, repo: str = "acme/incidents", *, token: str = "gh-token") -> None:
        super().__init__()
        self.repo = repo
        self.token = token
        self.issues: dict[int, dict[str, Any]] = {}

    def _invalid(self, field: str, code: str = "invalid") -> Answer:
        return Answer(422, {"message": "Validation Failed", "errors": [{"resource": "Issue", "field": field, "code": code}],
                            "documentation_url": DOCS, "status": "422"})  # fmt: skip

    def add_pull_request(self, labels: list[str]) -> None:
        number = len(self.issues) + 1
        pull = {"url": f"{self.url}/pulls/{number}"}
        self.issues[number] = {"number": number, "title": "a pull request", "labels": [{"name": x} for x in labels],
                               "state": "open", "pull_request": pull, "comments": []}  # fmt: skip

    def route(self, req: Request) -> Answer:
        if req.headers.get("x-github-api-version", VERSIONS[0]) not in VERSIONS:
            return Answer(400, {"message": "Unsupported 'X-GitHub-Api-Version' header", "status": "400"})
        auth = req.headers.get("authorization", "")
        if auth not in (f"Bearer {self.token}", f"token {self.token}"):
            return Answer(401, {"message": "Bad credentials", "documentation_url": DOCS, "status": "401"})
        m = re.fullmatch(r"/repos/([^/]+/[^/]+)/issues(?:/(\d+))?(/comments)?", req.path)
        if not m or m.group(1) != self.repo:
            return Answer(404, {"message": "Not Found", "documentation_url": DOCS, "status": "404"})
        number = int(m.group(2)) if m.group(2) else None
        if number is None and req.method == "GET":
            return self.list(req)
        if number is None and req.method == "POST":
            return self.create(req)
        issue = self.issues.get(number or 0)
        if issue is None:
            return Answer(404, {"message": "Not Found", "status": "404"})
        if m.group(3) and req.method == "POST":
            if bad := self.json_body_required(req):
                return bad
            if not req.body.get("body"):
                return self._invalid("body", "missing_field")
            issue["comments"].append(req.body["body"])
            return Answer(201, {"id": len(issue["comments"]), "body": req.body["body"]})
        if not m.group(3) and req.method == "PATCH":
            return self.update(req, issue)
        return Answer(404, {"message": "Not Found", "status": "404"})

    def list(self, req: Request) -> Answer:
        state = req.query.get("state", "open")
        if state not in ("open", "closed", "all"):
            return self._invalid("state")
        wanted = [x for x in req.query.get("labels", "").split(",") if x]
        found = [
            i for i in self.issues.values()
            if (state == "all" or i["state"] == state) and all(w in [x["name"] for x in i["labels"]] for w in wanted)
        ]  # fmt: skip
        found.sort(key=lambda i: i["number"], reverse=req.query.get("direction", "desc") == "desc")
        return Answer(200, found[: int(req.query.get("per_page", 30))])

    def create(self, req: Request) -> Answer:
        if bad := self.json_body_required(req):
            return bad
        if not req.body.get("title"):
            return self._invalid("title", "missing_field")
        labels = req.body.get("labels") or []
        if any(not isinstance(x, str) or not 0 < len(x) <= 50 for x in labels):
            return self._invalid("labels")
        number = len(self.issues) + 1
        self.issues[number] = {
            "number": number, "html_url": f"https://github.test/{self.repo}/issues/{number}", "title": req.body["title"],
            "body": req.body.get("body") or "", "labels": [{"name": x} for x in labels], "state": "open",
            "state_reason": None, "comments": [],
        }  # fmt: skip
        return Answer(201, self.issues[number])

    def update(self, req: Request, issue: dict[str, Any]) -> Answer:
        if bad := self.json_body_required(req):
            return bad
        state = req.body.get("state", issue["state"])
        reason = req.body.get("state_reason")
        if state not in ("open", "closed") or reason not in (None, "completed", "not_planned", "reopened", "duplicate"):
            return self._invalid("state_reason" if state in ("open", "closed") else "state")
        issue["state"], issue["state_reason"] = state, reason
        return Answer(200, issue)

    def by_label(self, label: str) -> list[dict[str, Any]]:
        return [i for i in self.issues.values() if label in [x["name"] for x in i["labels"]] and "pull_request" not in i]
