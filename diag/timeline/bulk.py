"""The column-wise mapping: a batch of one kind's records into the builder, a column at a time.

Each mapping mirrors the per-record one (``diag.timeline.rowwise``) of the same layout, over a batch
read through ``Rows``: json dicts (the json path) or msgspec Structs (the typed path). It computes
everything first and returns a ``commit`` closure that only appends: if computing raises, nothing was
changed and the batch goes through a slower path instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from itertools import chain, compress
from operator import attrgetter, itemgetter, methodcaller
from typing import Any

import numpy as np

from diag.timeline.layout import (
    FamilyPart,
    FlagPart,
    GroupLayout,
    Inner,
    Layout,
    NestedPart,
    Scalar,
    Scalars,
    TableLayout,
    TrackLayout,
    strict_parts,
)
from diag.timeline.model import ProcessTrack

TimelineBuilder = Any  # diag.timeline.builder.TimelineBuilder, which imports this module: named, not imported

Commit = Callable[[], None]
Bulk = Callable[[TimelineBuilder, np.ndarray, list[Any], "Rows"], Commit]


def column(values: list[Any]) -> np.ndarray:
    """Floats with NaN for None, like ``to_float`` per value; raises on anything ``to_float`` would turn into NaN."""
    col = np.array(values, dtype=np.float64)
    if col.ndim != 1:
        raise ValueError("not a column of scalars")
    return col


def _block(objs: list[Any], keys: Sequence[str], get: Any = itemgetter, typed: bool = False) -> list[np.ndarray] | None:
    """``get(key)(obj)`` for every key as float columns, in one C-level pass; None when some object lacks a key.

    ``typed``: every value is a float, a bool or None (typed decoding checked it), so ``np.fromiter`` can
    fill the block -- about half the cost per value of ``np.array`` over a list of tuples, which
    the json path keeps because it also converts (or rejects) odd values exactly like ``to_float``.
    """
    if not keys:
        return []
    n, k = len(objs), len(keys)
    try:
        if typed:
            if k == 1:
                return [np.fromiter(map(get(keys[0]), objs), np.float64, n)]
            flat = np.fromiter(chain.from_iterable(map(get(*keys), objs)), np.float64, n * k)
            return list(np.ascontiguousarray(flat.reshape(n, k).T))
        rows = list(map(get(*keys), objs))
    except KeyError:
        return None
    if k == 1:
        return [column(rows)]
    block = np.array(rows, dtype=np.float64)
    if block.ndim != 2 or block.shape[1] != k:
        raise ValueError("not a table of scalars")
    return [block[:, j].copy() for j in range(k)]


class Rows:
    """How the bulk mappings read the fields of a batch: json dicts, or typed Structs (``attrgetter``, floats only).

    Nested maps (meminfo, PSI lines...) are dicts either way; ``typed`` says their values are
    floats or None already.
    """

    def __init__(self, typed: bool, first: Any = None, unset: Any = None) -> None:
        self.typed = typed
        self.get: Any = attrgetter if typed else itemgetter
        # Strict typed decoding (``fastdecode.decode_strict``): the batch's first row as the json module reads it
        # (a dict), for the order of its keys, which the records of closed parts do not keep (None: not strict);
        # ``unset``: the value of a key a row does not have (``msgspec.UNSET``).
        self.first = first
        self.unset = unset

    @classmethod
    def strict(cls, first: Any, unset: Any) -> Rows:
        """Rows of a strict batch whose first row, parsed as JSON, is ``first``."""
        if not isinstance(first, dict):
            raise ValueError("the first row of a strict batch is a JSON object")
        return cls(typed=True, first=first, unset=unset)

    def values(self, objs: list[Any], key: str) -> list[Any]:
        """One field of every row (None where a dict lacks it)."""
        try:
            return list(map(self.get(key), objs))
        except KeyError:
            return [o.get(key) for o in objs]

    def field(self, key: str) -> Any:
        """A function reading one field of a row (None where a dict lacks it)."""
        return attrgetter(key) if self.typed else methodcaller("get", key)

    def columns(self, objs: list[Any], keys: Sequence[str]) -> list[np.ndarray]:
        cols = _block(objs, keys, self.get, self.typed)
        return cols if cols is not None else [column([o.get(k) for o in objs]) for k in keys]

    def dict_columns(self, dicts: list[Any], keys: Sequence[str]) -> list[np.ndarray] | None:
        return _block(dicts, keys, itemgetter, self.typed)


DICTS = Rows(typed=False)
STRUCTS = Rows(typed=True)


def _scaled(s: Scalar, col: np.ndarray) -> np.ndarray:
    return col if s.divide_by is None else col / s.divide_by


def _numbers(prefix: str, scalars: Sequence[Scalar], objs: list[Any], rows: Rows) -> list[tuple[str, np.ndarray]]:
    cols = rows.columns(objs, [s.field for s in scalars])
    return [(prefix + s.name, _scaled(s, c)) for s, c in zip(scalars, cols, strict=True)]


def _flat_columns(prefix: str, dicts: list[Any], rows: Rows) -> list[tuple[str, np.ndarray]]:
    """A column per key of a flat dict field (meminfo, vmstat, memory.stat...); keys in first-seen order."""
    if not dicts:
        return []
    keys: tuple[str, ...] = tuple(dicts[0])
    cols = rows.dict_columns(dicts, keys) if len(set(map(len, dicts))) == 1 else None  # same size + all keys = same keys
    if cols is None:
        keys = tuple(dict.fromkeys(k for d in dicts for k in d))
        cols = [column([d.get(k) for d in dicts]) for k in keys]
    return [(f"{prefix}{k}", c) for k, c in zip(keys, cols, strict=True)]


def _nested_columns(prefix: str, values: list[Any], inner: Inner, rows: Rows) -> list[tuple[str, np.ndarray]]:
    """A nested record's series (a PSI file: ``<prefix>.some.avg10`` ...); a level absent from every row adds none."""
    out = []
    if inner.numbers:
        present = sum(v is not None for v in values)
        if present:
            fields = [s.field for s in inner.numbers]
            cols = rows.dict_columns(values, fields) if present == len(values) else None
            if cols is None:
                cols = [column([v.get(k) if v else None for v in values]) for k in fields]
            out += [(f"{prefix}.{s.name}", _scaled(s, c)) for s, c in zip(inner.numbers, cols, strict=True)]
    for part in inner.nested:
        subs = [(v.get(part.field) or None) if v else None for v in values]
        out += _nested_part(prefix + ".", subs, part, rows)
    return out


