"""The per-record mapping: one stored record (a dict) into the builder, following its kind's layout.

This is the reference path -- every other way in (the bulk mapping, typed decoding) must give what it
gives, and falls back to it for what it cannot take. A handler may raise (TypeError, ValueError,
AttributeError, KeyError) on a value of the wrong shape: the builder then counts the record as skipped,
and what the handler had already added stays (the bulk path reproduces exactly that by handing such a
batch to this path).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from collectors.records import record_from_dict
from diag.timeline.columns import SeriesBuilder, to_float
from diag.timeline.layout import (
    EachPart,
    FamilyPart,
    FlagPart,
    GroupLayout,
    Inner,
    KeptLayout,
    Layout,
    NestedPart,
    RowsOfPart,
    Scalar,
    Scalars,
    TableLayout,
    TrackLayout,
)
from diag.timeline.model import ProcessTrack

TimelineBuilder = Any  # diag.timeline.builder.TimelineBuilder, which imports this module: named, not imported

Handler = Callable[[TimelineBuilder, float, Mapping[str, Any]], None]


def _add_number(target: SeriesBuilder, name: str, ts: float, s: Scalar, value: Any) -> None:
    if s.divide_by is None:
        target.add(name, ts, value)
    elif value is not None:
        target.add(name, ts, to_float(value) / s.divide_by)


def _add_nested(target: SeriesBuilder, prefix: str, ts: float, value: Any, inner: Inner) -> None:
    if not value:
        return
    for s in inner.numbers:
        _add_number(target, f"{prefix}.{s.name}", ts, s, value.get(s.field))
    for part in inner.nested:
        _add_nested_part(target, prefix + ".", ts, value.get(part.field), part)


def _add_nested_part(target: SeriesBuilder, head: str, ts: float, value: Any, part: NestedPart) -> None:
    if part.by_key:
        for key, item in (value or {}).items():
            _add_nested(target, f"{head}{part.name}.{key}", ts, item, part.inner)
    else:
        _add_nested(target, head + part.name, ts, value, part.inner)


def _group(layout: GroupLayout) -> Handler:
    scope, key, parts, availability = layout.scope, layout.key, layout.parts, layout.availability
    own = any(isinstance(p, (Scalars, FamilyPart, FlagPart, NestedPart)) for p in parts)  # series of the record's own group

    def handle(b: TimelineBuilder, ts: float, obj: Mapping[str, Any]) -> None:
        if availability is not None and not obj.get(availability[0]):
            b.unavailable[scope] = obj.get(availability[1]) or "unavailable"
            return
        groups = b.groups[scope]
        target = groups[None if key is None else str(obj.get(key) or "?")] if own else None
        for part in parts:
            if isinstance(part, Scalars):
                for s in part.scalars:
                    _add_number(target, s.name, ts, s, obj.get(s.field))  # type: ignore[arg-type]
            elif isinstance(part, FamilyPart):
                for name, value in (obj.get(part.field) or {}).items():
                    target.add(f"{part.name}.{name}", ts, value)  # type: ignore[union-attr]
            elif isinstance(part, FlagPart):
                if obj.get(part.field) is not None:
                    target.add(part.name, ts, int(bool(obj[part.field])))  # type: ignore[union-attr]
            elif isinstance(part, NestedPart):
                _add_nested_part(target, "", ts, obj.get(part.field), part)  # type: ignore[arg-type]
            elif isinstance(part, EachPart):
                for element in obj.get(part.field) or ():
                    group = groups[int(element[part.key])]
                    for s in part.numbers:
                        _add_number(group, s.name, ts, s, element.get(s.field))
            elif isinstance(part, RowsOfPart):
                rows = b.rows[part.table]
                for element in obj.get(part.field) or ():
                    rows["ts"].append(ts)
                    for s in part.numbers:
                        rows[s.name].append(to_float(element.get(s.field)))

    return handle


def _tracks(layout: TrackLayout) -> Handler:
    pid_field, start_field = layout.pid, layout.start

    def handle(b: TimelineBuilder, ts: float, obj: Mapping[str, Any]) -> None:
        pid = int(obj[pid_field])
        start_time = obj.get(start_field)
        key = f"{pid}@{start_time}"
        track = b.procs.get(key)
        if track is None:
            track = b.procs[key] = ProcessTrack(pid, start_time)
        for name in layout.truthy:
            setattr(track, name, obj.get(name) or getattr(track, name))
        for name in layout.sets:
            getattr(track, name).update(obj.get(name) or ())
        for name in layout.present:
            if obj.get(name) is not None:
                setattr(track, name, int(obj[name]))
        series = b.groups["processes"][key]
        for s in layout.numbers:
            _add_number(series, s.name, ts, s, obj.get(s.field))

    return handle


def _table(layout: TableLayout) -> Handler:
    table, numbers, texts = layout.table, layout.numbers, layout.texts

    def handle(b: TimelineBuilder, ts: float, obj: Mapping[str, Any]) -> None:
        rows = b.rows[table]
        rows["ts"].append(ts)
        for s in numbers:
            value = to_float(obj.get(s.field))
            rows[s.name].append(value if s.divide_by is None else value / s.divide_by)
        for name in texts:
            rows[name].append(str(obj.get(name) or ""))

    return handle


def _kept(layout: KeptLayout) -> Handler:
    attr = layout.attr

    def handle(b: TimelineBuilder, ts: float, obj: Mapping[str, Any]) -> None:
        b.kept[attr].append(record_from_dict(dict(obj)))

    return handle


def handler(layout: Layout) -> Handler:
    if isinstance(layout, GroupLayout):
        return _group(layout)
    if isinstance(layout, TrackLayout):
        return _tracks(layout)
    if isinstance(layout, TableLayout):
        return _table(layout)
    return _kept(layout)
