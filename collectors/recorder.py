"""The flight recorder: a bounded, crash-safe local store of records (SQLite in WAL mode).

Why SQLite/WAL: several writers (the host agent, every tracked serving process) append at once; a
``kill -9`` or an OOM kill of any of them must never corrupt the file (WAL with synchronous=NORMAL
loses at most the last uncommitted transaction, never the database); and ``diag bundle`` must read
the last hour without any server running. Rows hold the same JSON a bundle's ``timeline/*.jsonl``
holds, so a third party can write records without importing llm-diag.

Bounds: rows older than ``retention_s`` go first, then the oldest rows until the database plus its
WAL fit in ``max_size_bytes`` (plus a reserve file of at most 512 KiB, given up when the disk fills).
``auto_vacuum=INCREMENTAL`` returns freed pages to the file system,
so the bound is on bytes on disk, not only on rows.

The SQL itself -- the schema, these writes, and every read the readers share -- is in
``collectors.recorder_queries``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from collectors import recorder_queries as sql
from collectors.recorder_queries import REQUEST_NO_START_US as REQUEST_NO_START_US  # the request-row layout, which the
from collectors.recorder_queries import REQUEST_NO_TRACE_ID as REQUEST_NO_TRACE_ID  # tracker's buffer imports from here
from collectors.recorder_queries import REQUEST_NULL as REQUEST_NULL
from collectors.recorder_queries import REQUEST_ROW_FIELDS, RecorderReader, RequestRow, connect_readonly
from collectors.records import Record, RecordDecodeError, record_from_json

log = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 2 * 3600.0
DEFAULT_MAX_SIZE_BYTES = 256 * 1024 * 1024
ENV_RECORDER = "LLMDIAG_RECORDER"
ENV_STATE_DIR = "LLMDIAG_STATE_DIR"
SYSTEM_STATE_DIR = Path("/var/lib/llm-diag")
FORMAT_VERSION = "1"
RESERVE_BYTES = 512 * 1024  # see FlightRecorder.make_room
_INSERT_CHUNK = 200  # 800 (2200 for request rows) bound parameters per statement; SQLite allows 32766 since 3.32
_INSERT_SQL: dict[int, str] = {}
_REQUEST_SQL: dict[int, str] = {}


def state_dir() -> Path:
    """Where llm-diag keeps its files: ``$LLMDIAG_STATE_DIR``; for root ``/var/lib/llm-diag``; else the XDG state dir.

    Why root gets the system directory: the shipped systemd units run the agent and the receiver with
    ``StateDirectory=llm-diag`` (``/var/lib/llm-diag``), and the person who runs ``diag analyze``,
    ``diag bundle`` or ``diag triage`` on that host mid-incident is root. Had root looked in its own home
    (``/root/.local/state``) as any user does, every command would say "no flight recorder" beside a
    running agent. An ordinary user keeps ``~/.local/state/llm-diag`` (``$XDG_STATE_HOME``).
    """
    env = os.environ.get(ENV_STATE_DIR)
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return SYSTEM_STATE_DIR
    from platformdirs import user_state_dir

    return Path(user_state_dir("llm-diag"))


def default_recorder_path() -> Path:
    """``$LLMDIAG_RECORDER``, else ``recorder.db`` in ``state_dir()``."""
    env = os.environ.get(ENV_RECORDER)
    if env:
        return Path(env)
    return state_dir() / "recorder.db"


class RecorderCorrupt(Exception):
    """The file at the recorder's path is not a flight recorder (a disk fault, a truncated copy, another file).

    Why a type of its own: readers (``diag analyze``, ``diag bundle``) turn it into one clear line naming
    the file, and the agent moves the file aside and starts afresh instead of refusing to run.
    """

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(f"{path} is not a readable flight recorder ({detail})")
        self.path = path
        self.detail = detail


_SQLITE_CORRUPT, _SQLITE_NOTADB, _SQLITE_FULL = 11, 26, 13


def is_corruption(exc: sqlite3.Error) -> bool:
    """SQLITE_CORRUPT or SQLITE_NOTADB: the file itself is bad (as opposed to locked, full or read-only)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(exc)
    return "not a database" in text or "malformed" in text


