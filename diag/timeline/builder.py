"""Build a Timeline from record dicts or stored JSON bodies (the model is in ``diag.timeline.model``).

Loaders (``diag.sources``) hand records to a ``TimelineBuilder`` one by one (``add``) or in batches of
one kind (``add_bodies``: typed msgspec decoding, ``diag/timeline/fastdecode.py``); ``build()`` sorts
everything by time into the columnar ``Timeline`` the rules read.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import chain, compress
from operator import attrgetter, itemgetter, methodcaller
from typing import Any

import numpy as np

from collectors.records import CudaOomError, OomEvent, ServiceConfig, WatchScope, record_from_dict
from diag.timeline import fastdecode
from diag.timeline.fastdecode import TYPED_KINDS, paused_gc
from diag.timeline.model import NAN, ProcessTrack, Series, Table, Timeline

# --------------------------------------------------------------------------- building


def _f(value: Any) -> float:
    if value is None:
        return NAN
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond float range
        return NAN


class _SeriesBuilder:
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
        v = _f(value)
        if math.isnan(v):
            return
        self.ts[name].append(ts)
        self.values[name].append(v)

    def add_chunk(self, name: str, ts: np.ndarray, values: np.ndarray) -> None:
        self.chunks[name].append((ts, values))

    def merge(self, other: _SeriesBuilder) -> None:
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
        out = {}
        shared: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray | None]] = {}  # time chunks -> (sorted ts, order)
        for name in dict.fromkeys([*self.ts, *self.chunks]):
            chunks = self.chunks.get(name) or []
            listed = self.ts.get(name) or []
            if chunks and not listed:
                key = tuple(id(t) for t, _ in chunks)  # the chunk arrays are alive here, so ids are unique
                if key not in shared:
                    t = chunks[0][0] if len(chunks) == 1 else np.concatenate([c[0] for c in chunks])
                    order = None if t.size < 2 or bool(np.all(t[1:] >= t[:-1])) else np.argsort(t, kind="stable")
                    shared[key] = (t if order is None else t[order], order)
                t, order = shared[key]
                v = chunks[0][1] if len(chunks) == 1 else np.concatenate([c[1] for c in chunks])
                if order is not None:
                    v = v[order]
                valid = ~np.isnan(v)
                if valid.all():
                    out[name] = Series(t, v)
                elif valid.any():
                    out[name] = Series(t[valid], v[valid])
                continue
            t = np.concatenate([np.asarray(listed, dtype=np.float64), *(c[0] for c in chunks)])
            v = np.concatenate([np.asarray(self.values[name], dtype=np.float64), *(c[1] for c in chunks)])
            valid = ~np.isnan(v)
            t, v = t[valid], v[valid]
            if t.size:
                order = np.argsort(t, kind="stable")
                out[name] = Series(t[order], v[order])
        return out


def _add_psi(builder: _SeriesBuilder, prefix: str, ts: float, psi: Mapping[str, Any] | None) -> None:
    if not psi:
        return
    for kind in ("some", "full"):
        line = psi.get(kind)
        if not line:
            continue
        for key in ("avg10", "avg60", "avg300"):
            builder.add(f"{prefix}.{kind}.{key}", ts, line.get(key))
        total = line.get("total_us")
        if total is not None:
            builder.add(f"{prefix}.{kind}.total_s", ts, _f(total) / 1e6)


_REQUEST_COLUMNS = ("ts", "arrival", "start", "finish", "prompt_tokens", "output_tokens", "ttft_s", "pid")
_REQUEST_STR_COLUMNS = ("outcome", "route", "model")
_BATCH_COLUMNS = ("ts", "requests", "input_tokens", "max_request_tokens", "active_decode_sequences", "concurrent_batches", "pid")
_ROUTING_COLUMNS = ("ts", "layer", "top_expert_tokens", "median_expert_tokens", "skew", "balancedness", "overflow_tokens", "pid")
_LOADER_COLUMNS = ("ts", "start", "duration_s", "bytes_read", "cache_hit", "in_request_path", "pid")
_TORCH_COLUMNS = (
    "ts", "device", "allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "num_ooms",
    "num_alloc_retries", "pid",
)  # fmt: skip


class TimelineBuilder:
    """Feed record dicts (as stored: ``{"kind": ..., "schema": ..., ...}``) in any order; ``build()`` sorts by time.

    Dicts rather than dataclasses on purpose: a million request rows decoded into dataclasses cost
    seconds; reading the few fields we need from the parsed JSON does not. Loaders feed stored JSON
    in batches instead (``add_bodies``, ``add_array``): typed Structs holding only those fields,
    turned into numpy columns a batch at a time. ``decode_paths`` counts the rows each path took.
    """

    def __init__(self, source: str = "") -> None:
        self.source = source
        self.start = math.inf
        self.end = -math.inf
        self.host = _SeriesBuilder()
        self.cgroups: dict[str, _SeriesBuilder] = defaultdict(_SeriesBuilder)
        self.procs: dict[str, ProcessTrack] = {}
        self.proc_series: dict[str, _SeriesBuilder] = defaultdict(_SeriesBuilder)
        self.gpus: dict[int, _SeriesBuilder] = defaultdict(_SeriesBuilder)
        self.gpu_reason: str | None = None
        self.rows: dict[str, dict[str, list[Any]]] = defaultdict(_list_dict)
        self.table_chunks: dict[str, list[dict[str, np.ndarray]]] = defaultdict(list)  # bulk path, see add_bodies
        self._strings: dict[str, str] = {}  # one object per distinct route/model/outcome string
        self.ooms: list[OomEvent] = []
        self.cuda_ooms: list[CudaOomError] = []
        self.configs: list[ServiceConfig] = []
        self.watch_scopes: list[WatchScope] = []
        self.counts: dict[str, int] = defaultdict(int)
        self.skipped: dict[str, int] = defaultdict(int)
        self.decode_paths: dict[str, int] = defaultdict(int)  # rows per add_bodies path: typed, json, per_row

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
        ts = _f(obj.get("ts"))
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

    def add_bodies(self, kind: str, bodies: Sequence[str] | Sequence[bytes]) -> None:
        """Many stored JSON bodies of one kind at once: the fast path for loaders (same result as ``add_json`` each).

        Why: 24 h at 1 Hz plus a million requests is ~2 M rows, and per-row decoding with per-field
        appends costs ~10 us a row. Here the batch is decoded at once -- typed (msgspec Structs, see
        ``diag/timeline/fastdecode.py``) for the hot kinds, else one ``json.loads`` -- and every field becomes
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

    def _add_typed(self, kind: str, bulk: Any, text: str | bytes, n: int, *, ordered: bool = False) -> bool:
        """The whole batch as Structs, or False (nothing changed) when any row does not fit."""
        if n == 0:
            return True
        objs = fastdecode.decode(kind, text)
        if objs is None or len(objs) != n or list(map(_ATTR_KIND, objs)).count(kind) != n:
            return False
        ts = np.fromiter(map(_ATTR_TS, objs), np.float64, n)  # typed: finite floats (JSON has no NaN)
        if ordered and n > 1 and not bool(np.all(ts[1:] >= ts[:-1])):
            return False
        try:
            commit = bulk(self, ts, objs, _STRUCTS)
        except Exception:  # e.g. a Struct lacking a field a handler reads: the json path decides
            return False
        commit()
        self._accepted(kind, ts)
        self.decode_paths["typed"] += n
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
            ts = _column(_DICTS.values(good, "ts"))
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
            commit = bulk(self, ts, good, _DICTS)
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
        self.start = min(self.start, float(ts.min()))
        self.end = max(self.end, float(ts.max()))

    def compact(self) -> TimelineBuilder:
        """Join the column chunks of each series and table (what ``build`` would do, without sorting).

        For a parallel reader about to send its builder to the parent: a day of rows in 256 KiB
        batches is ~60 000 small arrays, which pickle several times slower than a few large ones.
        """
        for b in (self.host, *self.cgroups.values(), *self.proc_series.values(), *self.gpus.values()):
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
        self.host.merge(other.host)
        for path, b in other.cgroups.items():
            self.cgroups[path].merge(b)
        for key, track in other.procs.items():
            mine = self.procs.get(key)
            if mine is None:
                self.procs[key] = replace(track, model_files=set(track.model_files), series={})
            else:
                mine.comm = track.comm or mine.comm
                mine.cmdline = track.cmdline or mine.cmdline
                mine.memory_cgroup = track.memory_cgroup or mine.memory_cgroup
                mine.model_files.update(track.model_files)
                mine.ppid = track.ppid if track.ppid is not None else mine.ppid
            self.proc_series[key].merge(other.proc_series[key])
        for index, b in other.gpus.items():
            self.gpus[index].merge(b)
        self.gpu_reason = other.gpu_reason or self.gpu_reason
        for name, rows in other.rows.items():
            for col, values in rows.items():
                self.rows[name][col].extend(values)
        for name, chunks in other.table_chunks.items():
            self.table_chunks[name].extend(chunks)
        self.ooms.extend(other.ooms)
        self.cuda_ooms.extend(other.cuda_ooms)
        self.configs.extend(other.configs)
        self.watch_scopes.extend(other.watch_scopes)
        for kind, n in other.counts.items():
            self.counts[kind] += n
        for kind, n in other.skipped.items():
            self.skipped[kind] += n
        for path, n in other.decode_paths.items():
            self.decode_paths[path] += n

    # ---- per kind

    def _host(self, ts: float, obj: Mapping[str, Any]) -> None:
        b = self.host
        for name, value in (obj.get("memory") or {}).items():
            b.add(f"memory.{name}", ts, value)
        for name, value in (obj.get("vmstat") or {}).items():
            b.add(f"vmstat.{name}", ts, value)
        for resource, psi in (obj.get("psi") or {}).items():
            _add_psi(b, f"psi.{resource}", ts, psi)

    def _cgroup(self, ts: float, obj: Mapping[str, Any]) -> None:
        b = self.cgroups[str(obj.get("path") or "?")]
        for name in ("usage", "working_set", "peak", "limit", "high", "low", "min", "swap"):
            b.add(name, ts, obj.get(f"{name}_bytes"))
        for name, value in (obj.get("events") or {}).items():
            b.add(f"events.{name}", ts, value)
        for name, value in (obj.get("events_local") or {}).items():
            b.add(f"events_local.{name}", ts, value)
        for name, value in (obj.get("stat") or {}).items():
            b.add(f"stat.{name}", ts, value)
        if obj.get("under_oom") is not None:
            b.add("under_oom", ts, int(bool(obj["under_oom"])))
        _add_psi(b, "psi.memory", ts, obj.get("pressure"))

    def _process(self, ts: float, obj: Mapping[str, Any]) -> None:
        pid = int(obj["pid"])
        start_time = obj.get("start_time_s")
        key = f"{pid}@{start_time}"
        track = self.procs.get(key)
        if track is None:
            track = self.procs[key] = ProcessTrack(pid, start_time)
        track.comm = obj.get("comm") or track.comm
        track.cmdline = obj.get("cmdline") or track.cmdline
        track.memory_cgroup = obj.get("memory_cgroup") or track.memory_cgroup
        track.model_files.update(obj.get("model_files") or ())
        if obj.get("ppid") is not None:
            track.ppid = int(obj["ppid"])
        b = self.proc_series[key]
        for name in ("rss", "pss", "uss", "swap"):
            b.add(name, ts, obj.get(f"{name}_bytes"))
        b.add("major_faults", ts, obj.get("major_faults"))
        b.add("minor_faults", ts, obj.get("minor_faults"))

    def _gpu(self, ts: float, obj: Mapping[str, Any]) -> None:
        if not obj.get("available"):
            self.gpu_reason = obj.get("reason") or "unavailable"
            return
        for dev in obj.get("devices") or ():
            b = self.gpus[int(dev["index"])]
            for name in ("total", "used", "free", "reserved"):
                b.add(name, ts, dev.get(f"{name}_bytes"))
            b.add("util_gpu", ts, dev.get("utilization_gpu_ratio"))
            b.add("util_memory", ts, dev.get("utilization_memory_ratio"))
        rows = self.rows["gpu_processes"]
        for proc in obj.get("processes") or ():
            rows["ts"].append(ts)
            rows["gpu"].append(_f(proc.get("gpu_index")))
            rows["pid"].append(_f(proc.get("pid")))
            rows["used_bytes"].append(_f(proc.get("used_bytes")))

    def _oom(self, ts: float, obj: Mapping[str, Any]) -> None:
        self.ooms.append(record_from_dict(dict(obj)))  # type: ignore[arg-type]

    def _cuda_oom(self, ts: float, obj: Mapping[str, Any]) -> None:
        self.cuda_ooms.append(record_from_dict(dict(obj)))  # type: ignore[arg-type]

    def _config(self, ts: float, obj: Mapping[str, Any]) -> None:
        self.configs.append(record_from_dict(dict(obj)))  # type: ignore[arg-type]

    def _watch_scope(self, ts: float, obj: Mapping[str, Any]) -> None:
        self.watch_scopes.append(record_from_dict(dict(obj)))  # type: ignore[arg-type]

    def build(self) -> Timeline:
        start = self.start if self.start != math.inf else 0.0
        end = self.end if self.end != -math.inf else 0.0
        processes = {}
        for key, track in self.procs.items():
            track.series = self.proc_series[key].build()
            processes[key] = track
        tables = {
            name: _to_table(self.rows.get(name, {}), self.table_chunks.get(name, []))
            for name in dict.fromkeys([*self.rows, *self.table_chunks])
        }
        requests = tables.get("requests", Table())
        if len(requests):
            requests = _derive_request_columns(requests)
        return Timeline(
            start=start,
            end=end,
            source=self.source,
            host=self.host.build(),
            cgroups={path: b.build() for path, b in self.cgroups.items()},
            processes=processes,
            gpus={i: b.build() for i, b in self.gpus.items()},
            gpu_unavailable_reason=self.gpu_reason if not self.gpus else None,
            gpu_processes=tables.get("gpu_processes", Table()),
            requests=requests,
            batches=tables.get("batches", Table()),
            routing=tables.get("routing", Table()),
            loader=tables.get("loader", Table()),
            torch=tables.get("torch", Table()),
            ooms=sorted(self.ooms, key=lambda o: o.ts),
            cuda_ooms=sorted(self.cuda_ooms, key=lambda o: o.ts),
            configs=sorted(self.configs, key=lambda c: c.ts),
            watch_scopes=sorted(self.watch_scopes, key=lambda w: w.ts),
            counts=dict(self.counts),
            skipped=dict(self.skipped),
        )


