"""Build a Timeline from the flight recorder (SQLite): the single-host path.

Loaders only read and reshape; they never judge.

Speed (a day at 1 Hz plus a million requests, ~2 M JSON rows, in seconds): the recorder is
read kind by kind in time windows of ~256 KiB of JSON, which SQLite hands over already joined into
one JSON array (``_KindStream``); ``TimelineBuilder`` decodes a window at once into typed Structs
(``diag/timeline/fastdecode.py``, msgspec) and turns each field into a numpy column, falling back to
``json.loads`` and then to row-by-row decoding for batches that do not fit, so odd rows cost speed,
never correctness. The cyclic garbage collector is paused while loading (``paused_gc``). A large
recorder is also read by two or more processes at once, each taking a disjoint time range, whose
builders are merged in time order: on a 2-core machine that halves the wall time when the cores
are free. Parallel reading is used only from a single-threaded process (the CLI) -- forking a
multi-threaded one (a server) is not safe -- and only past ``PARALLEL_MIN_ROWS`` rows.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import logging
import math
import multiprocessing
import os
import pickle
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from operator import itemgetter
from pathlib import Path

import numpy as np

from collectors.recorder import FlightRecorder
from collectors.recorder_queries import RecorderReader
from collectors.records import WatchScope, record_from_dict
from diag.sources import blocks
from diag.timeline import Timeline, TimelineBuilder
from diag.timeline.columns import prefer_mapped_memory
from diag.timeline.fastdecode import TYPED_KINDS, paused_gc

log = logging.getLogger(__name__)

BATCH_BYTES = 256 * 1024  # JSON per batch of one kind decoded at once: cache-sized, see batch_rows
BATCH_ROWS = 20_000  # and at most this many rows
PARALLEL_MIN_ROWS = 200_000  # below this, starting processes costs more than it saves
MAX_WORKERS = 4
GAP_READERS_MIN_ROWS = 20_000  # beside stored hours, the rest is read by forked readers from this many rows (~0.1 s)
SEGMENT_S = 15.0  # RecorderWindow: rows of about this many seconds per decoded segment


def load_recorder(
    path: str | Path,
    since_s: float | None = None,
    until: float | None = None,
    *,
    workers: int | None = None,
    use_blocks: bool = True,
) -> Timeline:
    """Records of the last ``since_s`` seconds (all when None) from a flight recorder file (opened read-only).

    ``workers``: processes reading in parallel (default: the CPUs this process may use, at most
    ``MAX_WORKERS``, when the recorder is large and this process is single-threaded; 1 = never).
    ``use_blocks``: take the complete hours from the blocks kept beside the recorder where they still describe
    it (``diag/sources/blocks.py``); the same Timeline either way.
    """
    since = None if since_s is None else (until or time.time()) - since_s
    source = f"recorder:{path}"
    FlightRecorder(path, readonly=True).close()  # a clear error when there is no recorder file
    prefer_mapped_memory()  # see diag/timeline/columns.py: a day's arrays come and go without piling up
    with paused_gc():  # millions of short-lived acyclic objects: see diag/timeline/fastdecode.py
        planned = blocks.plan(path, since, until) if use_blocks else None
        if planned is None:
            timeline = _read_json(Path(path), since, until, source, _workers(workers)).build()
        else:
            timeline = _with_blocks(Path(path), since, until, source, planned, _workers(workers)).build()
    if since is not None:
        timeline.watch_scopes[:0] = _scope_before(Path(path), since)
    return timeline


def _with_blocks(path: Path, since: float | None, until: float | None, source: str, planned: blocks.Plan,
                 workers: int) -> TimelineBuilder:  # fmt: skip
    """The stored hours (``diag/sources/blocks.py``) and the rest read from JSON, merged in time order.

    The hours around the stored ones (the one under way, the oldest, any not stored) are read by forked readers
    while this process reads the blocks (when it may fork: ``workers`` > 1); a block that no longer describes its
    hour is read from JSON here."""
    ranges = list(blocks.gaps(planned.wanted, since, until))
    readers = []
    counts = _rows(path, ranges) if workers > 1 else []
    if workers > 1 and sum(counts) >= GAP_READERS_MIN_ROWS:
        # each range split as a read without blocks would split it (a recorder stored for its last hours only)
        ranges = [part for (lo, hi), n in zip(ranges, counts, strict=True) for part in _plan(path, lo, hi, workers, n)]
        readers = _start_readers(path, ranges, source)
    cached = blocks.load(planned, path)
    pieces: list[tuple[float, TimelineBuilder | tuple[float | None, float | None]]] = [(b.lo, b.builder) for b in cached]
    for (lo, hi), reader in itertools.zip_longest(ranges, readers):
        pieces.append((-math.inf if lo is None else lo, _received(reader, path, source) if reader else (lo, hi)))
    taken = {b.lo for b in cached}
    pieces += [(b.lo, (b.lo, math.nextafter(b.hi, -math.inf))) for b in planned.wanted if b.lo not in taken]
    del cached
    builder = TimelineBuilder(source=source)
    for _, piece in sorted(pieces, key=itemgetter(0)):
        builder.merge(piece if isinstance(piece, TimelineBuilder) else _read_part(path, *piece, source))
    return builder


def _rows(path: Path, ranges: Sequence[tuple[float | None, float | None]]) -> list[int]:
    """The rows of each range (counted once: ``_plan`` is handed them)."""
    with RecorderReader.open(path) as reader:
        return [reader.count(lo, hi) for lo, hi in ranges]


def _scope_before(path: Path, since: float) -> list[WatchScope]:
    """The watch scope in force when the window opens: the agent writes one only at start-up and on change,
    so a window that starts later would otherwise lose what the operator asked to watch."""
    with RecorderReader.open(path) as reader:
        body = reader.latest_before(WatchScope.KIND, since)
    if body is None:
        return []
    try:
        record = record_from_dict(json.loads(body))
    except ValueError:
        return []
    return [record] if isinstance(record, WatchScope) else []


def _read_part(path: Path, since: float | None, until: float | None, source: str) -> TimelineBuilder:
    """Rows of [since, until] (inclusive, like ``FlightRecorder.rows``) handed to a builder in batches of one kind.

    Each kind is read in time windows of about ``BATCH_BYTES`` of JSON, and for the kinds with typed
    decoding SQLite hands over a window as one ready JSON array (``group_concat`` over the window's
    rows in ``ts, id`` order): no Python object per row until decoding, which at two million rows
    saves more than the SQLite read itself costs. The windows of all kinds advance through time
    together (earliest first), so the table pages they share are still in SQLite's cache.
    """
    with RecorderReader.open(path) as reader:
        reader.begin()  # one snapshot for all the window queries, as one SELECT would see (the agent may be writing)
        return read_range(reader, since, until, source)


def read_range(reader: RecorderReader, since: float | None, until: float | None, source: str) -> TimelineBuilder:
    """``_read_part`` on an open reader, in whatever snapshot its caller holds (``blocks.compact`` reads an hour in
    the snapshot it summarised the hour's row ids in)."""
    builder = TimelineBuilder(source=source)
    streams = [_KindStream(reader, kind, since, until) for kind in reader.kinds()]
    heap = [(stream.lo, i) for i, stream in enumerate(streams) if stream.lo is not None]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        stream = streams[i]
        stream.read_window(builder)
        if stream.lo is not None:
            heapq.heappush(heap, (stream.lo, i))
    return builder


class _KindStream:
    """The rows of one kind in [since, until], window after window (``lo``: where the next one starts; None: done)."""

    def __init__(self, reader: RecorderReader, kind: str, since: float | None, until: float | None) -> None:
        self.reader, self.kind, self.until = reader, kind, until
        self.typed = kind in TYPED_KINDS
        self.lo: float | None = reader.first_ts(kind, since, until)
        self.rows = BATCH_ROWS
        if self.lo is not None:
            self.rows = batch_rows(reader.sample(kind, self.lo, 64))

    def read_window(self, builder: TimelineBuilder) -> None:
        """Hand the next window to ``builder``: ``self.rows`` rows or so, never splitting the rows of one instant."""
        reader, kind, lo, until = self.reader, self.kind, self.lo, self.until
        assert lo is not None
        hi = reader.ts_after_rows(kind, lo, self.rows, until)
        if hi is not None and hi == lo:  # more rows at one instant than a window holds: all of them, then on
            hi = reader.next_ts(kind, lo, until)
        self.lo = hi
        if self.typed:
            array, count = reader.joined(kind, lo, hi, until)
            # group_concat's order is the subquery's but not promised (see RecorderReader.joined): the builder refuses
            # a window whose times go backwards, and then it is read row by row below like the others.
            if count and array is not None and builder.add_array(kind, array, count, ordered=True):
                return
        bodies = reader.bodies(kind, lo, hi, until)
        for first in range(0, len(bodies), self.rows):
            builder.add_bodies(kind, bodies[first : first + self.rows])


def batch_rows(sample: Sequence[str | bytes]) -> int:
    """Rows per batch for bodies like ``sample``: about ``BATCH_BYTES`` of JSON, at most ``BATCH_ROWS`` rows.

    Why bytes: each column is read from every decoded row of a batch, and once a batch's objects
    outgrow the CPU caches (~256 KiB of JSON: 160 host rows, 900 requests) every pass over them
    misses; measured here, 20 000-row batches cost 1.3-2x more per row than cache-sized ones.
    """
    if not sample:
        return BATCH_ROWS
    mean = sum(map(len, sample)) / len(sample)
    return max(1, min(BATCH_ROWS, int(BATCH_BYTES / max(mean, 1.0))))


def _workers(requested: int | None) -> int:
    if requested is not None:
        return max(1, requested)
    if threading.active_count() > 1:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS))


