"""Incident lifecycle: what one alert (firing or resolved) does to its incident.

States: ``open`` (firing) -> ``resolving`` (every alert resolved; the hold-down runs) -> ``resolved``
(the hold-down passed without a new firing) -> ``open`` again when it fires within the reopen
window (``reopen_count`` + 1, re-diagnosed), or a *new* incident (next generation of the key) after
it. ``closed`` is a person's decision (``diag tickets close``): closed as won't-fix never reopens --
later firings are recorded on it and go nowhere; closed as fixed behaves like resolved.

Why a hold-down: Alertmanager resolves an alert group when its alerts stop, and a flapping rule
would otherwise close and reopen the ticket every few minutes. Firing during the hold-down is a
flap, not a reopen. ``flap_threshold`` state changes within ``flap_window_s`` mark the incident
flapping: the tickets get one note and no more close/reopen churn until it settles.

Idempotence (why retries and HA peers make no duplicates): applying the same alert twice changes
nothing the second time, and an alert that is *older* than what is stored (a firing retried after
its resolution, by the same or by the other peer) is ignored: Alertmanager gives an alert that
fires again after resolving a new ``startsAt``, so (fingerprint, startsAt) orders them.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Any

from diag.triage import correlate
from diag.triage.keys import DEFAULT_KEY_LABELS, incident_key
from diag.triage.payload import Alert, Notification
from diag.triage.store import add_event

SAME_TIME_S = 1e-3


@dataclass(frozen=True)
class Policy:
    key_labels: tuple[str, ...] = DEFAULT_KEY_LABELS
    hold_down_s: float = 300.0
    reopen_window_s: float = 24 * 3600.0
    flap_window_s: float = 3600.0
    flap_threshold: int = 4
    sinks: tuple[str, ...] = field(default_factory=tuple)
    # One problem, one incident (diag.triage.correlate): the labels two incidents' targets must not disagree on,
    # and how far apart they may have opened. Empty labels turn joining off.
    correlate_labels: tuple[str, ...] = ("instance", "model|model_name")
    correlate_window_s: float = 1800.0
    # With a diagnosis running, a new incident's tickets wait for it (at most this long), so alerts that turn out
    # to be one problem are joined before anything is filed.
    ticket_hold_s: float = 0.0


def enqueue(
    db: sqlite3.Connection, policy: Policy, incident_id: int, action: str, text: str, now: float, *, delay_s: float = 0.0
) -> None:
    """Queue a ticket action for every configured sink and every sink already holding this incident.

    The latter matters for ``diag tickets close``, which runs without the receiver's sink settings.
    ``delay_s``: not before then (a new incident's ticket waits for its diagnosis, see ``Policy.ticket_hold_s``).
    """
    used = {r[0] for r in db.execute("SELECT sink FROM outbox WHERE incident_id = ? UNION SELECT sink FROM tickets"
                                      " WHERE incident_id = ?", (incident_id, incident_id))}  # fmt: skip
    for sink in sorted(set(policy.sinks) | used):
        db.execute(
            "INSERT INTO outbox (incident_id, sink, action, text, created_at, next_at) VALUES (?, ?, ?, ?, ?, ?)",
            (incident_id, sink, action, text, now, now + delay_s),
        )


def release_ticket_hold(db: sqlite3.Connection, incident_id: int, now: float) -> None:
    """The diagnosis is in (or gave up): a held ticket may be filed now."""
    db.execute(
        "UPDATE outbox SET next_at = ? WHERE incident_id = ? AND action = 'create' AND done_at IS NULL AND next_at > ?",
        (now, incident_id, now),
    )


def join_same_problem(db: sqlite3.Connection, policy: Policy, incident_id: int, now: float) -> int | None:
    """Join this incident and the active ones that are the same problem (``diag.triage.correlate``); the survivor's id."""
    found = correlate.same_problem(db, policy, incident_id)
    if found is None:
        return None
    survivor, others, cls = found
    ticketed = db.execute("SELECT 1 FROM tickets WHERE incident_id = ?", (survivor["id"],)).fetchone() is not None
    for other in others:
        note = correlate.join(db, survivor["id"], other, cls, now)
        if ticketed:  # a ticket not filed yet is created from the joined incident as it is then
            enqueue(db, policy, survivor["id"], "comment", note, now)
    return int(survivor["id"])


def _title(alert: Alert, chosen: dict[str, str]) -> str:
    summary = alert.annotations.get("summary", "").strip()
    what = " ".join(f"{k}={v}" for k, v in chosen.items())
    return (f"{summary} ({what})" if summary else what)[:300]


def _current(db: sqlite3.Connection, key: str) -> sqlite3.Row | None:
    return db.execute("SELECT * FROM incidents WHERE key = ? ORDER BY generation DESC LIMIT 1", (key,)).fetchone()


def _followed(db: sqlite3.Connection, inc: sqlite3.Row) -> sqlite3.Row:
    """The incident an alert of ``inc``'s key belongs to now: ``inc``, or the one it was joined into."""
    target = correlate.root(db, inc["id"])
    if target == inc["id"]:
        return inc
    return db.execute("SELECT * FROM incidents WHERE id = ?", (target,)).fetchone()


def _create(
    db: sqlite3.Connection,
    policy: Policy,
    note: Notification,
    alert: Alert,
    key: str,
    chosen: dict[str, str],
    gen: int,
    now: float,
) -> int:
    cur = db.execute(
        "INSERT INTO incidents (key, generation, key_labels, title, status, severity, labels, annotations, generator_url,"
        " group_key, external_url, starts_at, opened_at, updated_at, truncated_alerts, diag_state, diag_requested)"
        " VALUES (?, ?, ?, ?, 'open', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?)",
        (
            key, gen, json.dumps(chosen), _title(alert, chosen), alert.labels.get("severity") or note.route_severity,
            json.dumps(alert.labels),
            json.dumps(alert.annotations), alert.generator_url, note.group_key, note.external_url, alert.starts_at, now, now,
            note.truncated_alerts, now,
        ),
    )  # fmt: skip
    incident_id = int(cur.lastrowid or 0)
    add_event(db, incident_id, "opened", f"firing: {' '.join(f'{k}={v}' for k, v in chosen.items())}", now)
    if note.truncated_alerts:
        add_event(
            db, incident_id, "truncated", f"Alertmanager dropped {note.truncated_alerts} alerts of this group (max_alerts)", now
        )
    enqueue(db, policy, incident_id, "create", "", now, delay_s=policy.ticket_hold_s)
    return incident_id


def _upsert_alert(db: sqlite3.Connection, incident_id: int, alert: Alert, now: float) -> bool:
    """Record the alert under its incident; True when it is new to the incident."""
    known = db.execute(
        "SELECT 1 FROM alerts WHERE incident_id = ? AND fingerprint = ?", (incident_id, alert.fingerprint)
    ).fetchone()
    db.execute(
        "INSERT INTO alerts (incident_id, fingerprint, status, starts_at, ends_at, labels, first_seen, last_seen)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (incident_id, fingerprint) DO UPDATE SET"
        " status = excluded.status, starts_at = excluded.starts_at, ends_at = excluded.ends_at, last_seen = excluded.last_seen",
        (incident_id, alert.fingerprint, alert.status, alert.starts_at, alert.ends_at, json.dumps(alert.labels), now, now),
    )
    return known is None


def _stale(db: sqlite3.Connection, incident_id: int, alert: Alert) -> bool:
    """Older than what is stored for this fingerprint (a late retry, or the other peer's copy)."""
    row = db.execute(
        "SELECT status, starts_at FROM alerts WHERE incident_id = ? AND fingerprint = ?", (incident_id, alert.fingerprint)
    ).fetchone()
    if row is None:
        return False
    if alert.starts_at < row["starts_at"] - SAME_TIME_S:
        return True
    same = abs(alert.starts_at - row["starts_at"]) <= SAME_TIME_S
    return same and row["status"] == "resolved" and alert.status == "firing"


def _transition(db: sqlite3.Connection, policy: Policy, inc: sqlite3.Row, kind: str, text: str, now: float) -> bool:
    """Record a state change and update the flapping mark; True when the incident is (now) flapping."""
    add_event(db, inc["id"], kind, text, now)
    changes = db.execute(
        "SELECT COUNT(*) FROM events WHERE incident_id = ? AND kind IN ('resolving', 'refired', 'reopened') AND ts >= ?",
        (inc["id"], now - policy.flap_window_s),
    ).fetchone()[0]
    if changes >= policy.flap_threshold and not inc["flapping"]:
        db.execute("UPDATE incidents SET flapping = 1 WHERE id = ?", (inc["id"],))
        add_event(db, inc["id"], "flapping", f"{changes} state changes within {policy.flap_window_s:g}s: marked flapping", now)
        enqueue(db, policy, inc["id"], "comment", "Flapping: this alert keeps firing and resolving; ticket state will "
                 "stay as it is until it settles.", now)  # fmt: skip
        return True
    return bool(inc["flapping"])


def _reopen(db: sqlite3.Connection, policy: Policy, inc: sqlite3.Row, alert: Alert, now: float) -> None:
    db.execute(
        "UPDATE incidents SET status = 'open', resolution = NULL, resolve_due = NULL, resolved_at = NULL, closed_at = NULL,"
        " reopen_count = reopen_count + 1, starts_at = ?, updated_at = ?, diag_state = 'pending', diag_requested = ?"
        " WHERE id = ?",
        (alert.starts_at, now, now, inc["id"]),
    )
    flapping = _transition(db, policy, inc, "reopened", f"fired again (reopen #{inc['reopen_count'] + 1})", now)
    if not flapping:
        enqueue(db, policy, inc["id"], "reopen", f"Fired again; reopened, {inc['reopen_count'] + 1} time(s) in all.", now)


def _firing(
    db: sqlite3.Connection, policy: Policy, note: Notification, alert: Alert, key: str, chosen: dict[str, str], now: float
) -> str:
    own = _current(db, key)
    if own is None:
        incident_id = _create(db, policy, note, alert, key, chosen, 1, now)
        _upsert_alert(db, incident_id, alert, now)
        join_same_problem(db, policy, incident_id, now)
        return "opened"
    inc = _followed(db, own)
    if _stale(db, inc["id"], alert):
        return "stale"
    status = inc["status"]
    if status == "closed" and inc["resolution"] == "wontfix":
        if _upsert_alert(db, inc["id"], alert, now):
            add_event(db, inc["id"], "suppressed", f"alert {alert.fingerprint} fired; closed as won't-fix, not reopened", now)
        return "suppressed"
    if status in ("resolved", "closed"):
        ended = inc["resolved_at"] if status == "resolved" else inc["closed_at"]
        if ended is not None and now - ended > policy.reopen_window_s:
            incident_id = _create(db, policy, note, alert, key, chosen, own["generation"] + 1, now)
            _upsert_alert(db, incident_id, alert, now)
            join_same_problem(db, policy, incident_id, now)
            return "opened"
        _upsert_alert(db, inc["id"], alert, now)
        _reopen(db, policy, inc, alert, now)
        return "reopened"
    new = _upsert_alert(db, inc["id"], alert, now)
    if status == "resolving":
        db.execute("UPDATE incidents SET status = 'open', resolve_due = NULL, updated_at = ? WHERE id = ?", (now, inc["id"]))
        _transition(db, policy, inc, "refired", "fired again during the hold-down (a flap, not a reopen)", now)
        return "refired"
    if new:
        # A new alert is new evidence: a diagnosis made before it fired may not have seen what it saw (an OOM page
        # opened on one kill, joined by the service's own kill a minute later), so it is diagnosed again.
        db.execute(
            "UPDATE incidents SET updated_at = ?, diag_state = CASE WHEN diag_state IN ('done', 'failed') THEN 'pending'"
            " ELSE diag_state END, diag_requested = CASE WHEN diag_state IN ('done', 'failed') THEN ? ELSE diag_requested"
            " END WHERE id = ?",
            (now, now, inc["id"]),
        )
        add_event(db, inc["id"], "alert", f"alert {alert.fingerprint} joined the incident", now)
        return "joined"
    return "duplicate"


def _resolved(db: sqlite3.Connection, policy: Policy, alert: Alert, key: str, now: float) -> str:
    own = _current(db, key)
    if own is None:
        return "unknown"  # nothing open to resolve (it fired before this store existed)
    inc = _followed(db, own)
    if _stale(db, inc["id"], alert):
        return "stale"
    row = db.execute(
        "SELECT status FROM alerts WHERE incident_id = ? AND fingerprint = ?", (inc["id"], alert.fingerprint)
    ).fetchone()
    if row is not None and row["status"] == "resolved":
        return "duplicate"
    _upsert_alert(db, inc["id"], alert, now)
    if inc["status"] != "open":
        return "recorded"
    firing = db.execute("SELECT COUNT(*) FROM alerts WHERE incident_id = ? AND status = 'firing'", (inc["id"],)).fetchone()[0]
    if firing:
        return "partial"
    due = now + policy.hold_down_s
    db.execute("UPDATE incidents SET status = 'resolving', resolve_due = ?, updated_at = ? WHERE id = ?", (due, now, inc["id"]))
    _transition(db, policy, inc, "resolving", f"all alerts resolved; hold-down {policy.hold_down_s:g}s", now)
    if policy.hold_down_s <= 0:
        sweep(db, policy, now)
    return "resolving"


def apply(db: sqlite3.Connection, policy: Policy, note: Notification, now: float) -> list[str]:
    """Apply every alert of one notification (inside the caller's transaction); the outcome per alert."""
    outcomes = []
    for alert in note.alerts:
        key, chosen = incident_key(alert.labels, policy.key_labels)
        if alert.status == "firing":
            outcomes.append(_firing(db, policy, note, alert, key, chosen, now))
        else:
            outcomes.append(_resolved(db, policy, alert, key, now))
    return outcomes


def sweep(db: sqlite3.Connection, policy: Policy, now: float) -> int:
    """Finish hold-downs that are due; clear flapping marks that have settled. Returns incidents resolved."""
    due = db.execute("SELECT * FROM incidents WHERE status = 'resolving' AND resolve_due <= ?", (now,)).fetchall()
    for inc in due:
        db.execute("UPDATE incidents SET status = 'resolved', resolved_at = ?, resolve_due = NULL, updated_at = ? WHERE id = ?",
                   (now, now, inc["id"]))  # fmt: skip
        add_event(db, inc["id"], "resolved", "resolved (hold-down passed without a new firing)", now)
        if not inc["flapping"]:
            enqueue(db, policy, inc["id"], "close", "Resolved: every alert of this incident has stopped firing.", now)
    settled = db.execute(
        "SELECT i.id FROM incidents i WHERE i.flapping = 1 AND NOT EXISTS (SELECT 1 FROM events e WHERE e.incident_id = i.id"
        " AND e.kind IN ('resolving', 'refired', 'reopened') AND e.ts >= ?)",
        (now - policy.flap_window_s,),
    ).fetchall()
    for row in settled:
        db.execute("UPDATE incidents SET flapping = 0 WHERE id = ?", (row["id"],))
        add_event(db, row["id"], "settled", "no state change for a whole flap window: no longer flapping", now)
    return len(due)


def close_by_person(
    db: sqlite3.Connection, policy: Policy, incident_id: int, *, wontfix: bool, note: str, now: float
) -> dict[str, Any]:
    """``diag tickets close``: closed as fixed or as won't-fix (which never reopens). Raises LookupError/ValueError."""
    inc = db.execute("SELECT * FROM incidents WHERE id = ?", (incident_id,)).fetchone()
    if inc is None:
        raise LookupError(f"no incident {incident_id}")
    resolution = "wontfix" if wontfix else "fixed"
    if inc["status"] == "closed" and inc["resolution"] == resolution:
        return {"id": incident_id, "status": "closed", "resolution": resolution, "changed": False}
    db.execute(
        "UPDATE incidents SET status = 'closed', resolution = ?, closed_at = ?, resolve_due = NULL, updated_at = ? WHERE id = ?",
        (resolution, now, now, incident_id),
    )
    text = f"closed by a person as {'won’t fix' if wontfix else 'fixed'}" + (f": {note}" if note else "")
    add_event(db, incident_id, "closed", text, now)
    enqueue(db, policy, incident_id, "close", text[0].upper() + text[1:] + ".", now)
    return {"id": incident_id, "status": "closed", "resolution": resolution, "changed": True}