def _table_handler(name: str, numeric: tuple[str, ...], strings: tuple[str, ...] = ()) -> Any:
    """A handler that appends the named fields of a record to the rows of table ``name``."""

    def handler(self: TimelineBuilder, ts: float, obj: Mapping[str, Any]) -> None:
        rows = self.rows[name]
        for col in numeric:
            rows[col].append(ts if col == "ts" else _f(obj.get(col)))
        for col in strings:
            rows[col].append(str(obj.get(col) or ""))

    return handler


def _to_table(rows: Mapping[str, list[Any]], chunks: list[dict[str, np.ndarray]] | None = None) -> Table:
    parts: list[dict[str, np.ndarray]] = []
    if any(rows.values()):
        listed = {}
        for name, values in rows.items():
            if values and isinstance(values[0], str):
                listed[name] = np.asarray(values, dtype=object)
            else:
                listed[name] = np.asarray(values, dtype=np.float64)
        parts.append(listed)
    parts.extend(chunks or ())
    cols = {}
    for name in dict.fromkeys(k for part in parts for k in part):
        arrays = [part[name] for part in parts if name in part]
        cols[name] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    table = Table(cols)
    ts = cols.get("ts")
    if ts is not None and ts.size > 1 and not bool(np.all(ts[1:] >= ts[:-1])):  # read in time order: nothing to do
        table = table.select(np.argsort(ts, kind="stable"))
    return table


