"""GitLab Issues at the wire, following the GitLab 17.x REST API v4 (docs.gitlab.com/api/issues, /api/notes):
``PRIVATE-TOKEN`` checked (401 "401 Unauthorized"); the project is its numeric id or its URL-encoded path
(``group%2Fproject``; an unencoded slash does not match the route, 404); ``GET /projects/:id/issues`` filters by
``labels`` (comma-separated, all must match), ``state`` opened|closed|all and ``scope`` (values validated, 400
"... does not have a valid value"); ``POST /projects/:id/issues`` needs a title (400 "title is missing") and
takes ``labels`` as a comma-separated string, returning ``iid`` and ``web_url``; ``POST
/projects/:id/issues/:iid/notes`` needs a body; ``PUT /projects/:id/issues/:iid`` takes ``state_event``
close|reopen.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from tests.triage.wire import Answer, Request, WireServer


class GitLab(WireServer):
    def __init__(self, project: str = "ops/llm-incidents", *, project_id: int = 42, token: str = "gl-token") -> None:
        super().__init__()
        self.project = project
        self.project_id = project_id
        self.token = token
        self.issues: dict[int, dict[str, Any]] = {}

    @staticmethod
    def _invalid(name: str) -> Answer:
        return Answer(400, {"error": f"{name} does not have a valid value"})

    def route(self, req: Request) -> Answer:
        if req.headers.get("private-token") != self.token:
            return Answer(401, {"message": "401 Unauthorized"})
        m = re.fullmatch(r"/api/v4/projects/([^/]+)/issues(?:/(\d+))?(/notes)?", req.raw_path)
        if not m or unquote(m.group(1)) not in (self.project, str(self.project_id)):
            return Answer(404, {"message": "404 Project Not Found"})
        iid = int(m.group(2)) if m.group(2) else None
        if iid is None:
            return self.list(req) if req.method == "GET" else self.create(req) if req.method == "POST" else Answer(405)
        issue = self.issues.get(iid)
        if issue is None:
            return Answer(404, {"message": "404 Not found"})
        if m.group(3) and req.method == "POST":
            if not isinstance(req.body, dict) or not req.body.get("body"):
                return Answer(400, {"error": "body is missing"})
            issue["notes"].append(req.body["body"])
            return Answer(201, {"id": len(issue["notes"]), "body": req.body["body"], "noteable_iid": iid})
        if not m.group(3) and req.method == "PUT":
            event = (req.body or {}).get("state_event")
            if event not in ("close", "reopen"):
                return self._invalid("state_event")
            issue["state"] = "closed" if event == "close" else "opened"
            return Answer(200, issue)
        return Answer(405, {"message": "405 Method Not Allowed"})

    def list(self, req: Request) -> Answer:
        state = req.query.get("state", "all")
        if state not in ("opened", "closed", "all"):
            return self._invalid("state")
        if req.query.get("scope", "all") not in ("created_by_me", "assigned_to_me", "created-by-me", "assigned-to-me", "all"):
            return self._invalid("scope")
        wanted = [x for x in req.query.get("labels", "").split(",") if x]
        found = [
            i for i in self.issues.values() if (state == "all" or i["state"] == state) and all(w in i["labels"] for w in wanted)
        ]
        found.sort(key=lambda i: i["iid"], reverse=req.query.get("sort", "desc") == "desc")
        return Answer(200, found[: int(req.query.get("per_page", 20))])

    def create(self, req: Request) -> Answer:
        if not isinstance(req.body, dict) or not req.body.get("title"):
            return Answer(400, {"error": "title is missing"})
        labels = req.body.get("labels") or ""
        if not isinstance(labels, str):
            labels = ",".join(labels)
        iid = len(self.issues) + 1
        self.issues[iid] = {
            "id": 9000 + iid, "iid": iid, "project_id": self.project_id, "title": req.body["title"],
            "description": req.body.get("description") or "", "state": "opened",
            "labels": [x.strip() for x in labels.split(",") if x.strip()],
            "web_url": f"https://gitlab.test/{self.project}/-/issues/{iid}", "notes": [],
        }  # fmt: skip
        return Answer(201, self.issues[iid])
