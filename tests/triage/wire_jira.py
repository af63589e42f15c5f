"""Jira at the wire, in the two forms the sink must tell apart.

``JiraCloud`` follows the Jira Cloud platform REST API v3 as of 2025, after Atlassian CHANGE-2046:
``GET /rest/api/{2,3}/serverInfo`` says ``deploymentType: Cloud``; ``/rest/api/2/search`` and
``/rest/api/3/search`` answer 410 Gone with Atlassian's migration message; ``GET|POST /rest/api/3/search/jql``
is the enhanced search (bounded JQL only, ``nextPageToken`` paging, only issue ids unless ``fields`` are asked
for, and eventually consistent: a new issue can stay invisible for a while, ``search_lag_s`` here);
``POST /rest/api/3/issue`` and ``.../comment`` take Atlassian Document Format only -- a plain-string description
or comment is a 400, as on the real service, and the ADF is checked against the schema's rules for the nodes
used (doc version 1, non-empty text nodes, known marks, a list item starting with a paragraph); a summary with
a line break is a 400; Basic authentication with e-mail and API token.

``JiraDataCenter`` follows Jira Data Center 10.x REST API v2: ``serverInfo`` says ``DataCenter`` (or ``Server``),
``POST /rest/api/2/search`` pages with ``startAt``/``total``, descriptions and comments are wiki-markup strings
(an object is a 400), there is no ``/rest/api/3`` (404); Bearer personal access tokens.

Both: ``GET|POST /rest/api/N/issue/{key}/transitions`` offers the transitions that lead away from the current
status (To Do, In Progress, Done), ``GET /rest/api/N/issue/{key}?fields=status`` gives the status category.
"""

from __future__ import annotations

import base64
import re
import time
from typing import Any

from tests.triage.wire import Answer, Request, WireServer

REMOVED = (
    "The requested API has been removed. Please migrate to the /rest/api/3/search/jql API. A full migration guideline"
    " is available at https://developer.atlassian.com/changelog/#CHANGE-2046"
)
STATUSES = {"To Do": "new", "In Progress": "indeterminate", "Done": "done"}
TRANSITIONS = {"11": "To Do", "21": "In Progress", "31": "Done"}
_INLINE_MARKS = {"code", "strong", "em", "link", "strike", "underline"}


def adf_problems(doc: Any) -> list[str]:
    """What the real service would refuse in an ADF document, for the nodes a ticket uses."""
    problems: list[str] = []
    if not isinstance(doc, dict) or doc.get("type") != "doc" or doc.get("version") != 1:
        return ["not an ADF document (type doc, version 1)"]

    def inline(node: Any, where: str) -> None:
        if not isinstance(node, dict) or node.get("type") not in ("text", "hardBreak"):
            problems.append(f"{where}: inline node {node!r:.60} not allowed")
            return
        if node["type"] == "text":
            if not isinstance(node.get("text"), str) or not node["text"]:
                problems.append(f"{where}: empty text node")
            marks = node.get("marks") or []
            kinds = [m.get("type") for m in marks if isinstance(m, dict)]
            if len(kinds) != len(marks) or set(kinds) - _INLINE_MARKS or len(set(kinds)) != len(kinds):
                problems.append(f"{where}: bad marks {marks!r}")
            if "code" in kinds and set(kinds) - {"code", "link"}:
                problems.append(f"{where}: code combined with {kinds}")
            for m in marks:
                if m.get("type") == "link" and not str((m.get("attrs") or {}).get("href", "")):
                    problems.append(f"{where}: link without href")

    def block(node: Any, where: str) -> None:
        kind = node.get("type") if isinstance(node, dict) else None
        if kind == "paragraph":
            for child in node.get("content") or []:
                inline(child, where + "/paragraph")
        elif kind == "bulletList":
            items = node.get("content") or []
            if not items:
                problems.append(f"{where}: empty bulletList")
            for it in items:
                content = it.get("content") if isinstance(it, dict) and it.get("type") == "listItem" else None
                if not content:
                    problems.append(f"{where}: bulletList holds {it!r:.60}")
                    continue
                if content[0].get("type") != "paragraph":
                    problems.append(f"{where}: a listItem must start with a paragraph")
                for child in content:
                    block(child, where + "/listItem")
        else:
            problems.append(f"{where}: block node {kind!r} not expected")

    content = doc.get("content")
    if not isinstance(content, list):
        return ["doc without content"]
    for node in content:
        block(node, "doc")
    return problems


def adf_text(doc: dict[str, Any]) -> str:
    """The text of an ADF document (for assertions)."""
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "text":
                out.append(node["text"])
            for child in node.get("content") or []:
                walk(child)
            if node.get("type") in ("paragraph", "listItem"):
                out.append("\n")

    walk(doc)
    return "".join(out)