def _derive_request_columns(t: Table) -> Table:
    cols = dict(t.columns)
    start, arrival, finish = cols["start"], cols["arrival"], cols["finish"]
    cols["queue_wait_s"] = np.maximum(start - arrival, 0.0)  # NaN where the request never started
    cols["inference_s"] = np.maximum(finish - start, 0.0)
    cols["e2e_s"] = np.maximum(finish - arrival, 0.0)
    return Table(cols)


# Kinds that state a configuration rather than observe a moment: they do not stretch the window.
_NOT_OBSERVATIONS = frozenset({"watch_scope"})

_HANDLERS: dict[str, Any] = {
    "host": TimelineBuilder._host,
    "cgroup": TimelineBuilder._cgroup,
    "process": TimelineBuilder._process,
    "gpu": TimelineBuilder._gpu,
    "oom": TimelineBuilder._oom,
    "cuda_oom": TimelineBuilder._cuda_oom,
    "config": TimelineBuilder._config,
    "watch_scope": TimelineBuilder._watch_scope,
    "request": _table_handler("requests", _REQUEST_COLUMNS, _REQUEST_STR_COLUMNS),
    "batch": _table_handler("batches", _BATCH_COLUMNS),
    "routing": _table_handler("routing", _ROUTING_COLUMNS),
    "loader": _table_handler("loader", _LOADER_COLUMNS),
    "torch_memory": _table_handler("torch", _TORCH_COLUMNS),
}