def _plan(path: Path, since: float | None, until: float | None, workers: int,
          count: int | None = None) -> list[tuple[float | None, float | None]]:  # fmt: skip
    """Split [since, until] into ``workers`` time ranges holding about the same number of rows.

    Each range but the last ends just below the next one's start, so no row is read twice (the
    recorder's ``rows()`` bounds are inclusive). One range when small or when anything is odd.
    ``count``: the rows in [since, until] when the caller has counted them already.
    """
    if workers <= 1:
        return [(since, until)]
    try:
        reader = RecorderReader.open(path)
    except sqlite3.Error:
        return [(since, until)]
    try:
        if count is None:
            count = reader.count(since, until)
        if count < PARALLEL_MIN_ROWS:
            return [(since, until)]
        bounds: list[float] = []
        for k in range(1, workers):
            ts = reader.ts_at(count * k // workers, since, until)
            if ts is not None and (not bounds or ts > bounds[-1]):
                bounds.append(float(ts))
    except sqlite3.Error:
        return [(since, until)]
    finally:
        reader.close()
    starts: list[float | None] = [since, *bounds]
    ends: list[float | None] = [math.nextafter(b, -math.inf) for b in bounds] + [until]
    return list(zip(starts, ends, strict=True))


def _read_json(path: Path, since: float | None, until: float | None, source: str, workers: int) -> TimelineBuilder:
    """[since, until] from JSON: by one reader, or split among ``workers`` processes when it is large."""
    parts = _plan(path, since, until, workers)
    if len(parts) <= 1:
        return _read_part(path, since, until, source)
    return _load_parallel(path, parts, source)


def _worker(conn: Connection, path: Path, since: float | None, until: float | None, source: str) -> None:
    try:
        _send_builder(conn, _read_part(path, since, until, source).compact())
    except BaseException as exc:  # the parent reads this part itself
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _send_builder(conn: Connection, builder: TimelineBuilder) -> None:
    """A builder through a pipe with its arrays out of band (pickle protocol 5): each array's bytes are sent as they
    are and received straight into their new home, where a plain pickle would hold the whole part twice at once."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(builder, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    conn.send(("ok", head, [v.nbytes for v in views]))
    for view in views:
        conn.send_bytes(view)


def _receive_builder(conn: Connection) -> tuple[str, object]:
    message = conn.recv()
    if message[0] != "ok":
        return message[0], message[1]
    _, head, sizes = message
    buffers = []
    for size in sizes:
        buffer = bytearray(size)  # writable: the arrays made over it are ordinary, writable arrays
        if size:
            conn.recv_bytes_into(buffer)
        else:
            conn.recv_bytes()
        buffers.append(buffer)
    return "ok", pickle.loads(head, buffers=buffers)


@dataclass
class _Reader:
    """A forked process reading [since, until] and sending its builder back through ``recv``."""

    proc: multiprocessing.process.BaseProcess
    recv: Connection
    since: float | None
    until: float | None


def _start_readers(path: Path, parts: Sequence[tuple[float | None, float | None]], source: str) -> list[_Reader]:
    ctx = multiprocessing.get_context("fork")
    started = []
    for since, until in parts:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(send, path, since, until, source), daemon=True)
        proc.start()
        send.close()
        started.append(_Reader(proc, recv, since, until))
    return started


def _received(reader: _Reader, path: Path, source: str) -> TimelineBuilder:
    """What ``reader`` read, or the same range read here when it failed."""
    result: tuple[str, object] = ("error", "no answer")
    with contextlib.suppress(EOFError, OSError, pickle.UnpicklingError):
        result = _receive_builder(reader.recv)
    reader.recv.close()
    reader.proc.join()
    status, payload = result
    del result
    if status == "ok" and isinstance(payload, TimelineBuilder):
        return payload
    log.warning("parallel reader of %s failed (%s); reading that part here", path, payload)
    return _read_part(path, reader.since, reader.until, source)


def _load_parallel(path: Path, parts: list[tuple[float | None, float | None]], source: str) -> TimelineBuilder:
    """Parts 1.. in forked workers, part 0 here; merged in time order."""
    started = _start_readers(path, parts[1:], source)
    builder = _read_part(path, *parts[0], source)
    for reader in started:
        builder.merge(_received(reader, path, source))  # its arrays now belong to ``builder``, let go as joined
    return builder


# --------------------------------------------------------------------------- the live window, read incrementally


@dataclass
class _Segment:
    """Rows ``first_id < id <= last_id`` of the recorder with ``ts >= since`` (as read), decoded into ``builder``.

    ``ts`` holds every such row's time, sorted (rows that did not decode included): what tells whether the
    segment lies wholly inside a later window, and how many of its rows the file should still hold.
    """

    first_id: int
    last_id: int
    since: float
    builder: TimelineBuilder
    ts: np.ndarray


class RecorderWindow:
    """The last ``window_s`` seconds of a flight recorder, re-read every run but decoded only once.

    Why: ``diag collect --diagnose-every 15s`` analyses the last 5 minutes every 15 s, and a full
    ``load_recorder`` decodes all of it each time -- 95 % of it rows the previous run had decoded.
    Here the rows are kept decoded, in segments of row ids of about ``segment_s`` each (ids only
    grow, while times do not -- a tracked process writes its batches late); each run reads only the
    rows past the last id seen, drops the segments that fell out of the window, reads again the one
    the window's start cuts through, and builds the Timeline from the segments.

    Same Timeline as ``load_recorder(path, since_s=window_s)`` (the tests hold it to that), because
    anything it cannot vouch for sends it back to a full read: a different file at the path (moved
    aside and replaced: its inode), row ids going backwards (a new file, a reset), the clock going
    back, or the file holding fewer of the window's rows than the segments do (a retention or size
    trim reached into the window).
    """

    def __init__(self, path: str | Path, window_s: float, segment_s: float = SEGMENT_S) -> None:
        self.path = Path(path)
        self.window_s = window_s
        self.segment_s = segment_s
        self.source = f"recorder:{path}"
        self._segments: list[_Segment] = []
        self._identity: tuple[int, int] | None = None
        self._since = -math.inf
        self._last_id = 0  # the highest row id read (the segments may have dropped it since)
        self.full_reads = 0  # how many runs started from nothing (the first one included)
        self.rows_read = 0  # rows decoded, over all runs

    def reset(self) -> None:
        self._segments = []
        self._identity = None
        self._since = -math.inf
        self._last_id = 0

    def load(self, now: float | None = None) -> Timeline:
        """The window ending at ``now`` (default: the current time), as ``load_recorder`` would build it."""
        since = (time.time() if now is None else now) - self.window_s
        FlightRecorder(self.path, readonly=True).close()  # a clear error when there is no recorder file
        st = os.stat(self.path)
        identity = (st.st_dev, st.st_ino)
        with paused_gc():
            with RecorderReader.open(self.path) as reader:
                reader.begin()  # one snapshot for every query of this run
                top = reader.max_id()
                if not self._still_valid(reader, identity, since, top):
                    self.reset()
                    self.full_reads += 1
                segments = []
                for seg in self._segments:
                    if not seg.ts.size or seg.ts[-1] < since:
                        continue  # wholly before the window
                    if seg.ts[0] < since:  # the window's start cuts through it: read its part again
                        segments.extend(self._read(reader, seg.first_id, seg.last_id, since))
                    else:
                        segments.append(seg)
                if top > self._last_id:
                    segments.extend(self._read(reader, self._last_id, top, since))
            self._segments, self._identity, self._since, self._last_id = segments, identity, since, top
            timeline = TimelineBuilder.merged([s.builder for s in segments], self.source).build()
        timeline.watch_scopes[:0] = _scope_before(self.path, since)
        return timeline

    def _still_valid(self, reader: RecorderReader, identity: tuple[int, int], since: float, top: int) -> bool:
        """Whether the segments still describe the file: same file, ids not reset, nothing of the window deleted."""
        if self._identity is None or identity != self._identity or since < self._since or top < self._last_id:
            return False
        held = sum(int(s.ts.size - np.searchsorted(s.ts, since, "left")) for s in self._segments)
        return reader.count_from(since, self._last_id) == held

    def _read(self, reader: RecorderReader, first_id: int, last_id: int, since: float) -> list[_Segment]:
        """Rows ``first_id < id <= last_id`` with ``ts >= since`` as segments of about ``segment_s`` each.

        Why cut: the segment the window's start cuts through is read again on every run, so it must
        be short -- a first read of the whole window as one segment would be read again every time.
        """
        rows = reader.rows_by_id(first_id, last_id, since)
        self.rows_read += len(rows)
        segments: list[_Segment] = []
        lo, start = first_id, 0
        while start < len(rows):
            end, first_ts = start + 1, rows[start][1]
            while end < len(rows) and rows[end][1] - first_ts < self.segment_s:
                end += 1
            hi = last_id if end == len(rows) else rows[end - 1][0]
            segments.append(self._segment(rows[start:end], lo, hi, since))
            lo, start = hi, end
        return segments

    def _segment(self, rows: list[tuple[int, float, str, str]], first_id: int, last_id: int, since: float) -> _Segment:
        """One segment's rows (in id order) decoded kind by kind, each kind in ``ts, id`` order as ``_read_part`` reads."""
        builder = TimelineBuilder(source=self.source)
        ordered = sorted(rows, key=_KIND_TS_ID)
        start = 0
        while start < len(ordered):
            kind = ordered[start][2]
            end = start
            while end < len(ordered) and ordered[end][2] == kind:
                end += 1
            bodies = [row[3] for row in ordered[start:end]]
            step = batch_rows(bodies[:64])
            for first in range(0, len(bodies), step):
                builder.add_bodies(kind, bodies[first : first + step])
            start = end
        ts = np.sort(np.fromiter((row[1] for row in rows), np.float64, len(rows)))
        return _Segment(first_id, last_id, since, builder, ts)


_KIND_TS_ID = itemgetter(2, 1, 0)
