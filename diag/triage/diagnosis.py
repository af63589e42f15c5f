"""The diagnosis worker: ``diag analyze`` for every incident, off the webhook's path.

Why a separate process: the rules are CPU-heavy numpy work and loading a window of records
allocates hundreds of MiB; in the receiver's process that would hold the GIL and the heap while
webhooks wait, and a crash there would take the receiver down. One worker process (spawned, so it
inherits no threads or locks) runs the analyses one after another; the webhook never waits on it.

What is analysed: [startsAt - lookback, now] -- the build-up before the alert matters as much as
the alert -- from the configured source: Prometheus with a selector built from the alert's labels
(the fleet path), or the local flight recorder. Only the public entry points are used
(``load_recorder``, ``load_prometheus``, ``diag.rules.engine.analyze``) and the stored document is
the analysis's own ``to_dict()``, so new verdicts (``inconclusive``) pass through untouched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diag.triage import lifecycle
from diag.triage.store import add_event, connect, is_shared, store_target, transaction

log = logging.getLogger(__name__)

LOOKBACK_S = 30 * 60.0
MAX_ATTEMPTS = 3
RETRY_AFTER_S = 30.0
ANALYSIS_TIMEOUT_S = 600.0  # a worker that has not answered by then is hung: recorded as a failed attempt
DEFAULT_SELECTOR_LABELS = ("job", "instance")
WORKER_NICE = 10


@dataclass(frozen=True)
class Source:
    """Where the records come from: ``recorder`` (a flight recorder file) or ``prometheus`` (a base URL)."""

    kind: str
    target: str
    selector_labels: tuple[str, ...] = DEFAULT_SELECTOR_LABELS
    # Request headers of the Prometheus queries (``--header``/``--tenant``): a bearer token, so out of the repr.
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def describe(self) -> str:
        return f"{self.kind} {self.target}"


MACHINE_LABEL = "host"


def promql_selector(labels: dict[str, str], names: tuple[str, ...]) -> str:
    """``job="llm",instance="10.0.0.5:8000"`` from the alert's labels (PromQL string escaping applied): the alert's
    own target rather than every target of the job.

    An alert that carries a ``host`` label is diagnosed on that machine (``host="gpu-07"``) in place of the
    ``job`` and ``instance`` asked for: the shipped scrape config gives every target of one machine -- the agent
    on :9464, the engine on :8000, each its own job -- the same ``host``, and the rules need both (the host's
    memory and the engine's queue), while a job and instance name only the one target that fired.
    """
    if labels.get(MACHINE_LABEL) and "instance" in names:
        names = (MACHINE_LABEL, *(n for n in names if n not in ("job", "instance", MACHINE_LABEL)))
    parts = []
    for name in names:
        value = labels.get(name)
        if value:
            escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            parts.append(f'{name}="{escaped}"')
    return ",".join(parts)


def _init_worker(parent: int) -> None:
    """In the worker: lower priority -- analyses are background work; the webhook (and the service being
    diagnosed) come first -- import the loaders and rules now, so the first incident does not wait for them,
    and exit as soon as the receiver is gone.

    Why the watchdog: a worker waiting for its next task holds both ends of its task pipe, so when the
    receiver dies (``kill -9``, or exits while the executor is still winding down) it never sees EOF and
    would wait forever as an orphan.
    """
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICE)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    import importlib

    for name in ("diag.sources.recorder", "diag.sources.prometheus"):
        importlib.import_module(name)
    from diag.rules.engine import load_rules

    load_rules()


def run_analysis(
    kind: str, target: str, selector: str, since_s: float, until: float, labels: dict[str, str] | None = None,
    firing: bool = False, headers: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """In the worker process: load the window and run the rules; a problem with the source becomes ``error``.

    ``labels``/``firing``: the incident's alert, which the analysis is reconciled with (``diag.triage.agreement``).
    """
    from diag.rules.engine import analyze
    from diag.triage import agreement

    try:
        if kind == "prometheus":
            from diag.sources import load_prometheus

            timeline = load_prometheus(target, selector=selector, since_s=since_s, until=until, headers=headers)
        else:
            from diag.sources import load_recorder

            timeline = load_recorder(target, since_s=since_s, until=until)
        doc = analyze(timeline).to_dict()
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if labels is not None:
        doc["alert_check"] = agreement.check(doc, labels, firing=firing)
    return json.loads(json.dumps(doc, allow_nan=False, default=str))


def verdict_class(doc: dict[str, Any]) -> str:
    """The incident's class: what the alert check settled on (``diag.triage.agreement``), else the verdict."""
    check = doc.get("alert_check")
    if isinstance(check, dict) and check.get("incident_class"):
        return str(check["incident_class"])
    verdict = doc.get("verdict")
    if isinstance(verdict, dict):
        return str(verdict.get("primary") or "unknown")
    return str(verdict or "unknown")


class DiagnosisWorker:
    """Claims incidents whose diagnosis is pending, analyses them in a worker process, stores the result."""

    def __init__(
        self,
        path: str | Path,
        source: Source,
        policy: lifecycle.Policy,
        *,
        lookback_s: float = LOOKBACK_S,
        bundle_on: str | None = None,
        bundle_dir: Path | None = None,
    ) -> None:
        self.path = store_target(path)
        self.source = source
        self.policy = policy
        self.lookback_s = lookback_s
        self.bundle_on = bundle_on
        self.bundle_dir = bundle_dir
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pool = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker, initargs=(os.getpid(),)
        )
        self._db = connect(self.path)
        with transaction(self._db) as db:  # a crash mid-analysis left some 'running': run them again
            # (on a shared store only those whose claim lapsed: the others are another receiver's, still running)
            if is_shared(db):
                db.execute(
                    "UPDATE incidents SET diag_state = 'pending' WHERE diag_state = 'running'"
                    " AND COALESCE(diag_claimed_until, 0) <= ?",
                    (time.time(),),
                )
            else:
                db.execute("UPDATE incidents SET diag_state = 'pending' WHERE diag_state = 'running'")
        self._pool.submit(int, 0).result()  # start the worker now, not on the first incident
        self._thread = threading.Thread(target=self._run, name="triage-diagnosis", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=60)
        processes = list(getattr(self._pool, "_processes", {}).values())  # to stop a long analysis now
        self._pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            proc.terminate()
            proc.join(timeout=5)
        self._db.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                claimed = self._claim()
            except sqlite3.Error as exc:
                log.warning("triage: cannot claim a diagnosis: %s", exc)
                claimed = None
            if claimed is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            self._diagnose(claimed)

    def _claim(self) -> sqlite3.Row | None:
        with transaction(self._db) as db:
            # under the store's write lock (SQLite's, or the writers' lock on PostgreSQL): one receiver claims an
            # incident; a claim whose receiver died (kill -9) lapses after the analysis deadline and is taken over
            now = time.time()
            row = db.execute(
                "SELECT * FROM incidents WHERE (diag_state = 'pending' OR (diag_state = 'running'"
                " AND COALESCE(diag_claimed_until, 0) <= ?)) AND COALESCE(diag_requested, 0) <= ?"
                " AND id NOT IN (SELECT absorbed FROM merges) ORDER BY diag_requested LIMIT 1",
                (now, now),
            ).fetchone()
            if row is not None:
                db.execute(
                    "UPDATE incidents SET diag_state = 'running', diag_attempts = diag_attempts + 1, diag_claimed_until = ?"
                    " WHERE id = ?",
                    (now + ANALYSIS_TIMEOUT_S + 60, row["id"]),
                )
        return row

    def _diagnose(self, inc: sqlite3.Row) -> None:
        now = time.time()
        since_s = max(60.0, now - (inc["starts_at"] - self.lookback_s))
        labels = json.loads(inc["labels"])
        selector = promql_selector(labels, self.source.selector_labels)
        firing = (
            self._db.execute("SELECT COUNT(*) FROM alerts WHERE incident_id = ? AND status = 'firing'", (inc["id"],)).fetchone()[
                0
            ]
            > 0
        )
        future: Future[dict[str, Any]] = self._pool.submit(
            run_analysis, self.source.kind, self.source.target, selector, since_s, now, labels, firing, dict(self.source.headers)
        )
        try:
            doc = future.result(timeout=ANALYSIS_TIMEOUT_S)
        except Exception as exc:  # the worker process died or hung: record it, the next claim gets a fresh one
            doc = {"error": f"analysis failed: {type(exc).__name__}: {exc}"}
        bundle = self._bundle(inc) if "error" not in doc else None
        self._store(inc, doc, since_s, now, selector, bundle)

    def _bundle(self, inc: sqlite3.Row) -> str | None:
        """``--bundle-on page``: a ``diag bundle`` of this host when a paging incident opens (once per incident)."""
        if self.bundle_on != "page" or inc["severity"] != "page" or inc["bundle_path"] or self.bundle_dir is None:
            return None
        self.bundle_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "diag.cli", "bundle", "--out", str(self.bundle_dir), "--since", "30m", "--no-tar", "-q"]
        if self.source.kind == "recorder":
            cmd += ["--recorder", self.source.target]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("triage: diag bundle failed: %s", exc)
            return None
        m = re.search(r"^Bundle: (.+)$", out, re.M)
        return m.group(1).strip() if m else None

    def _store(
        self, inc: sqlite3.Row, doc: dict[str, Any], since_s: float, now: float, selector: str, bundle: str | None
    ) -> None:
        incident_id = inc["id"]
        with transaction(self._db) as db:
            current = db.execute(
                "SELECT diag_state, diag_class, diag_attempts FROM incidents WHERE id = ?", (incident_id,)
            ).fetchone()
            rerun = current["diag_state"] == "pending"  # reopened while we were analysing: run again
            if "error" in doc:
                retry = current["diag_attempts"] < MAX_ATTEMPTS or rerun
                db.execute(
                    "UPDATE incidents SET diag_state = ?, diag_error = ?, diag_requested = ? WHERE id = ?",
                    ("pending" if retry else "failed", doc["error"], now + (0 if rerun else RETRY_AFTER_S), incident_id),
                )
                add_event(db, incident_id, "diagnosis_failed", f"{doc['error']}" + (" (will retry)" if retry else ""), now)
                if not retry:
                    lifecycle.release_ticket_hold(db, incident_id, now)
                return
            cls = verdict_class(doc)
            doc["triage"] = {"source": self.source.describe(), "selector": selector, "since_s": since_s, "until": now}
            db.execute(
                "UPDATE incidents SET diag_state = ?, diag_class = ?, diag_doc = ?, diag_at = ?, diag_error = NULL,"
                " diag_attempts = 0, bundle_path = COALESCE(bundle_path, ?) WHERE id = ?",
                ("pending" if rerun else "done", cls, json.dumps(doc), now, bundle, incident_id),
            )
            previous = current["diag_class"]
            if previous is None:
                add_event(db, incident_id, "diagnosis", f"diagnosed: {cls}", now)
                lifecycle.enqueue(db, self.policy, incident_id, "diagnosis", "", now)
            elif previous != cls:
                add_event(db, incident_id, "class_changed", f"re-diagnosed: {previous} -> {cls}", now)
                lifecycle.enqueue(db, self.policy, incident_id, "diagnosis", f"Class changed: {previous} -> {cls}.", now)
            else:
                add_event(db, incident_id, "rediagnosed", f"re-diagnosed: still {cls}", now)
            if bundle:
                add_event(db, incident_id, "bundle", f"diag bundle written: {bundle}", now)
            lifecycle.release_ticket_hold(db, incident_id, now)
            lifecycle.join_same_problem(db, self.policy, incident_id, now)