# --------------------------------------------------------------------------- the bulk path (add_bodies)
#
# Each bulk handler mirrors the per-row handler of its kind, column-wise, over a batch read through
# ``_Rows``: json dicts (the json path) or msgspec Structs (the typed path). It computes everything
# first and returns a ``commit`` closure that only appends: if computing raises, nothing was changed
# and the batch goes through a slower path instead.


def _list_dict() -> defaultdict[str, list[Any]]:
    return defaultdict(list)


_GET_KIND = itemgetter("kind")
_ATTR_KIND = attrgetter("kind")
_ATTR_TS = attrgetter("ts")


def _joined(bodies: Sequence[str] | Sequence[bytes]) -> str | bytes:
    """The bodies as one JSON array (text in, text out; bytes in, bytes out)."""
    if isinstance(bodies[0], bytes):
        return b"[" + b",".join(bodies) + b"]"  # type: ignore[arg-type]
    return "[" + ",".join(bodies) + "]"  # type: ignore[arg-type]


def _column(values: list[Any]) -> np.ndarray:
    """Floats with NaN for None, like ``_f`` per value; raises on anything ``_f`` would turn into NaN."""
    col = np.array(values, dtype=np.float64)
    if col.ndim != 1:
        raise ValueError("not a column of scalars")
    return col


