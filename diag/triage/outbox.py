"""The outbox dispatcher: replays queued ticket actions to the sinks, in order, until each succeeds or fails for good.

Why an outbox: the incident's state change and "tell the tracker" are written in the same SQLite
transaction (``lifecycle.enqueue``), so neither a crash nor a tracker outage can lose an action.
Actions of one incident on one sink are replayed strictly in order (create before comment before close);
different incidents and sinks do not wait for each other.

What a failed attempt does depends on what the tracker said (``sinks.base`` classifies it):
- transient (down, 5xx, network, 408/409): retried with exponential backoff and full jitter, capped;
- rate limited (429, GitHub's 403 rate limit): retried when the tracker says (``Retry-After``, seconds or an
  HTTP date, else ``X-RateLimit-Reset``);
- permanent (any other 4xx, a redirect, an answer that is not the API): not retried. The row is kept and
  marked failed with the error; an event on the incident says so, and the page, ``diag tickets show`` and
  ``/api/incidents/ID`` show it. ``diag tickets retry ID`` queues the incident's failed actions again once the
  cause is fixed.
  A failed ``create`` means the incident has no ticket in that tracker, so every later action of that incident
  on that sink cannot succeed either: each is marked failed ("the ticket was never created") when it comes up,
  without a request. A failed comment, close or reopen blocks nothing: the ticket exists, later actions go on.

Exactly one ticket even when an answer is lost: before a create is sent its row records ``sent_at``
(committed), and a ticket is looked up by its marker before any create. Trackers whose lookup lags behind
their writes (Jira's search index) say how long (``lookup_settle_s``): after a create that did not clearly
succeed (a crash, a timeout, a 5xx a proxy may have put in front of a success), "not found" is trusted only once
that long has passed since ``sent_at``; until then the attempt waits.

Ticket text is rendered when the action is sent, from the incident as it is then: a ticket created
after the diagnosis finished already says *why*, and the separate diagnosis note is skipped when
the ticket already states the current class.
"""

from __future__ import annotations

import json
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diag.triage.sinks import Notice, Sink, SinkError, Ticket
from diag.triage.sinks.text import Block, Bullets, Doc, Item, code, from_plain, link, para, plain, strong, text
from diag.triage.store import (
    CLAIM_LEASE_S,
    IncidentView,
    add_event,
    claim_outbox,
    connect,
    get_incident,
    row_transaction,
    transaction,
)

log = logging.getLogger(__name__)

BASE_BACKOFF_S = 1.0
MAX_BACKOFF_S = 600.0
BATCH = 50
NOT_DIAGNOSED = "not diagnosed (--no-diagnosis)"


