"""Build a Timeline from record dicts, stored JSON bodies or whole series (the model is in ``diag.timeline.model``).

Every source goes through a ``TimelineBuilder``: loaders of records (``diag.sources`` recorder and
bundle) hand it records one by one (``add``) or in batches of one kind (``add_bodies``, ``add_array``:
typed msgspec decoding, ``diag/timeline/fastdecode.py``); a source that has series rather than records
(Prometheus) hands it whole series, tracks, table columns and records (``add_series`` ...). ``build()``
sorts everything by time into the columnar ``Timeline`` the rules read.

Where each field of a record goes is not written here: it follows the kind's layout
(``diag.timeline.layout``, derived from the declarations in ``collectors.records``), through the
per-record mapping (``rowwise``) or the column-wise one (``bulk``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from diag.timeline import bulk as bulk_mapping
from diag.timeline import fastdecode, rowwise
from diag.timeline import signals as vocabulary
from diag.timeline.backends import service_from_backends
from diag.timeline.columns import SeriesBuilder, give_back_freed_memory, to_float, to_table
from diag.timeline.fastdecode import STRICT_KINDS, TYPED_KINDS, paused_gc
from diag.timeline.layout import LAYOUTS, KeptLayout, TrackLayout
from diag.timeline.model import ProcessTrack, Series, Table, Timeline

_HANDLERS = {kind: rowwise.handler(layout) for kind, layout in LAYOUTS.items()}
_BULK = {kind: b for kind, layout in LAYOUTS.items() if (b := bulk_mapping.bulk(layout)) is not None}
# Kinds that state a configuration rather than observe a moment: they do not stretch the window.
_NOT_OBSERVATIONS = frozenset(k for k, layout in LAYOUTS.items() if isinstance(layout, KeptLayout) and not layout.observation)
_TRACKS = [layout for layout in LAYOUTS.values() if isinstance(layout, TrackLayout)]
_TRUTHY_FACTS = tuple(dict.fromkeys(f for t in _TRACKS for f in t.truthy))
_FACT_SETS = tuple(dict.fromkeys(f for t in _TRACKS for f in t.sets))
_PRESENT_FACTS = tuple(dict.fromkeys(f for t in _TRACKS for f in t.present))
_TIMELINE_FIELDS = frozenset(f.name for f in dataclasses.fields(Timeline))

TRIM_FROM_ROWS = 250_000  # records read: a few hours of a busy host; below it, nothing is handed back
_GET_KIND = itemgetter("kind")
_ATTR_TS = attrgetter("ts")


def _list_dict() -> defaultdict[str, list[Any]]:
    return defaultdict(list)


def _series_groups() -> defaultdict[Any, SeriesBuilder]:
    return defaultdict(SeriesBuilder)


def _joined(bodies: Sequence[str] | Sequence[bytes]) -> str | bytes:
    """The bodies as one JSON array (text in, text out; bytes in, bytes out)."""
    if isinstance(bodies[0], bytes):
        return b"[" + b",".join(bodies) + b"]"  # type: ignore[arg-type]
    return "[" + ",".join(bodies) + "]"  # type: ignore[arg-type]


_FIRST = json.JSONDecoder()


def _first_row(text: str | bytes) -> Any:
    """The first row of a JSON array of bodies, as ``json`` reads it (ValueError when it is not one)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogatepass")
    if not text.startswith("["):
        raise ValueError("not a JSON array")
    start = 1
    while start < len(text) and text[start] in " \t\r\n":  # JSON's whitespace; no copy of the batch
        start += 1
    try:
        return _FIRST.raw_decode(text, start)[0]
    except RecursionError:
        raise ValueError("nested too deep") from None