def _block(objs: list[Any], keys: Sequence[str], get: Any = itemgetter, typed: bool = False) -> list[np.ndarray] | None:
    """``get(key)(obj)`` for every key as float columns, in one C-level pass; None when some object lacks a key.

    ``typed``: every value is a float or None (typed decoding checked it), so ``np.fromiter`` can
    fill the block -- about half the cost per value of ``np.array`` over a list of tuples, which
    the json path keeps because it also converts (or rejects) odd values exactly like ``_f``.
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
        return [_column(rows)]
    block = np.array(rows, dtype=np.float64)
    if block.ndim != 2 or block.shape[1] != k:
        raise ValueError("not a table of scalars")
    return [block[:, j].copy() for j in range(k)]


class _Rows:
    """How the bulk handlers read the fields of a batch: json dicts, or typed Structs (``attrgetter``, floats only).

    Nested maps (meminfo, PSI lines...) are dicts either way; ``typed`` says their values are
    floats or None already.
    """

    def __init__(self, typed: bool) -> None:
        self.typed = typed
        self.get: Any = attrgetter if typed else itemgetter

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
        return cols if cols is not None else [_column([o.get(k) for o in objs]) for k in keys]

    def dict_columns(self, dicts: list[Any], keys: Sequence[str]) -> list[np.ndarray] | None:
        return _block(dicts, keys, itemgetter, self.typed)


_DICTS = _Rows(typed=False)
_STRUCTS = _Rows(typed=True)


def _flat_columns(prefix: str, dicts: list[Any], rows: _Rows) -> list[tuple[str, np.ndarray]]:
    """A column per key of a flat dict field (meminfo, vmstat, memory.stat...); keys in first-seen order."""
    if not dicts:
        return []
    keys: tuple[str, ...] = tuple(dicts[0])
    cols = rows.dict_columns(dicts, keys) if len(set(map(len, dicts))) == 1 else None  # same size + all keys = same keys
    if cols is None:
        keys = tuple(dict.fromkeys(k for d in dicts for k in d))
        cols = [_column([d.get(k) for d in dicts]) for k in keys]
    return [(f"{prefix}{k}", c) for k, c in zip(keys, cols, strict=True)]


_PSI_FIELDS = ("avg10", "avg60", "avg300", "total_us")


def _psi_columns(prefix: str, files: list[Any], rows: _Rows) -> list[tuple[str, np.ndarray]]:
    out = []
    for kind in ("some", "full"):
        lines = [(f.get(kind) or None) if f else None for f in files]
        present = sum(line is not None for line in lines)
        if not present:
            continue
        cols = rows.dict_columns(lines, _PSI_FIELDS) if present == len(lines) else None
        if cols is None:
            cols = [_column([line.get(k) if line else None for line in lines]) for k in _PSI_FIELDS]
        for key, col in zip(_PSI_FIELDS[:3], cols[:3], strict=True):
            out.append((f"{prefix}.{kind}.{key}", col))
        out.append((f"{prefix}.{kind}.total_s", cols[3] / 1e6))
    return out


def _group_codes(keys: list[Any]) -> tuple[list[Any], np.ndarray | None]:
    """Distinct keys in first-seen order and each row's group number (None when there is one group)."""
    distinct = list(dict.fromkeys(keys))
    if len(distinct) == 1:
        return distinct, None
    number = {k: i for i, k in enumerate(distinct)}
    return distinct, np.fromiter(map(number.__getitem__, keys), dtype=np.intp, count=len(keys))