def _nested_part(head: str, values: list[Any], part: NestedPart, rows: Rows) -> list[tuple[str, np.ndarray]]:
    if not part.by_key:
        return _nested_columns(head + part.name, values, part.inner, rows)
    maps = [v or {} for v in values]
    out = []
    for key in dict.fromkeys(k for m in maps for k in m):
        out += _nested_columns(f"{head}{part.name}.{key}", [m.get(key) for m in maps], part.inner, rows)
    return out


def _key_order(first: Any, field: str, declared: Sequence[str]) -> tuple[str, ...]:
    """The keys of ``first[field]`` in the JSON's order: what the json path's columns follow."""
    value = first.get(field)
    if not isinstance(value, dict) or not set(value) <= set(declared):
        raise ValueError(f"{field}: the first row's keys are not the record's")
    return tuple(value)


def _absent_everywhere(records: list[Any], keys: Sequence[str], unset: Any) -> None:
    """Raise unless every row lacks each of ``keys`` (the json path would add a column for a key any row has)."""
    for key in keys:
        if any(v is not unset for v in map(attrgetter(key), records)):
            raise ValueError(f"{key}: some rows have it and the first row does not")


def _closed_family(records: list[Any], part: FamilyPart, rows: Rows) -> list[tuple[str, np.ndarray]]:
    """``_flat_columns`` of a closed family read as records: the same columns when every row has the first row's
    keys (a row lacking one fails ``np.fromiter`` on the UNSET marker; the caller then takes the dict path)."""
    assert part.keys is not None
    keys = _key_order(rows.first, part.field, part.keys)
    _absent_everywhere(records, [k for k in part.keys if k not in set(keys)], rows.unset)
    if not records or not keys:
        return []
    cols = _block(records, keys, attrgetter, typed=True)
    assert cols is not None
    return [(f"{part.name}.{k}", c) for k, c in zip(keys, cols, strict=True)]


def _record_columns(prefix: str, values: list[Any], inner: Inner) -> list[tuple[str, np.ndarray]]:
    """``_nested_columns`` over nested records (or None) read as records: same names, same values."""
    out = []
    if inner.numbers:
        present = sum(v is not None for v in values)
        if present:
            fields = [s.field for s in inner.numbers]
            if present == len(values):
                cols = _block(values, fields, attrgetter, typed=True)
                assert cols is not None
            else:
                cols = [column([None if v is None else getattr(v, k) for v in values]) for k in fields]
            out += [(f"{prefix}.{s.name}", _scaled(s, c)) for s, c in zip(inner.numbers, cols, strict=True)]
    for part in inner.nested:
        subs = [None if v is None else getattr(v, part.field) for v in values]
        out += _record_columns(f"{prefix}.{part.name}", subs, part.inner)
    return out