class TimelineBuilder:
    """Feed record dicts (as stored: ``{"kind": ..., "schema": ..., ...}``) in any order; ``build()`` sorts by time.

    Dicts rather than dataclasses on purpose: a million request rows decoded into dataclasses cost
    seconds; reading the few fields we need from the parsed JSON does not. Loaders feed stored JSON
    in batches instead (``add_bodies``, ``add_array``): typed Structs holding only those fields,
    turned into numpy columns a batch at a time. ``decode_paths`` counts the rows each path took.

    ``window``: the Timeline's start and end when nothing observed sets them (a query window).
    """

    def __init__(self, source: str = "", window: tuple[float, float] | None = None) -> None:
        self.source = source
        self.window = window
        self.start = math.inf
        self.end = -math.inf
        self.groups: defaultdict[str, defaultdict[Any, SeriesBuilder]] = defaultdict(_series_groups)  # scope -> group
        self.procs: dict[str, ProcessTrack] = {}
        self.unavailable: dict[str, str] = {}  # scope -> why its source could not be read (no NVML ...)
        self.rows: dict[str, dict[str, list[Any]]] = defaultdict(_list_dict)
        self.table_chunks: dict[str, list[dict[str, np.ndarray]]] = defaultdict(list)  # bulk path, see add_bodies
        self.strings: dict[str, str] = {}  # one object per distinct route/model/outcome string
        self.kept: dict[str, list[Any]] = defaultdict(list)  # Timeline attribute -> records kept whole
        self.counts: dict[str, int] = defaultdict(int)
        self.skipped: dict[str, int] = defaultdict(int)
        self.decode_paths: dict[str, int] = defaultdict(int)  # rows per add_bodies path: strict, typed, json, per_row
        self._built = False

    # ---- records, one at a time

    def add_json(self, text: str | bytes, kind_hint: str = "?") -> None:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: a row nested thousands deep
            self.skipped[kind_hint] += 1
            return
        if isinstance(obj, dict):
            self.add(obj)
        else:
            self.skipped[kind_hint] += 1

    def add(self, obj: Mapping[str, Any]) -> None:
        kind = obj.get("kind")
        ts = to_float(obj.get("ts"))
        if not isinstance(kind, str) or math.isnan(ts):
            self.skipped[str(kind)] += 1
            return
        handler = _HANDLERS.get(kind)
        if handler is None:
            self.skipped[kind] += 1
            return
        try:
            handler(self, ts, obj)
        except (TypeError, ValueError, AttributeError, KeyError):
            self.skipped[kind] += 1
            return
        self.counts[kind] += 1
        if kind in _NOT_OBSERVATIONS:
            return
        self.start = min(self.start, ts)
        self.end = max(self.end, ts)

    # ---- records, a batch of one kind at a time

    def add_bodies(self, kind: str, bodies: Sequence[str] | Sequence[bytes]) -> None:
        """Many stored JSON bodies of one kind at once: the fast path for loaders (same result as ``add_json`` each).

        Why: 24 h at 1 Hz plus a million requests is ~2 M rows, and per-row decoding with per-field
        appends costs ~10 us a row. Here the batch is decoded at once -- typed (msgspec Structs, see
        ``diag/timeline/fastdecode.py``) where the kind has a Struct, else one ``json.loads`` -- and every field becomes
        a numpy column in one pass. Anything unexpected (a bad row, a value numpy will not take, a
        nested shape) sends the batch from the typed to the json path, and there the batch -- or
        just the odd rows -- through the per-row path, so the counts of skipped rows and the values
        are those ``add_json`` would give.
        """
        if not bodies:
            return
        bulk = _BULK.get(kind)
        with paused_gc():
            if bulk is None:
                for body in bodies:
                    self.add_json(body, kind)
                return
            text = _joined(bodies)
            if kind in TYPED_KINDS and self._add_typed(kind, bulk, text, len(bodies)):
                return
            self._add_decoded(kind, bulk, text, bodies)

    def add_array(self, kind: str, text: str | bytes, n: int, *, ordered: bool = False) -> bool:
        """A ready JSON array of ``n`` stored bodies of ``kind`` (a loader that can have it joined for free).

        All or nothing, typed decoding only: True when taken; False, with nothing changed, when the
        kind has no typed decoding or any row does not fit -- the caller then hands the bodies to
        ``add_bodies``. ``ordered``: refuse it too when the rows' times go backwards, for sources
        whose order is not guaranteed (time order decides which row's facts are the latest).
        """
        bulk = _BULK.get(kind)
        if bulk is None or kind not in TYPED_KINDS:
            return False
        with paused_gc():
            return self._add_typed(kind, bulk, text, n, ordered=ordered)

    def _add_typed(self, kind: str, bulk: Any, text: str | bytes, n: int, *, ordered: bool = False, strict: bool = True) -> bool:
        """The whole batch as Structs, or False (nothing changed) when any row does not fit.

        Strict decoding first where the kind has closed parts (``fastdecode.decode_strict``: a host row's meminfo,
        vmstat and PSI as records, not dicts: half the decoding); a batch it does not fit (a key that comes and
        goes, one it does not declare) is decoded again the ordinary typed way. ``strict=False``: that way only.
        """
        if n == 0:
            return True
        if strict and kind in STRICT_KINDS:
            objs = fastdecode.decode_strict(kind, text)
            if objs is not None and len(objs) == n:
                try:
                    rows = bulk_mapping.Rows.strict(_first_row(text), fastdecode.UNSET)
                except ValueError:
                    rows = None
                if rows is not None and self._commit_typed(kind, bulk, objs, rows, ordered, "strict"):
                    return True
            del objs
        objs = fastdecode.decode(kind, text)  # every row's kind is checked there (a Literal)
        if objs is None or len(objs) != n:
            return False
        return self._commit_typed(kind, bulk, objs, bulk_mapping.STRUCTS, ordered, "typed")

    def _commit_typed(self, kind: str, bulk: Any, objs: list[Any], rows: Any, ordered: bool, path: str) -> bool:
        n = len(objs)
        ts = np.fromiter(map(_ATTR_TS, objs), np.float64, n)  # typed: finite floats (JSON has no NaN)
        if ordered and n > 1 and not bool(np.all(ts[1:] >= ts[:-1])):
            return False
        try:
            commit = bulk(self, ts, objs, rows)
        except Exception:  # e.g. a Struct lacking a field a handler reads: the json path decides
            return False
        commit()
        self._accepted(kind, ts)
        self.decode_paths[path] += n
        return True

    def _add_decoded(self, kind: str, bulk: Any, text: str | bytes, bodies: Sequence[str] | Sequence[bytes]) -> None:
        """The json path: one ``json.loads`` for the batch, dict handlers, the per-row path for what they cannot take."""
        objs: Any = None
        try:
            objs = json.loads(text)
        except (ValueError, RecursionError):
            objs = None
        if not isinstance(objs, list) or len(objs) != len(bodies):  # a body that is not one JSON value
            self.decode_paths["per_row"] += len(bodies)
            for body in bodies:
                self.add_json(body, kind)
            return
        try:
            uniform = list(map(_GET_KIND, objs)).count(kind) == len(objs)
        except (TypeError, KeyError, IndexError):  # a row that is not an object, or has no kind
            uniform = False
        good = objs
        if not uniform:
            good = [o for o in objs if o.__class__ is dict and o.get("kind") == kind]
            for o in objs:
                if o.__class__ is not dict:
                    self.skipped[kind] += 1
                elif o.get("kind") != kind:
                    self.add(o)
        try:
            ts = bulk_mapping.column(bulk_mapping.DICTS.values(good, "ts"))
        except (TypeError, ValueError, OverflowError):
            self.decode_paths["per_row"] += len(good)
            for o in good:
                self.add(o)
            return
        missing = np.isnan(ts)
        if missing.any():
            self.skipped[kind] += int(missing.sum())
            good = [o for o, bad in zip(good, missing, strict=True) if not bad]
            ts = ts[~missing]
        if not good:
            return
        try:
            commit = bulk(self, ts, good, bulk_mapping.DICTS)
        except Exception:  # whatever it was, the per-row path decides row by row
            self.decode_paths["per_row"] += len(good)
            for o in good:
                self.add(o)
            return
        commit()
        self._accepted(kind, ts)
        self.decode_paths["json"] += len(good)

    def _accepted(self, kind: str, ts: np.ndarray) -> None:
        self.counts[kind] += int(ts.size)
        if kind in _NOT_OBSERVATIONS:
            return
        self.start = min(self.start, float(ts.min()))
        self.end = max(self.end, float(ts.max()))

    # ---- whole series, for a source that has no records (Prometheus)

    def add_series(self, scope: str, group: Any, name: str, series: Series) -> None:
        """One whole series (NaN-free, ascending) of ``Timeline.<scope>[group][name]`` (``group`` None: host, service).

        It stretches the window. Names are the vocabulary's (``diag.timeline.signals``); like a record's keys they are
        not refused here (a label value can name a PSI resource the vocabulary does not list): the suite
        checks that every source fills only what the vocabulary knows.
        """
        if scope not in vocabulary.SCOPES:
            raise KeyError(f"{scope!r} is not a scope of series of the Timeline ({', '.join(vocabulary.SCOPES)})")
        if scope == "processes" and group not in self.procs:
            raise KeyError(f"no process track {group!r}: add_track first")
        self.groups[scope][group].add_chunk(name, series.ts, series.values)
        if len(series):
            self.start = min(self.start, float(series.ts[0]))
            self.end = max(self.end, float(series.ts[-1]))

    def add_track(self, key: str, pid: int, start_time_s: float | None = None, **facts: Any) -> None:
        """A process track named ``key`` (its series then come through ``add_series("processes", key, ...)``)."""
        if key not in self.procs:
            self.procs[key] = ProcessTrack(pid, start_time_s, **facts)

    def add_rows(self, table: str, columns: Mapping[str, np.ndarray]) -> None:
        """Rows of a table as columns (``ts`` among them); ``build`` puts every table in time order."""
        self.table_chunks[table].append(dict(columns))

    def mark_unavailable(self, scope: str, reason: str) -> None:
        """The source of a scope's series could not be read (no NVML): the Timeline says why when it has none."""
        self.unavailable[scope] = reason

    def keep(self, attr: str, records: Iterable[Any]) -> None:
        """Records kept whole in ``Timeline.<attr>`` (synthetic OOM kills...): neither counted nor stretching the window."""
        self.kept[attr].extend(records)

    # ---- parallel reading

    def compact(self) -> TimelineBuilder:
        """Join the column chunks of each series and table (what ``build`` would do, without sorting).

        For a parallel reader about to send its builder to the parent: a day of rows in 256 KiB
        batches is ~60 000 small arrays, which pickle several times slower than a few large ones.
        """
        for groups in self.groups.values():
            for b in groups.values():
                b.compact()
        for name, chunks in self.table_chunks.items():
            columns = list(chunks[0]) if chunks else []
            if len(chunks) > 1 and all(list(c) == columns for c in chunks):
                self.table_chunks[name] = [{col: np.concatenate([c[col] for c in chunks]) for col in columns}]
        return self

    @classmethod
    def merged(cls, parts: Iterable[TimelineBuilder], source: str = "") -> TimelineBuilder:
        """A new builder holding ``parts`` (disjoint, in time order) that leaves them as they were.

        Why: the live diagnosis keeps the builders of the segments it read and merges the ones still in
        its window again on every run; ``merge`` shares arrays (never written to) but copies what
        merging or ``build`` would change (process tracks).
        """
        out = cls(source)
        for part in parts:
            out.merge(part)
        return out

    def merge(self, other: TimelineBuilder) -> None:
        """Fold in a builder that read a *later*, disjoint part of the same source (parallel loading).

        ``other`` is left as it was: its process tracks are copied, its column arrays shared.
        """
        self.start = min(self.start, other.start)
        self.end = max(self.end, other.end)
        for key, track in other.procs.items():
            mine = self.procs.get(key)
            if mine is None:
                copies = {name: set(getattr(track, name)) for name in _FACT_SETS}
                self.procs[key] = replace(track, series={}, **copies)
            else:
                for name in _TRUTHY_FACTS:
                    setattr(mine, name, getattr(track, name) or getattr(mine, name))
                for name in _FACT_SETS:
                    getattr(mine, name).update(getattr(track, name))
                for name in _PRESENT_FACTS:
                    if getattr(track, name) is not None:
                        setattr(mine, name, getattr(track, name))
        for scope, groups in other.groups.items():
            for key, b in groups.items():
                self.groups[scope][key].merge(b)
        for scope, reason in other.unavailable.items():
            self.unavailable[scope] = reason or self.unavailable.get(scope, "")
        for name, rows in other.rows.items():
            for col, values in rows.items():
                self.rows[name][col].extend(values)
        for name, chunks in other.table_chunks.items():
            self.table_chunks[name].extend(chunks)
        for attr, records in other.kept.items():
            self.kept[attr].extend(records)
        for kind, n in other.counts.items():
            self.counts[kind] += n
        for kind, n in other.skipped.items():
            self.skipped[kind] += n
        for path, n in other.decode_paths.items():
            self.decode_paths[path] += n

    # ---- the Timeline

    def build(self) -> Timeline:
        """The Timeline. Spends the builder: its pieces are let go as they are joined (a day's worth is hundreds
        of MiB -- holding the pieces and the joined columns at once would double the peak), so it builds once."""
        if self._built:
            raise RuntimeError("a TimelineBuilder builds one Timeline (build() let go of its pieces)")
        self._built = True
        if self.start != math.inf:
            start, end = self.start, self.end
        else:
            start, end = self.window or (0.0, 0.0)
        groups = self.groups
        # Only a large Timeline is worth handing memory back for: each call walks the heap, and memory handed back is
        # faulted in again by the next allocations (the live diagnosis builds a few minutes every 15 s).
        large = sum(self.counts.values()) >= TRIM_FROM_ROWS

        def give_back() -> None:
            if large:
                give_back_freed_memory()

        def joined(builder: SeriesBuilder | None) -> dict[str, Series]:
            series = builder.build() if builder is not None else {}
            give_back()  # the group's pieces, before the next group's columns are allocated
            return series

        processes = {}
        for key, track in self.procs.items():
            track.series = joined(groups["processes"].pop(key, None))
            processes[key] = track
        tables = {}
        for name in dict.fromkeys([*self.rows, *self.table_chunks]):
            tables[name] = to_table(self.rows.pop(name, {}), self.table_chunks.pop(name, []))
            give_back()
        requests = tables.get("requests")
        if requests is not None and len(requests):
            tables["requests"] = _derive_request_columns(requests)
        host = joined(groups["host"].pop(None, None))
        service = joined(groups["service"].pop(None, None))
        backends = {target: joined(groups["backends"].pop(target)) for target in list(groups["backends"])}
        for name, series in service_from_backends(backends).items():
            service.setdefault(name, series)  # what a source handed over as service series already wins
        cgroups = {path: joined(groups["cgroups"].pop(path)) for path in list(groups["cgroups"])}
        gpus = {index: joined(groups["gpus"].pop(index)) for index in list(groups["gpus"])}
        named = {name: table for name, table in tables.items() if name in _TIMELINE_FIELDS}
        kept = {attr: sorted(records, key=_ts) for attr, records in self.kept.items()}
        give_back()  # what reading left behind (decoded rows, joined JSON), before the rules run
        return Timeline(
            start=start,
            end=end,
            source=self.source,
            host=host,
            cgroups=cgroups,
            processes=processes,
            gpus=gpus,
            gpu_unavailable_reason=self.unavailable.get("gpus") if not gpus else None,
            service=service,
            backends=backends,
            tables={name: table for name, table in tables.items() if name not in _TIMELINE_FIELDS},
            counts=dict(self.counts),
            skipped=dict(self.skipped),
            **named,
            **kept,
        )


def _ts(record: Any) -> float:
    return record.ts


def _derive_request_columns(t: Table) -> Table:
    cols = dict(t.columns)
    start, arrival, finish = cols["start"], cols["arrival"], cols["finish"]
    cols["queue_wait_s"] = np.maximum(start - arrival, 0.0)  # NaN where the request never started
    cols["inference_s"] = np.maximum(finish - start, 0.0)
    cols["e2e_s"] = np.maximum(finish - arrival, 0.0)
    return Table(cols)


def timeline_from_records(records: Iterable[Mapping[str, Any]], source: str = "") -> Timeline:
    builder = TimelineBuilder(source)
    for obj in records:
        builder.add(obj)
    return builder.build()