class NoTicket(SinkError):
    """An action for a tracker in which the incident's ticket could not be created (its create failed for good)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=True)


def marker(row: Mapping[str, Any]) -> str:
    """The label that identifies an incident's ticket in the tracker (at most 50 characters, GitHub's limit)."""
    return f"llmdiag-{row['key'][:24]}-g{row['generation']}"


def backoff_s(attempts: int, base: float = BASE_BACKOFF_S, cap: float = MAX_BACKOFF_S) -> float:
    """Exponential with full jitter: retries of many incidents do not stampede a recovering tracker."""
    return random.uniform(0.5, 1.0) * min(cap, base * 2 ** min(attempts, 30))


def _evidence(doc: dict[str, Any], limit: int = 5) -> list[Item]:
    items = []
    for f in (doc.get("findings") or [])[:limit]:
        children = tuple(
            Item((text(f"{ev.get('what')}: {ev.get('value')} {ev.get('unit') or ''}".rstrip()),))
            for ev in (f.get("evidence") or [])[:4]
        )
        confidence = float(f.get("confidence") or 0)
        items.append(Item((strong(f.get("class")), text(f" ({confidence:.0%}): {f.get('summary', '')}")), children))
    return items


def diagnosis_doc(view: IncidentView) -> Doc:
    """What the diagnosis says -- or why there is none (still running, failed, or diagnosis turned off)."""
    doc = view.diagnosis
    row = view.row
    if doc is None:
        if row["diag_state"] == "off":
            return (para(text(f"Diagnosis: {NOT_DIAGNOSED}: the receiver runs without diagnosis.")),)
        if row["diag_state"] == "failed":
            return (para(text(f"Diagnosis failed: {row['diag_error']}")),)
        return (para(text("Diagnosis: still running (a note follows when it is done).")),)
    blocks: list[Block] = [para(text("Diagnosis: "), strong(row["diag_class"]))]
    check = doc.get("alert_check") or {}
    if check.get("text"):  # does it answer the alert: confirms, contradicts, or could not see what the alert saw
        blocks.append(para(text(f"Against the alert: {check['text']}")))
    verdict = doc.get("verdict")
    contributing = verdict.get("contributing") if isinstance(verdict, dict) else None
    if contributing:
        blocks.append(para(text(f"Contributing: {', '.join(str(c) for c in contributing)}")))
    evidence = _evidence(doc)
    if evidence:
        blocks.append(Bullets(tuple(evidence)))
    missing = [str(n.get("rule")) for n in doc.get("not_evaluated") or []]
    if missing:
        blocks.append(para(text(f"Not evaluated (data missing): {', '.join(missing)}")))
    return tuple(blocks)


def diagnosis_text(view: IncidentView) -> str:
    return plain(diagnosis_doc(view))


def incident_url(page_url: str, incident_id: int) -> str:
    return f"{page_url.rstrip('/')}/incidents/{incident_id}" if page_url else ""


def ticket_doc(view: IncidentView, page_url: str = "") -> Doc:
    """The body of a new ticket: what fired, where to look, and the diagnosis as it is now."""
    row = view.row
    labels = json.loads(row["labels"])
    annotations = json.loads(row["annotations"])
    blocks: list[Block] = [para(text(f"Incident {row['id']} ({row['status']}), opened by llm-diag triage."))]
    pairs = []
    for i, (k, v) in enumerate(sorted(labels.items())):
        pairs += ([text(", ")] if i else []) + [code(f"{k}={v}")]
    blocks.append(para(text("Labels: "), *pairs))
    if annotations.get("description"):
        blocks.append(para(text("description: "), text(annotations["description"])))
    for name in ("runbook_url", "dashboard_url"):
        if annotations.get(name):
            blocks.append(para(text(f"{name}: "), link(annotations[name], annotations[name])))
    if row["generator_url"]:
        blocks.append(para(text("Source: "), link(row["generator_url"], row["generator_url"])))
    if page_url:
        url = incident_url(page_url, row["id"])
        blocks.append(para(text("Incident page: "), link(url, url)))
    joined = [e["text"] for e in view.events if e["kind"] == "joined"]
    if joined:  # alerts about the same problem joined this incident before its ticket was filed
        blocks.append(para(text("Also raised by:")))
        blocks.append(Bullets(tuple(Item((text(j),)) for j in joined)))
    return tuple(blocks) + diagnosis_doc(view)


def _links(view: IncidentView, page_url: str) -> dict[str, str]:
    annotations = json.loads(view.row["annotations"])
    candidates = {
        "incident": incident_url(page_url, view.id),
        "source": view.row["generator_url"] or "",
        "runbook": str(annotations.get("runbook_url") or ""),
        "dashboard": str(annotations.get("dashboard_url") or ""),
    }
    return {k: v for k, v in candidates.items() if v.lower().startswith(("http://", "https://"))}


class Dispatcher:
    """A thread that drains the outbox into the configured sinks."""

    def __init__(
        self, path: str | Path, sinks: Mapping[str, Sink], *, page_url: str = "", base_backoff_s: float = BASE_BACKOFF_S,
        start: bool = True, claim_lease_s: float = CLAIM_LEASE_S,
    ) -> None:  # fmt: skip
        self.claim_lease_s = claim_lease_s
        self.sinks = dict(sinks)
        self.page_url = page_url
        self.base_backoff_s = base_backoff_s
        self._db = connect(path)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="triage-outbox", daemon=True)
        if start:  # start=False: the caller drives drain_once() itself
            self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._db.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.drain_once()
            except sqlite3.Error as exc:
                log.warning("triage: outbox read failed: %s", exc)
                busy = 0
            if not busy:
                self._wake.wait(0.5)
                self._wake.clear()

    def due(self, now: float) -> list[sqlite3.Row]:
        """The head of each (incident, sink) queue of a configured sink, when it is due (failed rows are out of line)."""
        if not self.sinks:
            return []
        names = tuple(sorted(self.sinks))
        marks = ", ".join("?" * len(names))
        return self._db.execute(
            "SELECT o.* FROM outbox o WHERE o.done_at IS NULL AND o.failed_at IS NULL AND o.next_at <= ?"
            " AND (o.claimed_until IS NULL OR o.claimed_until <= ?)"
            f" AND o.sink IN ({marks}) AND o.id = (SELECT MIN(p.id) FROM outbox p WHERE p.incident_id = o.incident_id"
            " AND p.sink = o.sink AND p.done_at IS NULL AND p.failed_at IS NULL) ORDER BY o.id LIMIT ?",
            (now, now, *names, BATCH),
        ).fetchall()

    def drain_once(self) -> int:
        """Send what is due once; returns how many actions were attempted."""
        rows = self.due(time.time())
        for row in rows:
            if self._stop.is_set():
                break
            # another receiver on the same store may have taken it since: only the claimant sends, and from the
            # row as it is now
            if not claim_outbox(self._db, row["id"], time.time(), self.claim_lease_s):
                continue
            fresh = self._db.execute("SELECT * FROM outbox WHERE id = ?", (row["id"],)).fetchone()
            if fresh is not None:
                self._send(fresh)
        return len(rows)

    def _send(self, row: sqlite3.Row) -> None:
        sink = self.sinks[row["sink"]]
        view = get_incident(self._db, row["incident_id"])
        assert view is not None  # foreign key
        try:
            finished = self._perform(sink, row, view)
        except SinkError as exc:
            self._attempt_failed(row, exc)
            return
        if not finished:
            with row_transaction(self._db) as db:
                self._finish(db, row["id"])

    def _attempt_failed(self, row: sqlite3.Row, exc: SinkError) -> None:
        what = f"{row['sink']} {row['action']} for incident {row['incident_id']}"
        now = time.time()
        if exc.permanent:
            if not isinstance(exc, NoTicket):
                log.error("triage: %s failed permanently, not retried: %s", what, exc)
            with row_transaction(self._db) as db:
                db.execute(
                    "UPDATE outbox SET attempts = attempts + 1, failed_at = ?, last_error = ?, claimed_until = NULL WHERE id = ?",
                    (now, str(exc)[:500], row["id"]),
                )
                if not isinstance(exc, NoTicket):  # the create's own event already says later actions are not sent
                    later = "; no later action for this incident is sent there" if row["action"] == "create" else ""
                    add_event(db, row["incident_id"], "ticket_failed",
                              f"{row['sink']} {row['action']} failed, not retried: {exc}{later}", now)  # fmt: skip
            return
        delay = exc.retry_after_s if exc.retry_after_s is not None else backoff_s(row["attempts"], self.base_backoff_s)
        log.warning("triage: %s failed (retry in %.0fs): %s", what, delay, exc)
        with row_transaction(self._db) as db:
            db.execute(
                "UPDATE outbox SET attempts = attempts + 1, next_at = ?, last_error = ?, claimed_until = NULL WHERE id = ?",
                (now + delay, str(exc)[:500], row["id"]),
            )

    @staticmethod
    def _finish(db: sqlite3.Connection, outbox_id: int) -> None:
        db.execute(
            "UPDATE outbox SET done_at = ?, attempts = attempts + 1, last_error = NULL WHERE id = ?", (time.time(), outbox_id)
        )

    def notice(self, view: IncidentView, action: str, doc: Doc, outbox_id: int) -> Notice:
        row = view.row
        mark = marker(row)
        incident = {
            "id": view.id, "key": row["key"], "generation": row["generation"], "status": row["status"],
            "resolution": row["resolution"], "severity": row["severity"], "class": row["diag_class"],
            "diagnosis_state": row["diag_state"], "labels": json.loads(row["labels"]),
        }  # fmt: skip
        # the incident's opening time keeps keys unique even across a store that was started afresh
        key = f"{mark}/{int(row['opened_at'] * 1000)}/{outbox_id}/{action}"
        return Notice(action, mark, f"[llm-diag] {row['title']}", doc, incident, _links(view, self.page_url), key)

    def _ticket(self, sink: Sink, view: IncidentView, row: sqlite3.Row, finish: int | None = None) -> Ticket:
        """The incident's ticket in this sink: stored, else found by marker, else created -- and stored.

        ``finish``: an outbox row marked done in the same transaction (one fsync per created ticket).
        """
        for t in view.tickets:
            if t["sink"] == sink.name:
                return Ticket(t["external_id"], t["url"])
        failed = self._db.execute(
            "SELECT last_error FROM outbox WHERE incident_id = ? AND sink = ? AND action = 'create' AND failed_at IS NOT NULL"
            " ORDER BY id DESC LIMIT 1",
            (view.id, sink.name),
        ).fetchone()
        if failed is not None:
            raise NoTicket(f"not sent: the {sink.name} ticket was never created ({failed['last_error']})")
        mark = marker(view.row)
        ticket = sink.find(mark)
        adopted = ticket is not None
        if ticket is None:
            self._wait_for_lookup(sink, row)
            with row_transaction(self._db) as db:  # committed before the request: a lost answer is known to be possible
                db.execute("UPDATE outbox SET sent_at = ? WHERE id = ?", (time.time(), row["id"]))
            ticket = sink.create(self.notice(view, "create", ticket_doc(view, self.page_url), row["id"]))
        with row_transaction(self._db) as db:
            db.execute(
                "INSERT OR IGNORE INTO tickets (incident_id, sink, external_id, url, last_class, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (view.id, sink.name, ticket.external_id, ticket.url, view.row["diag_class"], time.time()),
            )
            how = "found (created before a restart)" if adopted else "created"
            add_event(db, view.id, "ticket", f"{sink.name} ticket {ticket.external_id} {how}")
            if finish is not None:
                self._finish(db, finish)
        view.tickets.append({"sink": sink.name, "external_id": ticket.external_id, "url": ticket.url})
        return ticket

    @staticmethod
    def _wait_for_lookup(sink: Sink, row: sqlite3.Row) -> None:
        """After a create whose answer never came, a lagging lookup's "not found" is not yet the truth."""
        sent = row["sent_at"]
        if sent is None:
            return
        wait = sent + sink.lookup_settle_s - time.time()
        if wait > 0:
            raise SinkError(
                f"an earlier create had no answer and {sink.name} lookups can lag behind; looking again in {wait:.0f}s"
                " before creating",
                retry_after_s=wait,
            )

    def _perform(self, sink: Sink, row: sqlite3.Row, view: IncidentView) -> bool:
        """Do one action; True when its outbox row is already marked done (in the transaction that stored a new ticket)."""
        action = row["action"]
        if action == "create":
            known = any(t["sink"] == sink.name for t in view.tickets)
            self._ticket(sink, view, row, finish=None if known else row["id"])
            return not known
        ticket = self._ticket(sink, view, row)
        note = from_plain(row["text"])
        if action == "diagnosis":
            stated = self._db.execute(
                "SELECT last_class FROM tickets WHERE incident_id = ? AND sink = ?", (view.id, sink.name)
            ).fetchone()
            if stated is not None and stated["last_class"] == view.row["diag_class"]:
                return False  # the ticket already says this (it was created after the diagnosis)
            sink.comment(ticket, self.notice(view, action, note + diagnosis_doc(view), row["id"]))
            with row_transaction(self._db) as db:
                db.execute(
                    "UPDATE tickets SET last_class = ? WHERE incident_id = ? AND sink = ?",
                    (view.row["diag_class"], view.id, sink.name),
                )
        elif action == "comment":
            sink.comment(ticket, self.notice(view, action, note, row["id"]))
        elif action == "close":
            sink.close(ticket, self.notice(view, action, note, row["id"]))  # idempotent: safe to repeat on retry
        elif action == "reopen":
            sink.reopen(ticket, self.notice(view, action, note, row["id"]))
        return False


def retry_failed(db: sqlite3.Connection, incident_id: int, now: float | None = None) -> int:
    """Queue an incident's failed ticket actions again (``diag tickets retry``); returns how many."""
    now = time.time() if now is None else now
    with transaction(db):
        n = db.execute(
            "UPDATE outbox SET failed_at = NULL, next_at = ?, attempts = 0 WHERE incident_id = ? AND failed_at IS NOT NULL",
            (now, incident_id),
        ).rowcount
        if n:
            add_event(db, incident_id, "ticket_retry", f"{n} failed ticket action(s) queued again by a person", now)
    return n
