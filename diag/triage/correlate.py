"""One problem, one incident: alerts about the same problem on the same target join one incident.

Why: the incident key comes from an alert's labels, and the alerts one real problem raises have
different labels. A queue backlog pages through the queue-wait SLO burn (``slo=queue-wait``), opens a
ticket through its cause alert (``diag_class=queue_backlog``) and through the live diagnosis
(``LLMDiagIncident``, on the agent's job) -- three keys, three incidents, three tickets for one cause.
Keys stay as they are (they make retries and HA peers idempotent); incidents that turn out to be one
problem are *joined* afterwards. Two incidents are one problem when

- **their class is the same**: the class an alert states (its ``diag_class`` label: cause alerts and
  the live diagnosis name theirs) or, for an alert that states none (an SLO burn), the class its
  diagnosis concluded. The stated class wins over the diagnosed one, so an OOM page about some other
  process's OOM kill stays an OOM incident even when the host's diagnosis names a queue backlog;
- **their targets are compatible**: no label of the policy's ``correlate_labels`` (default
  ``instance`` and ``model|model_name``) has different values on the two. An SLO summed over a job's
  instances names no instance and is compatible with a cause alert on one of them; two hosts' alerts
  (different ``instance``) never join;
- **they overlap in time**: both are active (open or resolving) and were opened within the policy's
  ``correlate_window_s`` of each other.

The survivor is the one that already holds a ticket, else the older. The other one's alerts move under
it (later deliveries of its key follow the merge), its pending ticket actions are cancelled, a ticket it
already had is handed over (or closed as a duplicate when the survivor has its own in that tracker), the
survivor's severity becomes the higher of the two, and both timelines say what happened.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from diag.triage.keys import key_labels
from diag.triage.store import add_event

SEVERITY_RANK = {"page": 2, "ticket": 1}
# Verdicts that are not a class of problem: they never make two incidents one.
NOT_A_CLASS = frozenset({"healthy", "inconclusive", "unknown", ""})
ACTIVE = ("open", "resolving")


def stated_class(row: sqlite3.Row | dict[str, Any]) -> str | None:
    """The class the alert itself states (cause alerts and the live diagnosis carry ``diag_class``)."""
    value = json.loads(row["labels"]).get("diag_class", "")
    return value if value not in NOT_A_CLASS else None


def incident_class(row: sqlite3.Row | dict[str, Any]) -> str | None:
    """What problem the incident is: the class its alert states, else the class its diagnosis concluded."""
    stated = stated_class(row)
    if stated:
        return stated
    diagnosed = row["diag_class"] or ""
    return diagnosed if diagnosed not in NOT_A_CLASS else None


def compatible(a: dict[str, str], b: dict[str, str]) -> bool:
    """No target label has two different values (a label only one side names does not separate them)."""
    return all(a[name] == b[name] for name in a.keys() & b.keys())


def _target(row: sqlite3.Row, spec: tuple[str, ...]) -> dict[str, str]:
    """The target labels, with ``a|b`` alternatives folded onto the first name (``model_name`` counts as ``model``)."""
    labels = json.loads(row["labels"])
    chosen = key_labels(labels, spec)
    out = {}
    for part in spec:
        names = part.split("|")
        for name in names:
            if name in chosen:
                out[names[0]] = chosen[name]
                break
    return out


def root(db: sqlite3.Connection, incident_id: int) -> int:
    """The incident this one was joined into (following joins of joins), or itself."""
    seen = {incident_id}
    while True:
        row = db.execute("SELECT survivor FROM merges WHERE absorbed = ?", (incident_id,)).fetchone()
        if row is None or row[0] in seen:
            return incident_id
        incident_id = int(row[0])
        seen.add(incident_id)


def same_problem(db: sqlite3.Connection, policy: Any, incident_id: int) -> tuple[sqlite3.Row, list[sqlite3.Row], str] | None:
    """(survivor, the incidents to join into it, their class) when active incidents are the same problem as this one."""
    if not policy.correlate_labels:
        return None
    me = db.execute("SELECT * FROM incidents WHERE id = ?", (incident_id,)).fetchone()
    if me is None or me["status"] not in ACTIVE or root(db, incident_id) != incident_id:
        return None
    cls = incident_class(me)
    if cls is None:
        return None
    mine = _target(me, policy.correlate_labels)
    group = [me]
    for row in db.execute(
        "SELECT * FROM incidents WHERE id != ? AND status IN ('open', 'resolving') AND ABS(opened_at - ?) <= ?"
        " AND id NOT IN (SELECT absorbed FROM merges) ORDER BY id",
        (incident_id, me["opened_at"], policy.correlate_window_s),
    ):
        if incident_class(row) == cls and compatible(mine, _target(row, policy.correlate_labels)):
            group.append(row)
    if len(group) == 1:
        return None
    ids = [r["id"] for r in group]
    marks = ",".join("?" * len(ids))
    ticketed = {r[0] for r in db.execute(f"SELECT DISTINCT incident_id FROM tickets WHERE incident_id IN ({marks})", ids)}
    survivor = min(group, key=lambda r: (r["id"] not in ticketed, r["opened_at"], r["id"]))
    return survivor, [r for r in group if r["id"] != survivor["id"]], cls


def join(db: sqlite3.Connection, survivor_id: int, absorbed: sqlite3.Row, cls: str, now: float) -> str:
    """Join ``absorbed`` into the survivor (inside the caller's transaction); returns the note for the survivor's tickets."""
    sid, aid = survivor_id, int(absorbed["id"])
    survivor = db.execute("SELECT * FROM incidents WHERE id = ?", (sid,)).fetchone()
    db.execute("INSERT INTO merges (absorbed, survivor, ts, class) VALUES (?, ?, ?, ?)", (aid, sid, now, cls))
    # its alerts are the survivor's now: the survivor resolves only when they have stopped too
    db.execute(
        "INSERT OR IGNORE INTO alerts (incident_id, fingerprint, status, starts_at, ends_at, labels, first_seen, last_seen)"
        " SELECT ?, fingerprint, status, starts_at, ends_at, labels, first_seen, last_seen FROM alerts WHERE incident_id = ?",
        (sid, aid),
    )
    db.execute("DELETE FROM alerts WHERE incident_id = ?", (aid,))
    db.execute(
        "UPDATE outbox SET done_at = ?, last_error = ? WHERE incident_id = ? AND done_at IS NULL",
        (now, f"cancelled: joined into incident {sid}", aid),
    )
    # a ticket it already had: handed over where the survivor has none in that tracker, else closed as a duplicate
    db.execute(
        "UPDATE tickets SET incident_id = ? WHERE incident_id = ?"
        " AND sink NOT IN (SELECT sink FROM tickets WHERE incident_id = ?)",
        (sid, aid, sid),
    )
    for (sink,) in db.execute("SELECT sink FROM tickets WHERE incident_id = ?", (aid,)).fetchall():
        db.execute(
            "INSERT INTO outbox (incident_id, sink, action, text, created_at, next_at) VALUES (?, ?, 'close', ?, ?, ?)",
            (aid, sink, f"Duplicate: the same {cls} problem is tracked by incident {sid}.", now, now),
        )
    severity = max(survivor["severity"], absorbed["severity"], key=lambda s: SEVERITY_RANK.get(s, 0))
    firing = db.execute("SELECT COUNT(*) FROM alerts WHERE incident_id = ? AND status = 'firing'", (sid,)).fetchone()[0]
    wake = survivor["status"] == "resolving" and firing > 0
    db.execute(
        "UPDATE incidents SET severity = ?, updated_at = ?, status = CASE WHEN ? THEN 'open' ELSE status END,"
        " resolve_due = CASE WHEN ? THEN NULL ELSE resolve_due END WHERE id = ?",
        (severity, now, wake, wake, sid),
    )
    db.execute(
        "UPDATE incidents SET status = 'closed', resolution = 'merged', closed_at = ?, resolve_due = NULL, updated_at = ?"
        " WHERE id = ?",
        (now, now, aid),
    )
    what = absorbed["title"][:120]
    raised = f"; severity raised to {severity}" if severity != survivor["severity"] else ""
    add_event(db, sid, "joined", f"incident {aid} joined ({what}): the same {cls} problem on a compatible target{raised}", now)
    add_event(db, aid, "merged", f"joined into incident {sid}: the same {cls} problem on a compatible target", now)
    return f"Also raised by: {what} (was incident {aid}; the same {cls} problem){raised}."
