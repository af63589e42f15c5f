"""Build a Timeline from where the records are: the flight recorder or a bundle directory.

(The Prometheus HTTP API loader lives in ``diag/prometheus_loader.py``: the fleet-scale path.)
Loaders only read and reshape; they never judge.

Speed: a recorder holding a day at 1 Hz plus a million requests is ~2 M JSON rows, and decoding
JSON is most of the cost of ``diag analyze``. Rows are therefore handed to the Timeline builder in
batches per kind (``TimelineBuilder.add_bodies``: one ``json.loads`` per batch, numpy columns), and
a large recorder is read by several processes at once, each taking a disjoint time range, whose
builders are merged in time order. Parallel reading is used only from a single-threaded process
(the CLI) -- forking a multi-threaded one (a server) is not safe -- and only past
``PARALLEL_MIN_ROWS`` rows.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from itertools import islice
from multiprocessing.connection import Connection
from pathlib import Path

from collectors.recorder import FlightRecorder
from diag.timeline import Timeline, TimelineBuilder

log = logging.getLogger(__name__)

BATCH_ROWS = 20_000  # rows per kind decoded in one json.loads (bounded memory, amortised overhead)
PARALLEL_MIN_ROWS = 200_000  # below this, starting processes costs more than it saves
MAX_WORKERS = 4


def load_recorder(
    path: str | Path, since_s: float | None = None, until: float | None = None, *, workers: int | None = None
) -> Timeline:
    """Records of the last ``since_s`` seconds (all when None) from a flight recorder file (opened read-only).

    ``workers``: processes reading in parallel (default: the CPUs this process may use, at most
    ``MAX_WORKERS``, when the recorder is large and this process is single-threaded; 1 = never).
    """
    since = None if since_s is None else (until or time.time()) - since_s
    source = f"recorder:{path}"
    with FlightRecorder(path, readonly=True) as recorder:  # also: a clear error when there is no file
        parts = _plan(Path(path), since, until, _workers(workers))
        if len(parts) <= 1:
            builder = TimelineBuilder(source=source)
            feed_rows(builder, recorder.rows(since=since, until=until))
            return builder.build()
    return _load_parallel(Path(path), parts, source)


def feed_rows(builder: TimelineBuilder, rows: Iterable[tuple[float, str, str]]) -> None:
    """Hand recorder rows ``(ts, kind, json)`` to ``builder`` in batches of one kind."""
    pending: dict[str, list[str]] = defaultdict(list)
    it = iter(rows)
    while block := list(islice(it, 4096)):  # sizes are checked per block, not per row
        for _ts, kind, body in block:
            pending[kind].append(body)
        for kind, batch in pending.items():
            if len(batch) >= BATCH_ROWS:
                builder.add_bodies(kind, batch)
                pending[kind] = []
    for kind, batch in pending.items():
        builder.add_bodies(kind, batch)


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


def _plan(path: Path, since: float | None, until: float | None, workers: int) -> list[tuple[float | None, float | None]]:
    """Split [since, until] into ``workers`` time ranges holding about the same number of rows.

    Each range but the last ends just below the next one's start, so no row is read twice (the
    recorder's ``rows()`` bounds are inclusive). One range when small or when anything is odd.
    """
    if workers <= 1:
        return [(since, until)]
    where, params = [], []
    if since is not None:
        where.append("ts >= ?")
        params.append(since)
    if until is not None:
        where.append("ts <= ?")
        params.append(until)
    clause = (" WHERE " + " AND ".join(where)) if where else ""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
    except sqlite3.Error:
        return [(since, until)]
    try:
        (count,) = db.execute(f"SELECT COUNT(*) FROM records{clause}", params).fetchone()
        if count < PARALLEL_MIN_ROWS:
            return [(since, until)]
        bounds: list[float] = []
        for k in range(1, workers):
            sql = f"SELECT ts FROM records{clause} ORDER BY ts LIMIT 1 OFFSET ?"
            row = db.execute(sql, (*params, count * k // workers)).fetchone()
            if row is not None and (not bounds or row[0] > bounds[-1]):
                bounds.append(float(row[0]))
    except sqlite3.Error:
        return [(since, until)]
    finally:
        db.close()
    starts: list[float | None] = [since, *bounds]
    ends: list[float | None] = [math.nextafter(b, -math.inf) for b in bounds] + [until]
    return list(zip(starts, ends, strict=True))


def _read_part(path: Path, since: float | None, until: float | None, source: str) -> TimelineBuilder:
    builder = TimelineBuilder(source=source)
    with FlightRecorder(path, readonly=True) as recorder:
        feed_rows(builder, recorder.rows(since=since, until=until))
    return builder


def _worker(conn: Connection, path: Path, since: float | None, until: float | None, source: str) -> None:
    try:
        conn.send(("ok", _read_part(path, since, until, source)))
    except BaseException as exc:  # the parent reads this part itself
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _load_parallel(path: Path, parts: list[tuple[float | None, float | None]], source: str) -> Timeline:
    """Parts 1.. in forked workers, part 0 here; merged in time order."""
    ctx = multiprocessing.get_context("fork")
    started = []
    for since, until in parts[1:]:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(send, path, since, until, source), daemon=True)
        proc.start()
        send.close()
        started.append((proc, recv, since, until))
    builder = _read_part(path, *parts[0], source)
    for proc, recv, since, until in started:
        result: tuple[str, object] = ("error", "no answer")
        with contextlib.suppress(EOFError, OSError):
            result = recv.recv()
        recv.close()
        proc.join()
        status, payload = result
        if status == "ok" and isinstance(payload, TimelineBuilder):
            builder.merge(payload)
        else:
            log.warning("parallel reader of %s failed (%s); reading that part here", path, payload)
            builder.merge(_read_part(path, since, until, source))
    return builder.build()


def load_bundle(path: str | Path) -> Timeline:
    """Records from a bundle's ``timeline/*.jsonl`` (one JSON record per line; a bad line is counted, not fatal)."""
    root = Path(path)
    folder = root / "timeline"
    if not folder.is_dir():
        raise FileNotFoundError(f"{root} is not an llm-diag bundle (no timeline/ folder)")
    builder = TimelineBuilder(source=f"bundle:{root}")
    for file in sorted(folder.glob("*.jsonl")):
        with file.open(encoding="utf-8", errors="replace") as fh:
            batch: list[str] = []
            for line in fh:
                line = line.strip()
                if line:
                    batch.append(line)
                    if len(batch) >= BATCH_ROWS:
                        builder.add_bodies(file.stem, batch)
                        batch = []
            builder.add_bodies(file.stem, batch)
    return builder.build()
