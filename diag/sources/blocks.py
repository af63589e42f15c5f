"""Complete hours of a flight recorder kept decoded beside it, so a day's analysis does not decode 2 M JSON rows again.

Why: the recorder stores every record as a JSON row, which is what lets any writer (the agent, a tracked service,
a sidecar) append without agreeing on more than the record's JSON. Reading a busy day back costs SQLite handing
over ~1 GB of JSON and msgspec decoding it -- 5 s of CPU before the first column exists, measured -- while the same
numbers as columns read back in a fraction of a second. So the hours that are over are decoded once more, by
``diag`` (the decoding that defines the columns lives in ``diag.timeline``; the agent's ``collectors`` may not
import it), and kept as what reading them gave: the ``TimelineBuilder`` of that hour, columns joined, its arrays
stored as raw bytes (pickle protocol 5, the arrays out of band), one row per hour in a SQLite file beside the
recorder, ``<recorder>.blocks``.

Trusted only while it describes the recorder exactly, so a block never changes a Timeline:
- an hour's rows are summarised when it is decoded (count, sum and largest of the row ids with ``lo <= ts < hi``,
  read in the same snapshot as the rows): a row written late into that hour, or one trimmed out of it, changes the
  summary, and the reader then decodes that hour's JSON as before;
- a block carries the digest of the code that decoded it (``VERSION``: the Timeline's package and the record
  declarations): after an upgrade, old blocks are ignored and written again;
- an hour is decoded only once it is ``LATE_S`` over (the tracker records a request when it ends, a tracked
  process writes its batches late) and only when the recorder still holds all of it (the oldest hour is being
  trimmed away and is left to the JSON).
- the stored pickle is read by an unpickler that builds only the Timeline's own classes, numpy arrays and
  builtin containers: the file sits beside the recorder with the same owner, but nothing in it can name code.

The file is bounded by the recorder: blocks of hours the recorder no longer holds are dropped on every
``compact``; a day of 1 Hz samples and a million requests is ~200 MB of columns against ~1 GB of JSON rows.
Written by ``diag.sources.compact`` (``diag collect`` runs it as a low-priority child once an hour; ``diag
compact-recorder`` by hand or from a timer). Readers only read it (``load_recorder``), and a recorder without one,
or with a damaged one, is read from its JSON exactly as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import pickle
import sqlite3
import stat
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from collectors.recorder_queries import RecorderReader
from diag.timeline import TimelineBuilder

log = logging.getLogger(__name__)

BLOCK_S = 3600.0  # one block per UTC hour: 24 to read for a day, each small enough to decode in well under a second
LATE_S = 600.0  # an hour is decoded this long after it ends: a request's record is written when it finishes
SUFFIX = ".blocks"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    lo REAL PRIMARY KEY,
    hi REAL NOT NULL,
    version TEXT NOT NULL,
    rows INTEGER NOT NULL,
    id_sum INTEGER NOT NULL,
    id_max INTEGER NOT NULL,
    head BLOB NOT NULL,
    sizes TEXT NOT NULL,
    data BLOB NOT NULL
)
"""


def blocks_path(recorder: str | Path) -> Path:
    """Where the blocks of ``recorder`` are kept: ``<recorder>.blocks`` beside it."""
    recorder = Path(recorder)
    return recorder.with_name(recorder.name + SUFFIX)


# The code whose output a block holds: any change to how records become columns makes old blocks stale.
_DECODING_MODULES = ("diag.timeline", "collectors.records", "collectors.fields", "collectors.catalog", __name__)


@cache
def version() -> str | None:
    """Digest of the decoding code (every source file of the modules above) and of numpy's major version, or None
    when the sources cannot be read (then no block is used or written)."""
    import importlib

    import numpy as np

    digest = hashlib.sha256(f"numpy {np.__version__.split('.')[0]}".encode())
    try:
        for name in _DECODING_MODULES:
            module = importlib.import_module(name)
            path = Path(module.__file__ or "")
            files = sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]
            for file in files:
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
    except (OSError, TypeError):
        return None
    return digest.hexdigest()[:32]


def hour_floor(ts: float) -> float:
    return math.floor(ts / BLOCK_S) * BLOCK_S


@dataclass(frozen=True)
class Block:
    """One stored hour: its range ``[lo, hi)``, the code that decoded it, and the summary of the rows it held."""

    lo: float
    hi: float
    version: str
    ids: tuple[int, int, int]  # (count, sum, max) of the row ids, as ``RecorderReader.ids_between`` gives them