def _is_full(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return (code is not None and code & 0xFF == _SQLITE_FULL) or "disk is full" in str(exc)


_SQLITE_HEADER = b"SQLite format 3\x00"


def _check_header(path: Path) -> None:
    """Refuse a file that does not start like a SQLite database -- before SQLite opens it.

    Why before: opening such a file and closing the connection makes SQLite delete the -wal and -shm
    beside it (and a read-only open creates a -shm), destroying what a forensic look might need.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(100)
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise RecorderCorrupt(path, "a folder, not a file") from None
    if not head:
        return  # empty: a new recorder (SQLite writes the header on the first transaction)
    if not head.startswith(_SQLITE_HEADER):
        raise RecorderCorrupt(path, "file is not a database: it does not start with the SQLite header")
    if len(head) < 100:
        raise RecorderCorrupt(path, f"truncated: {len(head)} bytes, shorter than a SQLite header")


def move_aside(path: Path, now: float | None = None, *, label: str = "corrupt", sidecars_only: bool = False) -> Path:
    """Rename a damaged recorder (and its -wal/-shm) to ``<name>.<label>-<UTC time>``; return the new name.

    The file is kept, not deleted: it is evidence of a disk fault and may still hold history a forensic
    tool can recover. The -wal and -shm files move first: a fresh database must never meet a stale WAL.
    ``sidecars_only``: move only a -wal/-shm left behind by a file that was deleted or replaced.
    """
    stamp = time.strftime("%Y%m%dT%H%MZ", time.gmtime(time.time() if now is None else now))
    target = path.with_name(f"{path.name}.{label}-{stamp}")
    n = 1
    while any(os.path.lexists(f"{target}{s}") for s in ("", "-wal", "-shm")):
        n += 1
        target = path.with_name(f"{path.name}.{label}-{stamp}-{n}")
    for suffix in ("-wal", "-shm"):
        if os.path.lexists(f"{path}{suffix}"):
            os.rename(f"{path}{suffix}", f"{target}{suffix}")
    if not sidecars_only:
        os.rename(path, target)
    return target


@dataclass(frozen=True)
class TrimResult:
    deleted_by_age: int
    deleted_by_size: int
    size_bytes: int


class FlightRecorder:
    """One connection to the recorder file. Not shared across threads: give each thread its own."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        retention_s: float = DEFAULT_RETENTION_S,
        max_size_bytes: int = DEFAULT_MAX_SIZE_BYTES,
        *,
        readonly: bool = False,
    ) -> None:
        if retention_s <= 0:
            raise ValueError("retention must be positive")
        if max_size_bytes < 64 * 1024:
            raise ValueError("max size must be at least 64 KiB")
        self.path = Path(path)
        self.retention_s = retention_s
        self.max_size_bytes = max_size_bytes
        self.readonly = readonly
        self.disk_full = 0  # writes that met a full disk (the oldest rows were dropped to make room)
        _check_header(self.path)
        if readonly:
            if not self.path.exists():
                raise FileNotFoundError(f"no flight recorder at {self.path}")
            self._db = connect_readonly(self.path)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False, isolation_level=None)
        try:
            self._check_is_recorder()
            if not readonly:
                self._init_schema()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            if is_corruption(exc):
                raise RecorderCorrupt(self.path, str(exc)) from None
            raise
        except RecorderCorrupt:
            self._db.close()
            raise
        self._identity = self._stat_identity()
        try:  # SQLite before 3.32 allows 999 bound parameters per statement
            variables = self._db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        except (AttributeError, sqlite3.Error):
            variables = 999
        self._request_chunk = max(1, min(_INSERT_CHUNK, variables // len(REQUEST_ROW_FIELDS)))

    # ------------------------------------------------------------------ setup

    def _check_is_recorder(self) -> None:
        """Reading the schema fails on a file that is not SQLite; a SQLite file of someone else's is refused too."""
        tables = {row[0] for row in self._db.execute(sql.TABLES)}
        if tables and "records" not in tables:
            raise RecorderCorrupt(self.path, f"a SQLite database of something else: tables {', '.join(sorted(tables)[:5])}")
        if not tables and self.readonly and self.path.stat().st_size > 0:
            raise RecorderCorrupt(self.path, "a SQLite database with no records table")

    def _stat_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def file_problem(self) -> str | None:
        """``"deleted"`` or ``"replaced"`` when the path no longer names the file this connection writes, else None.

        Why: SQLite keeps writing to an open file that was unlinked or renamed over -- every later sample
        would be lost without an error. One stat per sample is the price of noticing.
        """
        now = self._stat_identity()
        if now is None:
            return "deleted" if not os.path.lexists(self.path) else None
        if self._identity is not None and now != self._identity:
            return "replaced"
        return None

    def _init_schema(self) -> None:
        db = self._db
        db.execute("PRAGMA busy_timeout=10000")
        # auto_vacuum only takes effect before the first table exists.
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        # After a checkpoint the WAL is truncated to this size, so the WAL stays inside the bound; and the WAL is
        # folded into the database every half reserve (256 KiB) rather than SQLite's 4 MiB default: on a disk that
        # fills up, giving up the reserve must leave room to fold the whole WAL in (see make_room).
        db.execute(f"PRAGMA journal_size_limit={self._wal_budget()}")
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
        db.execute(f"PRAGMA wal_autocheckpoint={max(16, min(self._wal_budget(), RESERVE_BYTES // 2) // page_size)}")
        self._make_reserve()
        db.executescript(sql.SCHEMA)
        db.execute(sql.SET_FORMAT, (FORMAT_VERSION,))

    def _wal_budget(self) -> int:
        return max(32 * 1024, min(16 * 1024 * 1024, self.max_size_bytes // 8))

    # ------------------------------------------------------------------ writing

    def write(self, records: Iterable[Record], request_rows: Sequence[RequestRow] = ()) -> int:
        """Append records (and request rows, see ``REQUEST_ROW_FIELDS``) in one transaction. Returns how many.

        On a full disk the oldest rows are deleted to make room (a tenth, then a quarter, then half) and the
        write tried again; if it still does not fit, the error is raised (the transaction rolled back:
        nothing half-written).
        """
        rows = [(r.ts, r.KIND, r.SCHEMA, r.to_json()) for r in records]
        for share in (0.1, 0.25, 0.5):  # a batch larger than a tenth of the history needs more room
            try:
                return self._write_once(rows, request_rows)
            except sqlite3.OperationalError as exc:
                if not _is_full(exc):
                    raise
                self.disk_full += 1
                log.warning("flight recorder %s: disk full; dropping the oldest %d %% of rows to make room",
                            self.path, share * 100)  # fmt: skip
                self.make_room(share)
        return self._write_once(rows, request_rows)

    def _write_once(self, rows: Sequence[tuple[float, str, int, str]], request_rows: Sequence[RequestRow]) -> int:
        if not request_rows:
            return self.write_rows(rows)
        with self._transaction():
            self._insert_rows(rows)
            self._insert_request_rows(request_rows)
        return len(rows) + len(request_rows)

    # A full disk leaves SQLite no room to log the very DELETE that would free space, nor to fold the WAL
    # into the database. So the writer keeps a small reserve file beside the recorder (zeros, ``<name>-reserve``)
    # and gives it up first when the disk is full; it is re-made, best effort, once there is space again.

    @property
    def reserve_path(self) -> Path:
        return Path(f"{self.path}-reserve")

    def _reserve_bytes(self) -> int:
        return min(RESERVE_BYTES, self.max_size_bytes // 8)

    def _make_reserve(self) -> bool:
        want = self._reserve_bytes()
        with contextlib.suppress(OSError):
            if os.path.getsize(self.reserve_path) >= want:
                return True
        try:
            with open(self.reserve_path, "wb") as fh:
                fh.write(bytes(want))  # written, not a sparse hole: the blocks must really be taken
                fh.flush()
                os.fsync(fh.fileno())
            return True
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(self.reserve_path)  # half a reserve is no reserve: try again later
            return False

    def make_room(self, share: float = 0.1) -> int:
        """Delete the oldest ``share`` of the rows (at least 64) and hand their pages back; returns rows deleted.

        The reserve file goes first, then the WAL is folded into the database and truncated: that is the
        space the DELETE itself needs to be logged. More is deleted (the share doubling, at most four
        rounds) until the reserve can be made again -- without it the next full disk could not be
        answered. Errors here are swallowed: the retried write reports the failure if there is one.
        """
        deleted = 0
        with contextlib.suppress(OSError):
            os.unlink(self.reserve_path)
        for _ in range(4):
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                n = max(64, int(self.count() * share))
                with self._transaction():
                    deleted += self._db.execute(sql.DELETE_OLDEST, (n,)).rowcount
                self._reclaim()
            if self._make_reserve():
                break
            share = min(0.5, share * 2)
        return deleted

    def write_request_rows(self, rows: Sequence[RequestRow]) -> int:
        """Append request rows (``REQUEST_ROW_FIELDS`` tuples) in one transaction; SQLite renders their JSON."""
        if not rows:
            return 0
        with self._transaction():
            self._insert_request_rows(rows)
        return len(rows)

    def write_rows(self, rows: Sequence[tuple[float, str, int, str]]) -> int:
        """Append pre-serialised rows ``(ts, kind, schema, json)`` in one transaction."""
        if not rows:
            return 0
        with self._transaction():
            self._insert_rows(rows)
        return len(rows)

    def _insert_rows(self, rows: Sequence[tuple[float, str, int, str]]) -> None:
        self._insert_chunked(rows, _INSERT_CHUNK, _INSERT_SQL, sql.RECORD_INSERT_HEAD, sql.RECORD_VALUES, "")

    def _insert_request_rows(self, rows: Sequence[RequestRow]) -> None:
        self._insert_chunked(rows, self._request_chunk, _REQUEST_SQL, sql.REQUEST_INSERT_HEAD, sql.REQUEST_VALUES,
                             sql.REQUEST_INSERT_TAIL)  # fmt: skip

    def _insert_chunked(self, rows: Sequence[tuple], step: int, cache: dict[int, str], head: str, values: str,
                        close: str) -> None:  # fmt: skip
        """Multi-row INSERTs of ``step`` rows at a time (``head`` + ``values`` x n + ``close``), SQL cached per n.

        Why not executemany: it steps one row at a time and releases and retakes the GIL per row, which
        a writer thread beside a busy event loop pays for dearly.
        """
        for i in range(0, len(rows), step):
            chunk = rows[i : i + step]
            statement = cache.get(len(chunk))
            if statement is None:
                statement = head + ",".join([values] * len(chunk)) + close
                if len(cache) < 64:
                    cache[len(chunk)] = statement
            self._db.execute(statement, [v for row in chunk for v in row])

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # ------------------------------------------------------------------ bounds

    def size_bytes(self) -> int:
        """Database file plus WAL, as on disk."""
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(OSError):
                total += os.stat(f"{self.path}{suffix}").st_size
        return total

    def trim(self, now: float | None = None) -> TrimResult:
        """Enforce retention, then size; oldest rows go first. Safe to call from any writer."""
        now = time.time() if now is None else now
        with self._transaction():
            by_age = self._db.execute(sql.DELETE_OLDER_THAN, (now - self.retention_s,)).rowcount
        self._reclaim()
        by_size = 0
        budget = self.max_size_bytes - self._wal_budget()
        for _ in range(64):  # each pass deletes a share proportional to the excess; converges in a few
            used = self._used_bytes()
            if used <= budget:
                break
            count = self.count()
            if count == 0:
                break
            per_row = max(1.0, used / count)
            n = max(16, int((used - budget) / per_row * 1.1) + 1)
            with self._transaction():
                by_size += self._db.execute(sql.DELETE_OLDEST, (n,)).rowcount
            self._reclaim()
        if not self.reserve_path.exists():
            self._make_reserve()  # space came back after a full disk
        return TrimResult(by_age, by_size, self.size_bytes())

    def _used_bytes(self) -> int:
        page_size = self._db.execute("PRAGMA page_size").fetchone()[0]
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        return (pages - free) * page_size

    def _reclaim(self) -> None:
        """Give freed pages back to the file system and fold the WAL into the database."""
        # Through execute() the pragma frees a single page; executescript steps it to completion.
        self._db.executescript("PRAGMA incremental_vacuum;")
        with contextlib.suppress(sqlite3.OperationalError):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # ------------------------------------------------------------------ reading

    def rows(
        self, kinds: Sequence[str] | None = None, since: float | None = None, until: float | None = None
    ) -> Iterator[tuple[float, str, str]]:
        """Raw rows ``(ts, kind, json)`` in time order: the cheap path for loaders that parse columns."""
        yield from RecorderReader(self._db).rows(kinds, since, until)

    def read(
        self, kinds: Sequence[str] | None = None, since: float | None = None, until: float | None = None
    ) -> Iterator[Record]:
        """Decoded records in time order; rows this version cannot decode are skipped and logged once each kind."""
        warned: set[str] = set()
        for _ts, kind, body in self.rows(kinds, since, until):
            try:
                yield record_from_json(body)
            except RecordDecodeError as exc:
                if kind not in warned:
                    warned.add(kind)
                    log.warning("skipping undecodable %s rows in %s: %s", kind, self.path, exc)

    def count(self, kind: str | None = None) -> int:
        return RecorderReader(self._db).count(kind=kind)

    def integrity_ok(self) -> bool:
        return self._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.close()

    def abandon(self) -> None:
        """Close a connection whose path now names another file (or none): fold what we can, then set the
        WAL and shared-memory files left at the path aside (``<name>.orphan-<time>-wal``).

        Why: SQLite does not delete the -wal of a file that has moved, and a WAL left beside a new file at
        the same path would be replayed into it -- into a stranger's pages.
        """
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.close()
        if any(os.path.lexists(f"{self.path}{s}") for s in ("-wal", "-shm")):
            with contextlib.suppress(OSError):
                move_aside(self.path, label="orphan", sidecars_only=True)

    def __enter__(self) -> FlightRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_for_writing(
    path: str | os.PathLike[str], retention_s: float = DEFAULT_RETENTION_S, max_size_bytes: int = DEFAULT_MAX_SIZE_BYTES
) -> tuple[FlightRecorder, Path | None]:
    """Open the recorder for the agent; a damaged file is moved aside (kept) and a fresh one started.

    Returns the recorder and, when that happened, where the damaged file now is. Why never refuse:
    an agent that will not start over a bad file records nothing through the very incident the disk
    fault may be part of. Raises OSError/ValueError only when a fresh file cannot be made either.
    """
    try:
        return FlightRecorder(path, retention_s, max_size_bytes), None
    except RecorderCorrupt as exc:
        aside = move_aside(Path(path))
        log.warning("%s; moved it to %s and started a fresh recorder", exc, aside)
        return FlightRecorder(path, retention_s, max_size_bytes), aside


@dataclass(frozen=True)
class _Batch:
    records: list[Record]
    request_rows: list[RequestRow]


class RecorderWriter:
    """A background writer for hot paths (request handlers, the event loop).

    ``submit`` only appends to a bounded in-memory queue -- no disk I/O on the caller's thread, and it
    never raises. A daemon thread writes batches every ``flush_interval_s`` and trims now and then.
    When the queue is full, records are dropped and counted (``dropped``) rather than blocking the
    app: losing telemetry is better than stalling inference.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        retention_s: float = DEFAULT_RETENTION_S,
        max_size_bytes: int = DEFAULT_MAX_SIZE_BYTES,
        *,
        flush_interval_s: float = 0.5,
        max_queue: int = 100_000,
        trim_interval_s: float = 30.0,
    ) -> None:
        self.path = Path(path)
        self._args = (retention_s, max_size_bytes)
        self._queue: queue.Queue[Record | _Batch | None] = queue.Queue(maxsize=max_queue)
        self._max_pending = max_queue
        self._flush_interval_s = flush_interval_s
        self._trim_interval_s = trim_interval_s
        self.dropped = 0
        self.written = 0
        self.write_errors = 0
        self._flushed = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="llmdiag-recorder", daemon=True)
        self._thread.start()

    def submit(self, record: Record) -> bool:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            return False
        with self._flushed:
            self._pending += 1
        return True

    def submit_batch(self, records: Sequence[Record] = (), request_rows: Sequence[RequestRow] = ()) -> bool:
        """Queue many records (and request rows, see ``REQUEST_ROW_FIELDS``) as one item: one wake-up, one lock.

        Never blocks or raises; past ``max_queue`` records pending, the whole batch is dropped and counted.
        """
        n = len(records) + len(request_rows)
        if n == 0:
            return True
        with self._flushed:
            if self._pending + n > self._max_pending:
                self.dropped += n
                return False
            self._pending += n
        try:
            self._queue.put_nowait(_Batch(list(records), list(request_rows)))
        except queue.Full:
            with self._flushed:
                self._pending -= n
                self._flushed.notify_all()
            self.dropped += n
            return False
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far is on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._flushed:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._flushed.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout)

    def _run(self) -> None:
        recorder = None
        last_trim = 0.0
        while True:
            batch: list[Record] = []
            request_rows: list[RequestRow] = []
            stop = False
            try:
                item = self._queue.get(timeout=self._flush_interval_s)
                while True:
                    if item is None:
                        stop = True
                        break
                    if type(item) is _Batch:
                        batch.extend(item.records)
                        request_rows.extend(item.request_rows)
                    else:
                        batch.append(item)
                    if len(batch) + len(request_rows) >= 5000:
                        break
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass
            n = len(batch) + len(request_rows)
            if n:
                try:
                    if recorder is None:
                        recorder = FlightRecorder(self.path, *self._args)
                    self.written += recorder.write(batch, request_rows)
                    now = time.monotonic()
                    if now - last_trim >= self._trim_interval_s:
                        last_trim = now
                        recorder.trim()
                except Exception as exc:  # the app must never see our failures
                    self.write_errors += 1
                    log.warning("flight recorder write failed (%d records lost): %s", n, exc)
                with self._flushed:
                    self._pending -= n
                    self._flushed.notify_all()
            if stop:
                break
        if recorder is not None:
            recorder.close()
