"""The receiving end of the ticket webhook: the body documented in the README (``llmdiag.ticket.v1``), one POST per
action. It checks what a bridge relies on -- a JSON body with the documented fields, a ``dedup_key``, an
``Idempotency-Key`` header, the bearer token when one is configured -- and deduplicates on the idempotency key as
a bridge should (a repeated key is answered 200 and not applied twice). ``create`` is answered with the record it
made (``{"id", "url"}``), as a ServiceNow or Keep bridge would.
"""

from __future__ import annotations

from typing import Any

from tests.triage.wire import Answer, Request, WireServer

FIELDS = {
    "schema", "action", "incident_id", "key", "generation", "dedup_key", "title", "text", "status", "resolution",
    "severity", "class", "diagnosis_state", "labels", "links",
}  # fmt: skip
ACTIONS = ("create", "comment", "close", "reopen", "diagnosis")


class WebhookReceiver(WireServer):
    def __init__(self, *, token: str = "", path: str = "/hooks/llm-diag") -> None:
        super().__init__()
        self.token = token
        self.path = path
        self.applied: list[dict[str, Any]] = []
        self.keys: set[str] = set()

    def route(self, req: Request) -> Answer:
        if req.method != "POST" or req.path != self.path:
            return Answer(404, {"error": "no such hook"})
        if self.token and req.headers.get("authorization") != f"Bearer {self.token}":
            return Answer(401, {"error": "bad token"})
        if bad := self.json_body_required(req):
            return bad
        missing = FIELDS - set(req.body)
        if missing or req.body["schema"] != "llmdiag.ticket.v1" or req.body["action"] not in ACTIONS:
            return Answer(400, {"error": f"not a ticket notice (missing {sorted(missing)})"})
        key = req.headers.get("idempotency-key", "")
        if not key:
            return Answer(400, {"error": "Idempotency-Key header required"})
        if key in self.keys:
            return Answer(200, {"duplicate": True})
        self.keys.add(key)
        self.applied.append(req.body)
        if req.body["action"] == "create":
            return Answer(201, {"id": f"INC{len(self.applied):07d}", "url": f"https://itsm.test/incident/{len(self.applied)}"})
        return Answer(202)