class _Unpickler(pickle.Unpickler):
    """Builds only what a builder is made of: the Timeline's own classes, the records it keeps whole, numpy arrays,
    dtypes and scalars, and builtin containers -- no other callable, numpy's included."""

    _BUILTINS = frozenset({"set", "frozenset", "dict", "list", "tuple", "float", "int", "str", "bytes", "bool", "complex",
                           "bytearray"})  # fmt: skip
    _NUMPY = frozenset({("numpy", "dtype"), ("numpy", "ndarray")}) | {
        (f"numpy.{core}.{module}", name)
        for core in ("_core", "core")  # numpy 2 and numpy 1 spell the same functions' modules differently
        for module, name in (("multiarray", "_reconstruct"), ("multiarray", "scalar"), ("numeric", "_frombuffer"))
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module == "builtins" and name in self._BUILTINS)
            or (module, name) in self._NUMPY
            or (module == "numpy.dtypes" and name.endswith("DType"))
            or (module == "collections" and name in ("defaultdict", "OrderedDict"))
            or module.startswith("diag.timeline.")
            or module == "collectors.records"
        )
        if not allowed:
            raise pickle.UnpicklingError(f"a block may not name {module}.{name}")
        return super().find_class(module, name)


def dumps(builder: TimelineBuilder) -> tuple[bytes, list[int], bytes]:
    """(head, sizes, data): the builder's pickle with its arrays' bytes out of band, concatenated."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(builder.compact(), protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    return head, [v.nbytes for v in views], b"".join(views)


def loads(head: bytes, sizes: list[int], data: bytes) -> TimelineBuilder:
    """The builder ``dumps`` stored. Each array gets its own writable copy of its bytes, as a builder read from JSON
    holds ordinary arrays: rules may write to them, and ``build`` frees each group's pieces once it has joined them
    (arrays sharing one buffer would keep every block whole until the last of them went)."""
    whole = memoryview(data)
    buffers, at = [], 0
    for size in sizes:
        buffers.append(bytearray(whole[at : at + size]))
        at += size
    if at != len(whole):
        raise pickle.UnpicklingError(f"the block's arrays are {len(whole)} bytes, its head names {at}")
    builder = _Unpickler(io.BytesIO(head), buffers=buffers).load()
    if not isinstance(builder, TimelineBuilder):
        raise pickle.UnpicklingError(f"a block holds a {type(builder).__name__}, not a TimelineBuilder")
    return builder


class BlockFile:
    """The blocks file of one recorder (its own SQLite database: the recorder's file stays the agent's alone)."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self.db = db
        self.path = path

    @classmethod
    def open_for_reading(cls, recorder: str | Path) -> BlockFile | None:
        """The blocks beside ``recorder``, or None when there are none or they cannot be read (said in the log)."""
        path = blocks_path(recorder)
        if not path.exists():
            return None
        try:
            db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
            db.execute("SELECT lo FROM blocks LIMIT 1").fetchall()
        except sqlite3.Error as exc:
            log.warning("%s is not readable (%s): the recorder's rows are decoded instead", path, exc)
            return None
        return cls(db, path)

    @classmethod
    def open_for_writing(cls, recorder: str | Path) -> BlockFile:
        """Open or create it; a file that is not a blocks database is replaced (it only ever holds a copy)."""
        path = blocks_path(recorder)
        mode = stat.S_IMODE(Path(recorder).stat().st_mode) & 0o666  # who may read the recorder may read its hours
        try:
            return cls._writable(path, mode)
        except sqlite3.DatabaseError as exc:
            log.warning("%s was not a blocks file (%s): started again", path, exc)
            for stale in (path, path.with_name(path.name + "-journal")):
                stale.unlink(missing_ok=True)
            return cls._writable(path, mode)

    @classmethod
    def _writable(cls, path: Path, mode: int) -> BlockFile:
        # SQLite's rollback journal, not WAL: one writer an hour, and a reader that may not write beside the file (an
        # analyst who can read the recorder, not its folder) still opens it read-only.
        db = sqlite3.connect(path, timeout=30.0)
        try:
            db.execute(_SCHEMA)
            db.commit()
        except sqlite3.Error:
            db.close()
            raise
        with contextlib.suppress(OSError):
            path.chmod(mode)
        return cls(db, path)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> BlockFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def index(self) -> list[Block]:
        rows = self.db.execute("SELECT lo, hi, version, rows, id_sum, id_max FROM blocks ORDER BY lo").fetchall()
        return [Block(float(lo), float(hi), str(v), (int(n), int(s), int(m))) for lo, hi, v, n, s, m in rows]

    def load(self, lo: float) -> TimelineBuilder:
        row = self.db.execute("SELECT head, sizes, data FROM blocks WHERE lo = ?", (lo,)).fetchone()
        if row is None:
            raise KeyError(lo)
        head, sizes, data = row
        return loads(head, json.loads(sizes), data)

    def put(self, block: Block, builder: TimelineBuilder) -> int:
        """Store ``builder`` as ``block`` (replacing an older one of that hour); the bytes stored."""
        head, sizes, data = dumps(builder)
        self.db.execute(
            "INSERT OR REPLACE INTO blocks(lo, hi, version, rows, id_sum, id_max, head, sizes, data) VALUES (?,?,?,?,?,?,?,?,?)",
            (block.lo, block.hi, block.version, *block.ids, head, json.dumps(sizes), data),
        )
        self.db.commit()
        return len(head) + len(data)

    def drop(self, los: list[float]) -> None:
        if los:
            self.db.executemany("DELETE FROM blocks WHERE lo = ?", [(lo,) for lo in los])
            self.db.commit()


