"""Hand records from the request path to the flight recorder in batches.

Why a buffer in front of ``RecorderWriter``: ``RecorderWriter.submit`` puts each record on a
``queue.Queue``, which wakes the writer thread on every put; under steady traffic it then writes
transactions of one record each, and every wake-up takes the GIL from the event loop right when
the loop released it for a socket call (measured on a trivial endpoint: +50 us of event-loop CPU
and 1.7 writer context switches per request -- far past a 0.85x throughput budget). Here the
request path only appends to a ``collections.deque`` (atomic, no lock, no wake-up). Every
``batch_size`` records (256) the request that fills the batch hands the whole batch to the writer
as one queue item (no I/O, one lock), so the writer wakes once per batch and commits it in one
transaction; a daemon thread forwards leftovers every ``interval_s`` (1 s) when traffic is low.

Why 1 s and not less: below ``batch_size`` requests a second, every forward is one writer wake-up and
one SQLite transaction whatever it holds; measured at 7 rows/s (one 64-token completion at a time
on llama-cpp-python's server), the buffer's and writer's threads took 306 us of CPU per row with a
0.25 s interval and 101 us with 1 s -- 0.14 % of that completion's CPU. The price: a row reaches the
recorder up to a second after its request ended (a clean shutdown still flushes everything; a
process killed outright loses at most its last second of rows).

Also: a request is buffered as a plain tuple (:func:`request_row`: integer-microsecond timestamps,
pre-encoded strings) rather than a ``RequestTiming`` object, and SQLite renders its JSON -- the same
object ``Record.to_json`` produces -- inside the INSERT, with the GIL released
(``recorder.REQUEST_ROW_FIELDS``). Per request the event loop pays for one small tuple and one
deque append. Bounded: past ``max_pending`` buffered records new ones are dropped and counted --
losing telemetry beats stalling inference.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import threading
import time
from collections.abc import Callable

from collectors.recorder import REQUEST_NO_START_US, REQUEST_NO_TRACE_ID, REQUEST_NULL, RecorderWriter, RequestRow
from collectors.records import Record

_STRINGS: dict[str, str] = {}  # JSON-encoded routes/models/outcomes: a handful of distinct values


def _json_str(value: str) -> str:
    encoded = _STRINGS.get(value)
    if encoded is None:
        encoded = json.dumps(value)
        if len(_STRINGS) < 4096:
            _STRINGS[value] = encoded
    return encoded


def request_row(
    arrival: float,
    start: float | None,
    finish: float,
    outcome: str,
    route: str,
    model: str,
    prompt_tokens: int | None,
    output_tokens: int | None,
    ttft_s: float | None,
    pid: int | None,
    trace_id: str | None,
) -> RequestRow | None:
    """A ``RequestTiming`` (with ``ts = finish``) as a recorder request row, or None outside its domain.

    The row holds what SQLite needs to render the record's JSON (``recorder.REQUEST_ROW_FIELDS``):
    Unix timestamps as integer microseconds -- integer arithmetic, no float formatting on the hot
    path, and ``time.time()`` means nothing below a microsecond anyway. None (the caller then
    submits a ``RequestTiming`` record) for anything unusual: a timestamp outside 1970..5138, a
    non-int token count, a non-finite TTFT, a trace id that is not hex.
    """
    if not (0.0 <= arrival < 1e11 and 0.0 <= finish < 1e11):
        return None
    if start is None:
        start_us = REQUEST_NO_START_US
    elif 0.0 <= start < 1e11:
        start_us = int(start * 1e6 + 0.5)
    else:
        return None
    if prompt_tokens is not None and type(prompt_tokens) is not int:
        return None
    if output_tokens is not None and type(output_tokens) is not int:
        return None
    if ttft_s is not None and not (type(ttft_s) is float and -1e300 < ttft_s < 1e300):
        return None
    if trace_id is not None and not (type(trace_id) is str and trace_id.isalnum() and trace_id.isascii()):
        return None
    strings = _STRINGS  # cache hits without a call: this runs once per request
    return (
        int(finish * 1e6 + 0.5),
        int(arrival * 1e6 + 0.5),
        start_us,
        strings.get(outcome) or _json_str(outcome),
        strings.get(route) or _json_str(route),
        strings.get(model) or _json_str(model),
        REQUEST_NULL if prompt_tokens is None else prompt_tokens,  # never None: see recorder.REQUEST_NULL
        REQUEST_NULL if output_tokens is None else output_tokens,
        REQUEST_NULL if ttft_s is None else ttft_s,
        REQUEST_NULL if pid is None else pid,
        REQUEST_NO_TRACE_ID if trace_id is None else trace_id,
    )


EXIT_FLUSH_TIMEOUT_S = 5.0  # how long an exiting process waits for its last rows to reach the disk


class RecordBuffer:
    """Lock-free append on the hot path; a daemon thread forwards batches to a ``RecorderWriter``.

    ``on_drop(stage, n)`` is called (from any thread) for records that could not be kept:
    ``recorder_drop`` (never reached the writer) and ``recorder_write`` (the writer failed to store
    them; noticed at the next drain, flush or close -- never on the request path).
    """

    def __init__(
        self,
        writer: RecorderWriter,
        *,
        owns_writer: bool = True,
        interval_s: float = 1.0,
        batch_size: int = 256,
        max_pending: int = 100_000,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        self.writer = writer
        self.owns_writer = owns_writer
        self.interval_s = interval_s
        self.batch_size = batch_size
        self.max_pending = max_pending
        self._on_drop = on_drop
        self._pending: collections.deque[Record | RequestRow] = collections.deque()
        self._seen_write_errors = writer.write_errors
        self._stop = threading.Event()
        self._drain_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="llmdiag-tracker-buffer", daemon=True)
        self._thread.start()
        # Rows wait up to ``interval_s`` here, so a worker that exits between two forwards (SIGTERM to a uvicorn
        # or gunicorn worker: the server returns, the interpreter exits) would lose them; at exit they are
        # written first. Registered on the buffer, not on the tracker: the server may drop its app, and with it
        # the tracker, before the interpreter exits -- the buffer lives on (its thread holds it) with its rows.
        atexit.register(self.close, EXIT_FLUSH_TIMEOUT_S)

    def submit(self, item: Record | RequestRow) -> bool:
        """Keep a record, or a request row (:func:`request_row`), for the next batch. Never blocks, never raises."""
        pending = self._pending
        if len(pending) >= self.max_pending:
            self._drop("recorder_drop", 1)
            return False
        pending.append(item)
        if len(pending) >= self.batch_size:
            self._drain(blocking=False)  # if the timer thread is draining right now, it takes these too
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Forward everything buffered and wait until the writer has it on disk."""
        deadline = time.monotonic() + timeout
        self._drain()
        ok = self.writer.flush(max(0.0, deadline - time.monotonic()))
        self._count_write_errors()
        return ok

    def close(self, timeout: float = 10.0) -> None:
        """Forward what is left, stop the thread, close (or flush, when shared) the writer. Once; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout)
        self._drain()
        if self.owns_writer:
            self.writer.close(timeout)
        else:
            self.writer.flush(timeout)
        self._count_write_errors()

    def abandon(self) -> None:
        """In a forked child: this is the parent's buffer, whose threads do not run here -- never forward or close it
        (its rows are the parent's to write; waiting on its writer at exit would only time out)."""
        self._closed = True
        self._pending.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._drain()

    def _drain(self, blocking: bool = True) -> None:
        pending = self._pending
        if not self._drain_lock.acquire(blocking):  # one drainer at a time keeps the order
            return
        try:
            records: list[Record] = []
            rows: list[RequestRow] = []
            for _ in range(len(pending)):  # what is there now; later appends wait for the next drain
                try:
                    item = pending.popleft()
                except IndexError:
                    break
                (rows if type(item) is tuple else records).append(item)  # type: ignore[arg-type]
            if not (records or rows):
                return
            try:
                kept = self.writer.submit_batch(records, rows)
            except Exception:
                kept = False
            if not kept:
                self._drop("recorder_drop", len(records) + len(rows))
            self._count_write_errors()
        finally:
            self._drain_lock.release()

    def _count_write_errors(self) -> None:
        errors = self.writer.write_errors  # counted by the writer thread
        seen = self._seen_write_errors
        if errors > seen:
            self._seen_write_errors = errors
            self._drop("recorder_write", errors - seen)

    def _drop(self, stage: str, n: int) -> None:
        if self._on_drop is not None:
            with contextlib.suppress(Exception):
                self._on_drop(stage, n)