def _bulk_host(self: TimelineBuilder, ts: np.ndarray, objs: list[Any], rows: _Rows) -> Any:
    cols = _flat_columns("memory.", [m or {} for m in rows.values(objs, "memory")], rows)
    cols += _flat_columns("vmstat.", [v or {} for v in rows.values(objs, "vmstat")], rows)
    psi = [p or {} for p in rows.values(objs, "psi")]
    for resource in dict.fromkeys(k for p in psi for k in p):
        cols += _psi_columns(f"psi.{resource}", [p.get(resource) for p in psi], rows)

    def commit() -> None:
        for name, values in cols:
            self.host.add_chunk(name, ts, values)

    return commit


_CGROUP_BYTES = tuple(f"{name}_bytes" for name in ("usage", "working_set", "peak", "limit", "high", "low", "min", "swap"))


def _bulk_cgroup(self: TimelineBuilder, ts: np.ndarray, objs: list[Any], rows: _Rows) -> Any:
    paths, codes = _group_codes([str(p or "?") for p in rows.values(objs, "path")])
    staged = []
    for number, path in enumerate(paths):
        idx = None if codes is None else np.flatnonzero(codes == number)
        sub = objs if idx is None else [objs[i] for i in idx]
        t = ts if idx is None else ts[idx]
        sizes = rows.columns(sub, _CGROUP_BYTES)
        cols = [(name.removesuffix("_bytes"), col) for name, col in zip(_CGROUP_BYTES, sizes, strict=True)]
        for field_name in ("events", "events_local", "stat"):
            cols += _flat_columns(f"{field_name}.", [d or {} for d in rows.values(sub, field_name)], rows)
        under = rows.values(sub, "under_oom")
        cols.append(("under_oom", _column([None if v is None else int(bool(v)) for v in under])))
        cols += _psi_columns("psi.memory", rows.values(sub, "pressure"), rows)
        staged.append((path, t, cols))

    def commit() -> None:
        for path, t, cols in staged:
            b = self.cgroups[path]
            for name, values in cols:
                b.add_chunk(name, t, values)

    return commit


_PROCESS_FIELDS = ("rss_bytes", "pss_bytes", "uss_bytes", "swap_bytes", "major_faults", "minor_faults")
_PROCESS_SERIES = ("rss", "pss", "uss", "swap", "major_faults", "minor_faults")
_PROCESS_FACTS = ("comm", "cmdline", "memory_cgroup", "ppid")


def _last_truthy(objs: list[Any], idx: np.ndarray | None, get: Any) -> Any:
    """The last truthy ``get(row)`` among the rows ``idx`` (all when None): usually the very last row."""
    seq = reversed(objs) if idx is None else map(objs.__getitem__, reversed(idx.tolist()))
    return next((v for v in map(get, seq) if v), None)


def _process_groups(pids: list[Any], starts: list[Any]) -> tuple[list[tuple[str, int, Any]], np.ndarray | None]:
    """The tracks of a batch -- ``(key, pid, start_time)`` in first-seen order, as the per-row path names them
    (``f"{int(pid)}@{start_time}"``, the first row's raw start time) -- and each row's track number.

    Grouping on ``(pid, start)`` tuples is cheap, but it merges what the key string keeps apart (5 and
    5.0, 0.0 and -0.0) and splits what it merges ("42" and 42, NaN objects). Those batches, which the
    agent never writes, are grouped on the key strings instead.
    """
    distinct, codes = _group_codes(list(zip(pids, starts, strict=True)))
    plain = set(map(type, pids)) == {int} and len(set(map(type, starts))) == 1
    if plain and all(s is None or (s == s and s != 0) for _, s in distinct):
        return [(f"{int(p)}@{s}", int(p), s) for p, s in distinct], codes
    keys = [f"{int(p)}@{s}" for p, s in zip(pids, starts, strict=True)]
    names, codes = _group_codes(keys)
    first = {} if codes is None else dict(zip(codes[::-1].tolist(), range(len(keys) - 1, -1, -1), strict=True))
    reps = [0] if codes is None else [first[number] for number in range(len(names))]
    return [(names[n], int(pids[i]), starts[i]) for n, i in enumerate(reps)], codes


