"""The outbox dispatcher: replays queued ticket actions to the sinks, in order, until each succeeds.

Why an outbox: the incident's state change and "tell the tracker" are written in the same SQLite
transaction (``lifecycle.enqueue``), so neither a crash nor a tracker outage can lose an action --
a sink that is down only delays its queue (exponential backoff, capped). Actions of one incident
on one sink are replayed strictly in order (create before comment before close); different
incidents and sinks do not wait for each other.

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

from diag.triage.sinks import Sink, SinkError, Ticket
from diag.triage.store import IncidentView, add_event, connect, get_incident, transaction

log = logging.getLogger(__name__)

BASE_BACKOFF_S = 1.0
MAX_BACKOFF_S = 600.0
BATCH = 50


def marker(row: Mapping[str, Any]) -> str:
    """The label that identifies an incident's ticket in the tracker (at most 50 characters, GitHub's limit)."""
    return f"llmdiag-{row['key'][:24]}-g{row['generation']}"


def backoff_s(attempts: int, base: float = BASE_BACKOFF_S, cap: float = MAX_BACKOFF_S) -> float:
    """Exponential with full jitter: retries of many incidents do not stampede a recovering tracker."""
    return random.uniform(0.5, 1.0) * min(cap, base * 2 ** min(attempts, 30))


def _evidence_lines(doc: dict[str, Any], limit: int = 5) -> list[str]:
    lines = []
    for f in (doc.get("findings") or [])[:limit]:
        lines.append(f"- **{f.get('class')}** ({float(f.get('confidence') or 0):.0%}): {f.get('summary', '')}")
        for ev in (f.get("evidence") or [])[:4]:
            lines.append(f"  - {ev.get('what')}: {ev.get('value')} {ev.get('unit') or ''}".rstrip())
    return lines


def diagnosis_text(view: IncidentView) -> str:
    doc = view.diagnosis
    if doc is None:
        return "Diagnosis: still running (a note follows when it is done)."
    lines = [f"Diagnosis: **{view.row['diag_class']}**"]
    contributing = (doc.get("verdict") or {}).get("contributing") if isinstance(doc.get("verdict"), dict) else None
    if contributing:
        lines.append(f"Contributing: {', '.join(contributing)}")
    lines += _evidence_lines(doc)
    missing = [n.get("rule") for n in doc.get("not_evaluated") or []]
    if missing:
        lines.append(f"Not evaluated (data missing): {', '.join(str(m) for m in missing)}")
    return "\n".join(lines)


def ticket_body(view: IncidentView, page_url: str = "") -> str:
    row = view.row
    labels = json.loads(row["labels"])
    annotations = json.loads(row["annotations"])
    lines = [f"Incident {row['id']} ({row['status']}), opened by llm-diag triage.", ""]
    lines.append("Labels: " + ", ".join(f"`{k}={v}`" for k, v in sorted(labels.items())))
    for name in ("description", "runbook_url"):
        if annotations.get(name):
            lines.append(f"{name}: {annotations[name]}")
    if row["generator_url"]:
        lines.append(f"Source: {row['generator_url']}")
    if page_url:
        lines.append(f"Incident page: {page_url.rstrip('/')}/incidents/{row['id']}")
    lines += ["", diagnosis_text(view)]
    return "\n".join(lines)


class Dispatcher:
    """A thread that drains the outbox into the configured sinks."""

    def __init__(
        self, path: str | Path, sinks: Mapping[str, Sink], *, page_url: str = "", base_backoff_s: float = BASE_BACKOFF_S,
        start: bool = True,
    ) -> None:  # fmt: skip
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
        """The head of each (incident, sink) queue, when it is due."""
        return self._db.execute(
            "SELECT o.* FROM outbox o WHERE o.done_at IS NULL AND o.next_at <= ? AND o.id = (SELECT MIN(p.id) FROM outbox p"
            " WHERE p.incident_id = o.incident_id AND p.sink = o.sink AND p.done_at IS NULL) ORDER BY o.id LIMIT ?",
            (now, BATCH),
        ).fetchall()

    def drain_once(self) -> int:
        """Send what is due once; returns how many actions were attempted."""
        rows = [r for r in self.due(time.time()) if r["sink"] in self.sinks]
        for row in rows:
            if self._stop.is_set():
                break
            self._send(row)
        return len(rows)

    def _send(self, row: sqlite3.Row) -> None:
        sink = self.sinks[row["sink"]]
        view = get_incident(self._db, row["incident_id"])
        assert view is not None  # foreign key
        try:
            finished = self._perform(sink, row, view)
        except SinkError as exc:
            delay = backoff_s(row["attempts"], self.base_backoff_s)
            what = f"{row['sink']} {row['action']} for incident {row['incident_id']}"
            log.warning("triage: %s failed (retry in %.0fs): %s", what, delay, exc)
            with transaction(self._db) as db:
                db.execute(
                    "UPDATE outbox SET attempts = attempts + 1, next_at = ?, last_error = ? WHERE id = ?",
                    (time.time() + delay, str(exc)[:500], row["id"]),
                )
            return
        if not finished:
            with transaction(self._db) as db:
                self._finish(db, row["id"])

    @staticmethod
    def _finish(db: sqlite3.Connection, outbox_id: int) -> None:
        db.execute(
            "UPDATE outbox SET done_at = ?, attempts = attempts + 1, last_error = NULL WHERE id = ?", (time.time(), outbox_id)
        )

    def _ticket(self, sink: Sink, view: IncidentView, finish: int | None = None) -> Ticket:
        """The incident's ticket in this sink: stored, else found by marker, else created -- and stored.

        ``finish``: an outbox row marked done in the same transaction (one fsync per created ticket).
        """
        for t in view.tickets:
            if t["sink"] == sink.name:
                return Ticket(t["external_id"], t["url"])
        mark = marker(view.row)
        ticket = sink.find(mark)
        adopted = ticket is not None
        if ticket is None:
            ticket = sink.create(mark, f"[llm-diag] {view.row['title']}", ticket_body(view, self.page_url))
        with transaction(self._db) as db:
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

    def _perform(self, sink: Sink, row: sqlite3.Row, view: IncidentView) -> bool:
        """Do one action; True when its outbox row is already marked done (in the transaction that stored a new ticket)."""
        action = row["action"]
        if action == "create":
            known = any(t["sink"] == sink.name for t in view.tickets)
            self._ticket(sink, view, finish=None if known else row["id"])
            return not known
        ticket = self._ticket(sink, view)
        if action == "diagnosis":
            stated = self._db.execute(
                "SELECT last_class FROM tickets WHERE incident_id = ? AND sink = ?", (view.id, sink.name)
            ).fetchone()
            if stated is not None and stated["last_class"] == view.row["diag_class"]:
                return False  # the ticket already says this (it was created after the diagnosis)
            text = (row["text"] + "\n\n" if row["text"] else "") + diagnosis_text(view)
            sink.comment(ticket.external_id, text)
            with transaction(self._db) as db:
                db.execute(
                    "UPDATE tickets SET last_class = ? WHERE incident_id = ? AND sink = ?",
                    (view.row["diag_class"], view.id, sink.name),
                )
        elif action == "comment":
            sink.comment(ticket.external_id, row["text"])
        elif action == "close":
            sink.close(ticket.external_id, wontfix=view.row["resolution"] == "wontfix")  # idempotent: safe to repeat on retry
            if row["text"]:
                sink.comment(ticket.external_id, row["text"])
        elif action == "reopen":
            sink.reopen(ticket.external_id)
            if row["text"]:
                sink.comment(ticket.external_id, row["text"])
        return False
