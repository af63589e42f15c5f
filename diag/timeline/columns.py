"""The pieces a Timeline is assembled from: series collected value by value or chunk by chunk, and tables.

``SeriesBuilder`` gathers one group's series (the host, a cgroup, a process track, a GPU), ``to_table``
joins a table's rows and column chunks, and ``to_float`` is the one conversion of a stored value to a
number every path shares (a value that is not one is NaN, i.e. missing).
"""

from __future__ import annotations

import ctypes
import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np

from diag.timeline.model import NAN, Series, Table


def _glibc(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL(None), name)  # glibc
    except (OSError, AttributeError):  # another C library: nothing to call, memory is returned as it returns it
        return None


_MALLOC_TRIM = _glibc("malloc_trim")
_MALLOPT = _glibc("mallopt")
_M_MMAP_THRESHOLD = -3
MAPPED_FROM_BYTES = 256 << 10


def prefer_mapped_memory() -> None:
    """Have every allocation of ``MAPPED_FROM_BYTES`` or more mapped on its own, so freeing it returns it at once.

    Why: glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), after which the same
    sizes come from the heap, whose freed pages it keeps. An analysis of a day makes and frees hundreds of arrays
    of 0.3-16 MiB, so the pages of one rule's temporaries stayed resident under the next one's: measured on a day
    of 1 Hz samples and a million requests, the leak rule peaked 122 MiB above the Timeline with 40 MiB of it alive.
    A fixed threshold also turns off that adjustment. Process-wide and lasting: for the processes that analyse
    (the CLI, the triage receiver), never the agent's or a tracked service's."""
    if _MALLOPT is not None:
        _MALLOPT(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(MAPPED_FROM_BYTES))


TRIM_FROM_BYTES = 4 << 20  # a joined column whose pieces held this much hands their pages back (a few ms a call)


def give_back_freed_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc ``malloc_trim``; a no-op elsewhere).

    Why: a day is read in thousands of small column pieces, allocated from the C heap; joined, they are freed --
    but glibc keeps freed heap pages for later, while the joined columns are big enough to be mapped afresh. Without
    this the pieces' pages stay resident beside the columns, and building a day peaks at twice what it keeps.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def to_float(value: Any) -> float:
    if value is None:
        return NAN
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond float range
        return NAN


class SeriesBuilder:
    """Collects (ts, value) pairs per name; a name first seen late is back-filled with NaN-free sparse rows.

    Two ways in: ``add`` one value (the per-record path) or ``add_chunk`` whole columns (the bulk
    path, NaN allowed -- dropped at ``build``). Series built from the same time chunks share one
    ``ts`` array: a day of host samples has ~75 series over the same 86 400 instants.
    """

    def __init__(self) -> None:
        self.ts: dict[str, list[float]] = defaultdict(list)
        self.values: dict[str, list[float]] = defaultdict(list)
        self.chunks: dict[str, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)

    def add(self, name: str, ts: float, value: Any) -> None:
        v = to_float(value)
        if math.isnan(v):
            return
        self.ts[name].append(ts)
        self.values[name].append(v)

    def add_chunk(self, name: str, ts: np.ndarray, values: np.ndarray) -> None:
        self.chunks[name].append((ts, values))

    def merge(self, other: SeriesBuilder) -> None:
        for name, ts in other.ts.items():
            self.ts[name].extend(ts)
            self.values[name].extend(other.values[name])
        for name, chunks in other.chunks.items():
            self.chunks[name].extend(chunks)

    def compact(self) -> None:
        """Each series' chunks as one chunk, in the same order (no sorting): far cheaper to pickle than
        thousands of small arrays. Series that shared their time chunks share the joined time array."""
        joined: dict[tuple[int, ...], tuple[np.ndarray, list[Any]]] = {}  # keeps the old chunks alive: ids stay unique
        for name, chunks in self.chunks.items():
            if len(chunks) < 2:
                continue
            key = tuple(id(t) for t, _ in chunks)
            if key not in joined:
                joined[key] = (np.concatenate([c[0] for c in chunks]), chunks)
            self.chunks[name] = [(joined[key][0], np.concatenate([c[1] for c in chunks]))]

    def build(self) -> dict[str, Series]:
        """The series, time-sorted, NaN dropped. Spends the builder: each series' pieces are let go once it is joined,
        so building a day holds about one copy of it, not two."""
        out = {}
        # time chunks (by identity) -> (sorted ts, order, the chunks themselves: alive, so their ids stay unique)
        shared: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray | None, list[np.ndarray]]] = {}
        for name in dict.fromkeys([*self.ts, *self.chunks]):
            chunks = self.chunks.pop(name, None) or []
            listed = self.ts.pop(name, None) or []
            listed_values = self.values.pop(name, None) or []
            if chunks and not listed:
                key = tuple(id(t) for t, _ in chunks)
                if key not in shared:
                    t = chunks[0][0] if len(chunks) == 1 else np.concatenate([c[0] for c in chunks])
                    order = None if t.size < 2 or bool(np.all(t[1:] >= t[:-1])) else np.argsort(t, kind="stable")
                    shared[key] = (t if order is None else t[order], order, [c[0] for c in chunks])
                t, order, _ = shared[key]
                v = chunks[0][1] if len(chunks) == 1 else np.concatenate([c[1] for c in chunks])
                del chunks
                if order is not None:
                    v = v[order]
                valid = ~np.isnan(v)
                if valid.all():
                    out[name] = Series(t, v)
                elif valid.any():
                    out[name] = Series(t[valid], v[valid])
                continue
            t = np.concatenate([np.asarray(listed, dtype=np.float64), *(c[0] for c in chunks)])
            v = np.concatenate([np.asarray(listed_values, dtype=np.float64), *(c[1] for c in chunks)])
            valid = ~np.isnan(v)
            t, v = t[valid], v[valid]
            if t.size:
                order = np.argsort(t, kind="stable")
                out[name] = Series(t[order], v[order])
        return out


def to_table(rows: Mapping[str, list[Any]], chunks: list[dict[str, np.ndarray]] | None = None) -> Table:
    """Rows added one by one (lists per column) and column chunks as one table, in time order.

    The chunks themselves are read, not changed (a live window shares them between runs), but the list is emptied:
    the caller hands over a list it owns (``TimelineBuilder.build`` pops it), and while the list held them every
    piece of every column stayed alive to the end -- a day of requests is ~120 MiB of pieces beside ~120 MiB joined.
    Emptied, each column's pieces are let go as soon as the column is joined (where nothing else holds them).
    """
    parts: list[dict[str, np.ndarray]] = []
    if any(rows.values()):
        listed = {}
        for name, values in rows.items():
            if values and isinstance(values[0], str):
                listed[name] = np.asarray(values, dtype=object)
            else:
                listed[name] = np.asarray(values, dtype=np.float64)
        parts.append(listed)
    parts.extend(dict(chunk) for chunk in chunks or ())
    if chunks:
        chunks.clear()
    cols = {}
    for name in dict.fromkeys(k for part in parts for k in part):
        arrays = [part.pop(name) for part in parts if name in part]
        pieces = sum(a.nbytes for a in arrays) if len(arrays) > 1 else 0
        cols[name] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        del arrays
        if pieces >= TRIM_FROM_BYTES:  # the pieces' heap pages back before the next column is mapped afresh
            give_back_freed_memory()
    table = Table(cols)
    ts = cols.get("ts")
    if ts is not None and ts.size > 1 and not bool(np.all(ts[1:] >= ts[:-1])):  # read in time order: nothing to do
        table = table.select(np.argsort(ts, kind="stable"))
    return table
