"""Group commit: many webhook threads, one writer, one fsync per batch.

Why: the webhook may answer 2xx only once the delivery is on disk (``synchronous=FULL``), and one
fsync per request would cap the receiver at the disk's sync rate. Request threads hand their parsed
notification to this writer and wait; the writer applies everything queued so far in one
transaction (each notification in its own savepoint, so one bad apple does not spoil the batch),
commits once, and wakes them all. Between batches it finishes due hold-downs (``lifecycle.sweep``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diag.triage import lifecycle
from diag.triage.payload import Notification
from diag.triage.store import bump_stat, connect, store_target, transaction

log = logging.getLogger(__name__)

MAX_BATCH = 256
SWEEP_EVERY_S = 1.0


class Unavailable(RuntimeError):
    """The store could not record the delivery now (locked, disk error, shutting down): answer 5xx, let it retry."""


class Rejected(ValueError):
    """Applying the notification failed for a reason a retry cannot fix: answer 4xx, do not invite a retry loop."""


@dataclass
class _Item:
    note: Notification
    done: threading.Event | None = None  # for blocking submit(); the event loop's items use ``notify`` instead
    outcomes: list[str] | None = None
    error: Exception | None = None
    notify: Callable[[_Item], None] | None = None  # called from the writer thread once committed (or failed)
    # True once the sender was answered without it (a 503 after the commit deadline): it will retry, so the writer
    # skips it. Applying it anyway is harmless but, when the writer is behind, it is how a retrying sender buries
    # a receiver: every timed-out delivery and every retry of it would be applied, each making the queue longer.
    abandoned: Callable[[], bool] = lambda: False


class Ingestor:
    """Owns the store's write connection; ``submit`` returns once the notification is committed."""

    def __init__(
        self,
        path: str | Path,
        policy: lifecycle.Policy,
        *,
        on_commit: Callable[[], None] | None = None,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self.path = store_target(path)
        self.policy = policy
        self.on_commit = on_commit
        self.max_batch = max_batch
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._db = connect(self.path)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="triage-writer", daemon=True)
        self._thread.start()

    def submit(self, note: Notification, timeout_s: float = 10.0) -> list[str]:
        if self._stopping:
            raise Unavailable("the receiver is shutting down")
        gave_up = threading.Event()
        item = _Item(note, threading.Event(), abandoned=gave_up.is_set)
        self._queue.put(item)
        if not item.done.wait(timeout_s):  # type: ignore[union-attr]
            gave_up.set()
            raise Unavailable(f"not recorded within {timeout_s:g}s (the store is slow or locked)")
        if item.error is not None:
            raise item.error
        return item.outcomes or []

    def submit_async(self, note: Notification) -> asyncio.Future[list[str]]:
        """For an event loop: a future resolved (in the loop) once the notification is committed or refused."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[str]] = loop.create_future()
        if self._stopping:
            future.set_exception(Unavailable("the receiver is shutting down"))
            return future

        def settle(item: _Item) -> None:
            if future.done():
                return
            if item.error is not None:
                future.set_exception(item.error)
            else:
                future.set_result(item.outcomes or [])

        # future.done() read from the writer thread: a bool the loop sets once (cancelled by the commit deadline)
        self._queue.put(_Item(note, notify=lambda item: loop.call_soon_threadsafe(settle, item), abandoned=future.done))
        return future

    def close(self) -> None:
        self._stopping = True
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._db.close()

    def _run(self) -> None:
        last_sweep = 0.0
        while True:
            try:
                first = self._queue.get(timeout=SWEEP_EVERY_S)
            except queue.Empty:
                first = None
                if self._stopping:
                    return
            batch: list[_Item] = []
            if first is not None:
                batch.append(first)
                while len(batch) < self.max_batch:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._stopping = True
                        break
                    batch.append(nxt)
            elif self._stopping:
                return
            now = time.time()
            batch = [item for item in batch if not item.abandoned()]
            if batch:
                self._commit(batch, now)
            if now - last_sweep >= SWEEP_EVERY_S:
                last_sweep = now
                self._sweep(now)

    def _commit(self, batch: list[_Item], now: float) -> None:
        try:
            with transaction(self._db) as db:
                for item in batch:
                    db.execute("SAVEPOINT one")
                    try:
                        item.outcomes = lifecycle.apply(db, self.policy, item.note, now)
                    except sqlite3.OperationalError:
                        raise
                    except Exception as exc:  # a bug or an impossible state: refuse this one, keep the batch
                        log.exception("triage: could not apply a notification")
                        db.execute("ROLLBACK TO one")
                        item.error = Rejected(f"could not apply the notification: {type(exc).__name__}: {exc}")
                    db.execute("RELEASE one")
                bump_stat(db, "deliveries", len(batch))
                for severity, count in Counter(item.note.route_severity or "any" for item in batch).items():
                    bump_stat(db, f"deliveries:{severity}", count)  # which routes deliver: a dead route shows as 0
        except sqlite3.Error as exc:
            log.warning("triage: store write failed (%s); %d deliveries answered 503", exc, len(batch))
            for item in batch:
                item.outcomes, item.error = None, Unavailable(f"store write failed: {exc}")
        for item in batch:
            if item.done is not None:
                item.done.set()
            if item.notify is not None:
                with contextlib.suppress(RuntimeError):  # the event loop is closed already: nobody waits any more
                    item.notify(item)
        if self.on_commit is not None:
            self.on_commit()

    def _sweep(self, now: float) -> None:
        try:
            with transaction(self._db) as db:
                resolved = lifecycle.sweep(db, self.policy, now)
        except sqlite3.Error as exc:
            log.warning("triage: hold-down sweep failed: %s", exc)
            return
        if resolved and self.on_commit is not None:
            self.on_commit()