def _closed_nested(values: list[Any], part: NestedPart, rows: Rows) -> list[tuple[str, np.ndarray]]:
    """``_nested_part`` of a closed nesting read as records."""
    if not part.by_key:
        return _record_columns(part.name, values, part.inner)
    assert part.keys is not None
    keys = _key_order(rows.first, part.field, part.keys)
    _absent_everywhere(values, [k for k in part.keys if k not in set(keys)], rows.unset)
    out = []
    for key in keys:
        subs = list(map(attrgetter(key), values))
        if any(v is rows.unset for v in subs):
            raise ValueError(f"{part.field}.{key}: some rows lack it")
        out += _record_columns(f"{part.name}.{key}", subs, part.inner)
    return out


def group_codes(keys: list[Any]) -> tuple[list[Any], np.ndarray | None]:
    """Distinct keys in first-seen order and each row's group number (None when there is one group)."""
    distinct = list(dict.fromkeys(keys))
    if len(distinct) == 1:
        return distinct, None
    number = {k: i for i, k in enumerate(distinct)}
    return distinct, np.fromiter(map(number.__getitem__, keys), dtype=np.intp, count=len(keys))


def _group(layout: GroupLayout) -> Bulk:
    scope, key, parts = layout.scope, layout.key, layout.parts
    strict = strict_parts(layout)

    def columns(objs: list[Any], rows: Rows) -> list[tuple[str, np.ndarray]]:
        cols: list[tuple[str, np.ndarray]] = []
        for part in parts:
            if isinstance(part, Scalars):
                cols += _numbers("", part.scalars, objs, rows)
            elif rows.first is not None and part.field in strict:
                if isinstance(part, FamilyPart):
                    cols += _closed_family(rows.values(objs, part.field), part, rows)
                elif isinstance(part, NestedPart):
                    cols += _closed_nested(rows.values(objs, part.field), part, rows)
            elif isinstance(part, FamilyPart):
                cols += _flat_columns(f"{part.name}.", [d or {} for d in rows.values(objs, part.field)], rows)
            elif isinstance(part, FlagPart):
                cols.append((part.name, column([None if v is None else int(bool(v)) for v in rows.values(objs, part.field)])))
            elif isinstance(part, NestedPart):
                cols += _nested_part("", rows.values(objs, part.field), part, rows)
        return cols

    def bulk(b: TimelineBuilder, ts: np.ndarray, objs: list[Any], rows: Rows) -> Commit:
        if key is None:
            staged = [(None, ts, columns(objs, rows))]
        else:
            names, codes = group_codes([str(p or "?") for p in rows.values(objs, key)])
            staged = []
            for number, name in enumerate(names):
                idx = None if codes is None else np.flatnonzero(codes == number)
                sub = objs if idx is None else [objs[i] for i in idx]
                staged.append((name, ts if idx is None else ts[idx], columns(sub, rows)))

        def commit() -> None:
            groups = b.groups[scope]
            for name, t, cols in staged:
                target = groups[name]
                for series, values in cols:
                    target.add_chunk(series, t, values)

        return commit

    return bulk


def _last(objs: list[Any], idx: np.ndarray | None, get: Any, truthy: bool) -> Any:
    """The last truthy (else: not None) ``get(row)`` among the rows ``idx`` (all when None): usually the very last row."""
    seq = reversed(objs) if idx is None else map(objs.__getitem__, reversed(idx.tolist()))
    if truthy:
        return next((v for v in map(get, seq) if v), None)
    return next((v for v in map(get, seq) if v is not None), None)


def _track_groups(pids: list[Any], starts: list[Any]) -> tuple[list[tuple[str, int, Any]], np.ndarray | None]:
    """The tracks of a batch -- ``(key, pid, start_time)`` in first-seen order, as the per-row path names them
    (``f"{int(pid)}@{start_time}"``, the first row's raw start time) -- and each row's track number.

    Grouping on ``(pid, start)`` tuples is cheap, but it merges what the key string keeps apart (5 and
    5.0, 0.0 and -0.0) and splits what it merges ("42" and 42, NaN objects). Those batches, which the
    agent never writes, are grouped on the key strings instead.
    """
    distinct, codes = group_codes(list(zip(pids, starts, strict=True)))
    plain = set(map(type, pids)) == {int} and len(set(map(type, starts))) == 1
    if plain and all(s is None or (s == s and s != 0) for _, s in distinct):
        return [(f"{int(p)}@{s}", int(p), s) for p, s in distinct], codes
    keys = [f"{int(p)}@{s}" for p, s in zip(pids, starts, strict=True)]
    names, codes = group_codes(keys)
    first = {} if codes is None else dict(zip(codes[::-1].tolist(), range(len(keys) - 1, -1, -1), strict=True))
    reps = [0] if codes is None else [first[number] for number in range(len(names))]
    return [(names[n], int(pids[i]), starts[i]) for n, i in enumerate(reps)], codes