class _Jira(WireServer):
    api = "2"
    deployment = ""

    def __init__(self, project: str = "OPS", *, auth: str) -> None:
        super().__init__()
        self.project = project
        self.auth = auth
        self.issues: dict[str, dict[str, Any]] = {}

    def _error(self, status: int, field: str = "", message: str = "") -> Answer:
        return Answer(status, {"errorMessages": [message] if message else [], "errors": {field: message} if field else {}})

    def route(self, req: Request) -> Answer:
        if req.headers.get("authorization") != self.auth:
            return Answer(
                401, {"errorMessages": ["You are not authenticated. Authentication required to perform this operation."]}
            )
        if re.fullmatch(r"/rest/api/(2|3)/serverInfo", req.path):
            return self.server_info()
        if re.fullmatch(r"/rest/api/(2|3|latest)/search", req.path):
            return self.old_search(req)
        if re.fullmatch(r"/rest/api/(2|3)/search/jql", req.path):
            return self.new_search(req)
        m = re.fullmatch(r"/rest/api/(\d)/issue(?:/([A-Z][A-Z0-9_]*-\d+))?(/comment|/transitions)?", req.path)
        if not m:
            return self._error(404, message=f"No resource at {req.path}")
        if m.group(1) not in self.supported_versions():
            return Answer(404, {"message": "null for uri"})
        key, sub = m.group(2), m.group(3)
        if key is None:
            return self.create(req, m.group(1)) if req.method == "POST" else self._error(405)
        issue = self.issues.get(key)
        if issue is None:
            return self._error(404, message="Issue does not exist or you do not have permission to see it.")
        if sub == "/comment" and req.method == "POST":
            return self.comment(req, issue, m.group(1))
        if sub == "/transitions":
            return self.transitions(req, issue)
        if sub is None and req.method == "GET":
            status = {"name": issue["status"], "statusCategory": {"key": STATUSES[issue["status"]]}}
            return Answer(200, {"id": issue["id"], "key": key, "fields": {"status": status}})
        return self._error(405)

    # ----------------------------------------------------------------- overridden per deployment

    def supported_versions(self) -> tuple[str, ...]:
        raise NotImplementedError

    def server_info(self) -> Answer:
        raise NotImplementedError

    def old_search(self, req: Request) -> Answer:
        raise NotImplementedError

    def new_search(self, req: Request) -> Answer:
        raise NotImplementedError

    def check_text(self, value: Any, field: str, version: str) -> Answer | None:
        raise NotImplementedError

    # ----------------------------------------------------------------- shared behaviour

    def matching(self, jql: str, now: float, lag_s: float = 0.0) -> list[dict[str, Any]]:
        project = re.search(r'project = "([^"]+)"', jql)
        label = re.search(r'labels = "([^"]+)"', jql)
        found = [
            i for i in self.issues.values()
            if (project is None or i["project"] == project.group(1)) and (label is None or label.group(1) in i["labels"])
            and now - i["created"] >= lag_s
        ]  # fmt: skip
        return sorted(found, key=lambda i: int(i["id"]))

    def bean(self, issue: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
        return {"id": issue["id"], "key": issue["key"], "self": f"{self.url}/rest/api/{self.api}/issue/{issue['id']}",
                "fields": {f: issue.get(f) for f in fields or []}}  # fmt: skip

    def create(self, req: Request, version: str) -> Answer:
        if bad := self.json_body_required(req):
            return bad
        fields = req.body.get("fields") or {}
        if (fields.get("project") or {}).get("key") != self.project:
            return self._error(400, "project", "valid project is required")
        summary = fields.get("summary")
        if not isinstance(summary, str) or not summary.strip():
            return self._error(400, "summary", "You must specify a summary of the issue.")
        if "\n" in summary or "\r" in summary:
            return self._error(400, "summary", "The summary is invalid because it contains newline characters.")
        if len(summary) > 255:
            return self._error(400, "summary", "Summary must be less than 255 characters.")
        if (fields.get("issuetype") or {}).get("name") not in ("Bug", "Task", "Incident"):
            return self._error(400, "issuetype", "valid issue type is required")
        labels = fields.get("labels") or []
        if any(not isinstance(x, str) or " " in x or len(x) > 255 for x in labels):
            return self._error(400, "labels", "The label can't contain spaces.")
        if bad := self.check_text(fields.get("description"), "description", version):
            return bad
        number = len(self.issues) + 1
        key = f"{self.project}-{number}"
        self.issues[key] = {
            "id": str(10000 + number), "key": key, "project": self.project, "summary": summary,
            "description": fields.get("description"), "labels": list(labels), "status": "To Do", "comments": [],
            "created": time.monotonic(),
        }  # fmt: skip
        return Answer(
            201, {"id": str(10000 + number), "key": key, "self": f"{self.url}/rest/api/{version}/issue/{10000 + number}"}
        )

    def comment(self, req: Request, issue: dict[str, Any], version: str) -> Answer:
        if bad := self.json_body_required(req):
            return bad
        if bad := self.check_text(req.body.get("body"), "comment", version):
            return bad
        issue["comments"].append(req.body["body"])
        return Answer(201, {"id": str(len(issue["comments"])), "body": req.body["body"]})

    def transitions(self, req: Request, issue: dict[str, Any]) -> Answer:
        offered = {k: v for k, v in TRANSITIONS.items() if v != issue["status"]}
        if req.method == "GET":
            return Answer(200, {"transitions": [{"id": k, "name": v, "to": {"name": v}} for k, v in offered.items()]})
        if bad := self.json_body_required(req):
            return bad
        wanted = str((req.body.get("transition") or {}).get("id"))
        if wanted not in offered:
            return self._error(400, message=f"Transition id '{wanted}' is not valid for this issue.")
        issue["status"] = offered[wanted]
        return Answer(204)


class JiraCloud(_Jira):
    """Jira Cloud, REST v3 as of 2025 (CHANGE-2046 applied). See the module docstring."""

    api = "3"

    def __init__(self, project: str = "OPS", *, email: str = "bot@example.com", token: str = "cloud-token",
                 search_lag_s: float = 0.0, page_size: int = 50) -> None:  # fmt: skip
        super().__init__(project, auth="Basic " + base64.b64encode(f"{email}:{token}".encode()).decode())
        self.search_lag_s = search_lag_s
        self.page_size = page_size

    def supported_versions(self) -> tuple[str, ...]:
        return ("2", "3")

    def server_info(self) -> Answer:
        return Answer(200, {"baseUrl": self.url, "version": "1001.0.0-SNAPSHOT", "versionNumbers": [1001, 0, 0],
                            "deploymentType": "Cloud", "buildNumber": 100290, "serverTitle": "Jira"})  # fmt: skip

    def old_search(self, req: Request) -> Answer:
        return Answer(410, {"errorMessages": [REMOVED], "errors": {}})

    def new_search(self, req: Request) -> Answer:
        args: dict[str, Any] = dict(req.query) if req.method == "GET" else dict(req.body or {})
        jql = str(args.get("jql") or "")
        if not re.search(r"\b(project|labels|key|issue)\s*(=|in)", jql):
            return Answer(
                400, {"errorMessages": ["Unbounded JQL queries are not allowed here. Please add a search restriction."]}
            )
        fields = args.get("fields")
        if isinstance(fields, str):
            fields = fields.split(",")
        size = min(int(args.get("maxResults") or 50), self.page_size)
        start = int(args.get("nextPageToken") or 0)  # an opaque token to the client
        found = self.matching(jql, time.monotonic(), self.search_lag_s)
        page = found[start : start + size]
        more = start + size < len(found)
        doc: dict[str, Any] = {"issues": [self.bean(i, fields) if fields else {"id": i["id"]} for i in page], "isLast": not more}
        if more:
            doc["nextPageToken"] = str(start + size)
        return Answer(200, doc)

    def check_text(self, value: Any, field: str, version: str) -> Answer | None:
        if version == "2":
            return (
                None if value is None or isinstance(value, str) else self._error(400, field, "Operation value must be a string")
            )
        if value is None:
            return None
        if not isinstance(value, dict):
            return self._error(400, field, "Operation value must be an Atlassian Document (see the Atlassian Document Format)")
        problems = adf_problems(value)
        return self._error(400, field, "; ".join(problems)) if problems else None


class JiraDataCenter(_Jira):
    """Jira Data Center 10.x, REST v2. See the module docstring."""

    def __init__(self, project: str = "OPS", *, token: str = "dc-pat", deployment_type: str = "DataCenter",
                 page_size: int = 50) -> None:  # fmt: skip
        super().__init__(project, auth=f"Bearer {token}")
        self.deployment_type = deployment_type
        self.page_size = page_size

    def supported_versions(self) -> tuple[str, ...]:
        return ("2",)

    def server_info(self) -> Answer:
        return Answer(200, {"baseUrl": self.url, "version": "10.3.4", "versionNumbers": [10, 3, 4],
                            "deploymentType": self.deployment_type, "buildNumber": 10030004, "serverTitle": "Jira"})  # fmt: skip

    def old_search(self, req: Request) -> Answer:
        if not req.path.startswith("/rest/api/2/"):
            return Answer(404, {"message": "null for uri"})
        args: dict[str, Any] = dict(req.query) if req.method == "GET" else dict(req.body or {})
        start = int(args.get("startAt") or 0)
        size = min(int(args.get("maxResults") or 50), self.page_size)
        found = self.matching(str(args.get("jql") or ""), time.monotonic())
        fields = args.get("fields") or ["summary"]
        return Answer(200, {"startAt": start, "maxResults": size, "total": len(found),
                            "issues": [self.bean(i, fields) for i in found[start : start + size]]})  # fmt: skip

    def new_search(self, req: Request) -> Answer:
        return Answer(404, {"message": "null for uri"})

    def check_text(self, value: Any, field: str, version: str) -> Answer | None:
        if value is None or isinstance(value, str):
            return None
        return self._error(400, field, "Operation value must be a string")