# --------------------------------------------------------------------------- reading


@dataclass
class Cached:
    """A block a reader may use instead of decoding ``[lo, hi)``."""

    lo: float
    hi: float
    builder: TimelineBuilder


@dataclass
class Plan:
    """The stored hours a read may use, before any of them is read: ``wanted`` in time order, from ``store``."""

    store: BlockFile
    wanted: list[Block]


def plan(recorder: str | Path, since: float | None, until: float | None) -> Plan | None:
    """The stored hours inside [since, until] written by this code, or None when there are none (no blocks file, a
    damaged one, nothing fits: the caller reads JSON, as always). ``until`` is inclusive, as ``load_recorder``'s: an
    hour ``[lo, hi)`` fits when ``hi <= until``. Cheap: the blocks' index only, so the caller can start reading the
    hours around them before ``load`` reads the blocks themselves."""
    current = version()
    if current is None:
        return None
    store = BlockFile.open_for_reading(recorder)
    if store is None:
        return None
    try:
        wanted = [b for b in store.index() if b.version == current and (since is None or b.lo >= since)
                  and (until is None or b.hi <= until)]  # fmt: skip
    except sqlite3.Error as exc:
        log.warning("%s could not be used (%s): the recorder's rows are decoded instead", store.path, exc)
        wanted = []
    if not wanted:
        store.close()
        return None
    return Plan(store, wanted)


def load(planned: Plan, recorder: str | Path) -> list[Cached]:
    """The planned blocks that still describe the recorder exactly, decoded, in time order ([] when the blocks file
    fails to be read: said in the log). Closes the plan's store."""
    store = planned.store
    try:
        # The recorder's row-id summaries are read beside the blocks' own bytes (SQLite lets go of the interpreter while
        # it walks the time index): each would cost a third of a second for a day on its own. A block whose hour no
        # longer matches is read for nothing, and dropped.
        with ThreadPoolExecutor(1, thread_name_prefix="llmdiag-blocks") as pool:
            summaries = pool.submit(_summaries, recorder, planned.wanted)
            loaded = [(block, store.load(block.lo)) for block in planned.wanted]
            fresh = summaries.result()
        return [Cached(block.lo, block.hi, builder) for block, builder in loaded if fresh[block.lo] == block.ids]
    except (sqlite3.Error, pickle.UnpicklingError, ValueError, TypeError, KeyError, AttributeError, EOFError) as exc:
        log.warning("%s could not be used (%s): the recorder's rows are decoded instead", store.path, exc)
        return []
    finally:
        store.close()


def usable(recorder: str | Path, since: float | None, until: float | None) -> list[Cached]:
    """``plan`` and ``load`` in one: the stored hours inside [since, until] that a read may take, decoded."""
    planned = plan(recorder, since, until)
    return [] if planned is None else load(planned, recorder)


def _summaries(recorder: str | Path, wanted: list[Block]) -> dict[float, tuple[int, int, int]]:
    """The recorder's row-id summary of each block's hour now, in one snapshot (its own connection: another thread)."""
    with RecorderReader.open(recorder) as reader:
        reader.begin()
        return {b.lo: reader.ids_between(b.lo, b.hi) for b in wanted}


def gaps(
    cached: Sequence[Cached | Block], since: float | None, until: float | None
) -> Iterator[tuple[float | None, float | None]]:
    """The inclusive ranges of [since, until] the blocks (in time order) leave to be read from JSON, in time order
    (``None``: open)."""
    lo = since
    for block in cached:
        if lo is None or lo < block.lo:
            yield lo, math.nextafter(block.lo, -math.inf)
        lo = block.hi
    if until is None or lo is None or lo <= until:
        yield lo, until