def _tracks(layout: TrackLayout) -> Bulk:
    truthy, sets, present, numbers = layout.truthy, layout.sets, layout.present, layout.numbers

    def bulk(b: TimelineBuilder, ts: np.ndarray, objs: list[Any], rows: Rows) -> Commit:
        distinct, codes = _track_groups(rows.values(objs, layout.pid), rows.values(objs, layout.start))
        series = _numbers("", numbers, objs, rows)
        unions: dict[str, defaultdict[int, set[str]]] = {}
        for name in sets:
            found: defaultdict[int, set[str]] = defaultdict(set)
            values = rows.values(objs, name)
            for i in compress(range(len(objs)), values):  # only the rows that name any
                found[0 if codes is None else int(codes[i])].update(values[i])
            unions[name] = found
        getters = [(name, rows.field(name)) for name in truthy]
        present_getters = [(name, rows.field(name)) for name in present]
        if not rows.typed:  # the per-row path refuses a record whose value is not an int (typed decoding checked it)
            for name in present:
                for value in rows.values(objs, name):
                    if value is not None:
                        int(value)
        staged = []
        # Rows grouped by track once (a stable sort keeps each track's rows in batch order), each track's columns
        # then slices: a window written in time order holds every process's rows interleaved.
        order = bounds = None
        if codes is not None:
            order = np.argsort(codes, kind="stable")
            bounds = np.searchsorted(codes[order], np.arange(len(distinct) + 1)).tolist()
            ts = ts[order]
            series = [(name, col[order]) for name, col in series]
        for number, (key, pid, start_time) in enumerate(distinct):
            idx = None
            t, cols = ts, series
            if order is not None and bounds is not None:
                lo, hi = bounds[number], bounds[number + 1]
                idx = order[lo:hi]
                t, cols = ts[lo:hi], [(name, col[lo:hi]) for name, col in series]
            facts = [(name, _last(objs, idx, get, truthy=True)) for name, get in getters]
            kept = [(name, int(v)) for name, get in present_getters if (v := _last(objs, idx, get, truthy=False)) is not None]
            files = [(name, unions[name].get(number, set())) for name in sets]
            staged.append((key, pid, start_time, facts, files, kept, t, cols))

        def commit() -> None:
            for key, pid, start_time, facts, files, kept, t, cols in staged:
                track = b.procs.get(key)
                if track is None:
                    track = b.procs[key] = ProcessTrack(pid, start_time)
                for name, value in facts:
                    setattr(track, name, value or getattr(track, name))
                for name, values in files:
                    getattr(track, name).update(values)
                for name, value in kept:
                    setattr(track, name, value)
                target = b.groups["processes"][key]
                for name, values in cols:
                    target.add_chunk(name, t, values)

        return commit

    return bulk


def _strings(b: TimelineBuilder, values: list[Any]) -> np.ndarray:
    """``str(value or "")`` per row, one shared object per distinct string (1 M requests, ~3 routes)."""
    intern = b.strings
    try:
        distinct = dict.fromkeys(values)
    except TypeError:  # an unhashable value: convert one by one
        distinct = None
    if distinct is not None and all(v.__class__ is str for v in distinct):
        canonical = {v: intern.setdefault(v, v) for v in distinct}
        texts = list(map(canonical.__getitem__, values))
    else:
        texts = [intern.setdefault(t, t) for t in (v if v.__class__ is str else (str(v) if v else "") for v in values)]
    col = np.empty(len(texts), dtype=object)
    col[:] = texts
    return col


def _table(layout: TableLayout) -> Bulk:
    table, numbers, texts = layout.table, layout.numbers, layout.texts

    def bulk(b: TimelineBuilder, ts: np.ndarray, objs: list[Any], rows: Rows) -> Commit:
        cols = {"ts": ts, **dict(_numbers("", numbers, objs, rows))}
        for name in texts:
            cols[name] = _strings(b, rows.values(objs, name))

        def commit() -> None:
            b.table_chunks[table].append(cols)

        return commit

    return bulk


def bulk(layout: Layout) -> Bulk | None:
    """The column-wise mapping of a kind, or None when it is read record by record."""
    if not layout.bulk:
        return None
    if isinstance(layout, GroupLayout):
        return _group(layout)
    if isinstance(layout, TrackLayout):
        return _tracks(layout)
    if isinstance(layout, TableLayout):
        return _table(layout)
    return None