def _bulk_process(self: TimelineBuilder, ts: np.ndarray, objs: list[Any], rows: _Rows) -> Any:
    distinct, codes = _process_groups(rows.values(objs, "pid"), rows.values(objs, "start_time_s"))
    numeric = rows.columns(objs, _PROCESS_FIELDS)
    files: defaultdict[int, set[str]] = defaultdict(set)
    model_files = rows.values(objs, "model_files")
    for i in compress(range(len(objs)), model_files):  # only the rows that name model files
        files[0 if codes is None else int(codes[i])].update(model_files[i])
    facts = [rows.field(key) for key in _PROCESS_FACTS]
    staged = []
    for number, (key, pid, start_time) in enumerate(distinct):
        idx = None if codes is None else np.flatnonzero(codes == number)
        t = ts if idx is None else ts[idx]
        cols = [(name, col if idx is None else col[idx]) for name, col in zip(_PROCESS_SERIES, numeric, strict=True)]
        last = tuple(_last_truthy(objs, idx, get) for get in facts)
        staged.append((key, pid, start_time, last, files.get(number, set()), t, cols))

    def commit() -> None:
        for key, pid, start_time, (comm, cmdline, cgroup, ppid), model_files, t, cols in staged:
            track = self.procs.get(key)
            if track is None:
                track = self.procs[key] = ProcessTrack(pid, start_time)
            track.comm = comm or track.comm
            track.cmdline = cmdline or track.cmdline
            track.memory_cgroup = cgroup or track.memory_cgroup
            track.model_files.update(model_files)
            if ppid:
                track.ppid = int(ppid)
            b = self.proc_series[key]
            for name, values in cols:
                b.add_chunk(name, t, values)

    return commit


def _strings(self: TimelineBuilder, values: list[Any]) -> np.ndarray:
    """``str(value or "")`` per row, one shared object per distinct string (1 M requests, ~3 routes)."""
    intern = self._strings
    try:
        distinct = dict.fromkeys(values)
    except TypeError:  # an unhashable value: convert one by one
        distinct = None
    if distinct is not None and all(v.__class__ is str for v in distinct):
        canonical = {v: intern.setdefault(v, v) for v in distinct}
        texts = list(map(canonical.__getitem__, values))
    else:
        texts = [intern.setdefault(t, t) for t in (v if v.__class__ is str else (str(v) if v else "") for v in values)]
    column = np.empty(len(texts), dtype=object)
    column[:] = texts
    return column


def _bulk_table(name: str, numeric: tuple[str, ...], strings: tuple[str, ...] = ()) -> Any:
    fields = tuple(col for col in numeric if col != "ts")

    def bulk(self: TimelineBuilder, ts: np.ndarray, objs: list[Any], rows: _Rows) -> Any:
        found = dict(zip(fields, rows.columns(objs, fields), strict=True))
        cols = {col: ts if col == "ts" else found[col] for col in numeric}
        for col in strings:
            cols[col] = _strings(self, rows.values(objs, col))

        def commit() -> None:
            self.table_chunks[name].append(cols)

        return commit

    return bulk


_BULK: dict[str, Any] = {
    "host": _bulk_host,
    "cgroup": _bulk_cgroup,
    "process": _bulk_process,
    "request": _bulk_table("requests", _REQUEST_COLUMNS, _REQUEST_STR_COLUMNS),
    "batch": _bulk_table("batches", _BATCH_COLUMNS),
    "routing": _bulk_table("routing", _ROUTING_COLUMNS),
    "loader": _bulk_table("loader", _LOADER_COLUMNS),
    "torch_memory": _bulk_table("torch", _TORCH_COLUMNS),
}


def timeline_from_records(records: Iterable[Mapping[str, Any]], source: str = "") -> Timeline:
    builder = TimelineBuilder(source)
    for obj in records:
        builder.add(obj)
    return builder.build()
