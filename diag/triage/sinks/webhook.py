"""A generic JSON webhook: one POST per ticket action, for bridges into ServiceNow, PagerDuty, Keep or anything
else that takes JSON.

There is no lookup: the body's ``dedup_key`` (the incident's marker, stable for its whole life) is what the
receiving side deduplicates on, and the ``Idempotency-Key`` header is the same on every retry of one action, so a
retry after a lost answer can be recognised. The body (``llmdiag.ticket.v1``, documented in the README):

    {"schema": "llmdiag.ticket.v1", "action": "create|comment|close|reopen|diagnosis",
     "incident_id": 12, "key": "...", "generation": 1, "dedup_key": "llmdiag-…-g1",
     "title": "...", "text": "...", "status": "open", "resolution": null, "severity": "page",
     "class": "queue_backlog", "diagnosis_state": "done", "labels": {...},
     "links": {"incident": "...", "source": "...", "runbook": "..."}}

A 2xx answer is success; an answer to ``create`` may carry JSON ``{"id": ..., "url": ...}`` naming the record it
made, which is then shown as the incident's ticket. Errors follow the same rules as the trackers' (base module).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from diag.triage.sinks.base import Http, Notice, Ticket
from diag.triage.sinks.text import plain

SCHEMA = "llmdiag.ticket.v1"


def payload(notice: Notice) -> dict[str, Any]:
    inc = notice.incident
    return {
        "schema": SCHEMA,
        "action": notice.action,
        "incident_id": inc.get("id"),
        "key": inc.get("key"),
        "generation": inc.get("generation"),
        "dedup_key": notice.marker,
        "title": notice.title,
        "text": plain(notice.doc),
        "status": inc.get("status"),
        "resolution": inc.get("resolution"),
        "severity": inc.get("severity") or None,
        "class": inc.get("class"),
        "diagnosis_state": inc.get("diagnosis_state"),
        "labels": inc.get("labels") or {},
        "links": dict(notice.links),
    }


class WebhookSink:
    name = "webhook"
    lookup_settle_s = 0.0

    def __init__(self, url: str, token: str = "") -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--ticket-webhook-url {url!r}: an http(s) URL, e.g. https://bridge.example/llm-diag")
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        origin = f"{parts.scheme}://{parts.netloc}"
        self.path = url[len(origin) :] or "/"
        self.http = Http(origin, headers)

    def find(self, marker: str) -> Ticket | None:
        return None  # the receiving side deduplicates on dedup_key

    def _post(self, notice: Notice) -> Any:
        headers = {"Idempotency-Key": notice.idempotency_key}
        resp = self.http.call("POST", self.path, f"webhook {notice.action}", json=payload(notice), headers=headers)
        try:
            return resp.json() if resp.content else None
        except ValueError:
            return None  # an answer that is not JSON is fine: the 2xx is what counts

    def create(self, notice: Notice) -> Ticket:
        answer = self._post(notice)
        if isinstance(answer, dict) and answer.get("id") not in (None, ""):
            return Ticket(str(answer["id"]), str(answer.get("url") or ""))
        return Ticket(notice.marker, "")

    def comment(self, ticket: Ticket, notice: Notice) -> None:
        self._post(notice)

    def close(self, ticket: Ticket, notice: Notice) -> None:
        self._post(notice)

    def reopen(self, ticket: Ticket, notice: Notice) -> None:
        self._post(notice)
