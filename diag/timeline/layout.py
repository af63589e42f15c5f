"""Each record kind as the Timeline reads it, derived from its declaration in ``collectors.records``.

Why derived: the per-row mapping, the bulk mapping and the typed structs of ``TimelineBuilder`` and
``fastdecode`` all read a kind through one ``Layout`` built here from the fields' roles
(``collectors.fields``) -- so they cannot disagree on a column, and a field declared there is read
everywhere. Nothing here decodes anything: it is the plan the builder follows.

Layouts by destination:

- ``GroupLayout`` (``SeriesGroup``): the ``parts`` of a group's series, in the order the Timeline lists
  them (numbers, families, flags, nested records), and the field naming the group;
- ``TrackLayout`` (``Tracks``): a process track's key fields, its facts and its series;
- ``TableLayout`` (``Rows``): ``ts`` then the number columns, then the text columns;
- ``KeptLayout`` (``Kept``): the records themselves.

``typed_fields`` gives the fields the typed (msgspec) decoding keeps, with the type each must have:
numbers as floats (ints converted exactly), flags and bool columns as bools, texts as strings (a
``Literal`` stays one), maps and nested records as dicts of those -- anything else fails the batch
over to the json path, which decides row by row.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

from collectors import fields as fl
from collectors.records import RECORD_TYPES
from diag.timeline.model import ProcessTrack, Table, Timeline


class Scalar(NamedTuple):
    """A number field and the series or column it becomes."""

    field: str
    name: str
    divide_by: float | None = None
    is_bool: bool = False  # declared bool: decoded as one (a table column reads it as 1.0 / 0.0)


class Scalars(NamedTuple):
    scalars: tuple[Scalar, ...]


class FamilyPart(NamedTuple):
    field: str
    name: str  # series ``<name>.<key>``
    keys: tuple[str, ...] | None = None  # a closed family's keys (None: open)


class FlagPart(NamedTuple):
    field: str
    name: str


class Inner(NamedTuple):
    """The roles of a nested record class: its numbers first, then its own nested records."""

    numbers: tuple[Scalar, ...]
    nested: tuple[NestedPart, ...]


class NestedPart(NamedTuple):
    field: str
    name: str  # series ``<name>.<inner names>`` (by key: ``<name>.<key>.<inner names>``)
    inner: Inner
    by_key: bool = False
    keys: tuple[str, ...] | None = None  # by key: the keys declared (None: open)


class EachPart(NamedTuple):
    field: str
    key: str  # the element field naming its group
    numbers: tuple[Scalar, ...]


class RowsOfPart(NamedTuple):
    field: str
    table: str
    numbers: tuple[Scalar, ...]


Part = Scalars | FamilyPart | FlagPart | NestedPart | EachPart | RowsOfPart


class GroupLayout(NamedTuple):
    kind: str
    scope: str
    key: str | None
    parts: tuple[Part, ...]
    availability: tuple[str, str] | None = None  # (the flag field, the reason field)

    @property
    def bulk(self) -> bool:
        """Whether the kind has a column-wise mapping (lists of records and availability are read row by row)."""
        return self.availability is None and not any(isinstance(p, (EachPart, RowsOfPart)) for p in self.parts)


class TrackLayout(NamedTuple):
    kind: str
    pid: str
    start: str
    truthy: tuple[str, ...]  # facts: the last truthy value wins
    sets: tuple[str, ...]  # facts: the union over the track
    present: tuple[str, ...]  # facts: the last value that is not None wins (as an int)
    numbers: tuple[Scalar, ...]
    bulk: bool = True


class TableLayout(NamedTuple):
    kind: str
    table: str
    numbers: tuple[Scalar, ...]  # after ``ts``
    texts: tuple[str, ...]
    bulk: bool = True

    @property
    def columns(self) -> tuple[str, ...]:
        return ("ts", *(s.name for s in self.numbers), *self.texts)


class KeptLayout(NamedTuple):
    kind: str
    attr: str
    observation: bool
    bulk: bool = False


Layout = GroupLayout | TrackLayout | TableLayout | KeptLayout

_ORDER = {fl.Number: 0, fl.Family: 1, fl.Flag: 2, fl.Nested: 3, fl.NestedByKey: 3, fl.Each: 4, fl.RowsOf: 5}


def _is_bool(hint: Any) -> bool:
    return hint is bool or (get_origin(hint) in (Union, types.UnionType) and bool in get_args(hint))


def _scalar(cls: type, name: str, role: fl.Number | fl.Flag) -> Scalar:
    divide_by = role.divide_by if isinstance(role, fl.Number) else None
    return Scalar(name, role.name or name, divide_by, _is_bool(fl.hints(cls)[name]))


def _numbers(cls: type) -> tuple[Scalar, ...]:
    return tuple(_scalar(cls, name, r) for name, r in fl.roles(cls) if isinstance(r, fl.Number))


def _inner(cls: type) -> Inner:
    nested_types = fl.nested_types(cls)
    parts = tuple(
        _nested_part(name, r, nested_types[name]) for name, r in fl.roles(cls) if isinstance(r, (fl.Nested, fl.NestedByKey))
    )
    return Inner(_numbers(cls), parts)


def _nested_part(name: str, role: fl.Nested | fl.NestedByKey, cls: type) -> NestedPart:
    by_key = isinstance(role, fl.NestedByKey)
    return NestedPart(name, role.name, _inner(cls), by_key, role.keys if isinstance(role, fl.NestedByKey) else None)


def _group(kind: str, cls: type, dest: fl.SeriesGroup) -> GroupLayout:
    nested_types = fl.nested_types(cls)
    ordered = sorted(fl.roles(cls), key=lambda item: _ORDER.get(type(item[1]), 9))  # stable: field order within a role
    parts: list[Part] = []
    availability = None
    for name, r in ordered:
        if isinstance(r, fl.Number):
            scalar = _scalar(cls, name, r)
            if parts and isinstance(parts[-1], Scalars):
                parts[-1] = Scalars((*parts[-1].scalars, scalar))
            else:
                parts.append(Scalars((scalar,)))
        elif isinstance(r, fl.Family):
            parts.append(FamilyPart(name, r.name, r.keys))
        elif isinstance(r, fl.Flag):
            parts.append(FlagPart(name, r.name or name))
        elif isinstance(r, (fl.Nested, fl.NestedByKey)):
            parts.append(_nested_part(name, r, nested_types[name]))
        elif isinstance(r, fl.Each):
            parts.append(EachPart(name, r.key, _numbers(nested_types[name])))
        elif isinstance(r, fl.RowsOf):
            parts.append(RowsOfPart(name, r.table, _numbers(nested_types[name])))
        elif isinstance(r, fl.Availability):
            availability = (name, r.reason)
        else:
            raise TypeError(f"{cls.__name__}.{name}: a {type(r).__name__} role has no meaning in a series group")
    return GroupLayout(kind, dest.scope, dest.key, tuple(parts), availability)


def _tracks(kind: str, cls: type, dest: fl.Tracks, track_attrs: frozenset[str]) -> TrackLayout:
    truthy, sets, present, numbers = [], [], [], []
    for name, r in fl.roles(cls):
        if isinstance(r, fl.Fact):
            (truthy if r.keep == "truthy" else present).append(name)
        elif isinstance(r, fl.FactSet):
            sets.append(name)
        elif isinstance(r, fl.Number):
            numbers.append(_scalar(cls, name, r))
        else:
            raise TypeError(f"{cls.__name__}.{name}: a {type(r).__name__} role has no meaning on a process track")
    missing = sorted({*truthy, *sets, *present} - track_attrs)
    if missing:  # a fact needs somewhere to live on the track the rules read
        raise TypeError(f"{cls.__name__}: facts {missing} have no attribute on diag.timeline.model.ProcessTrack")
    return TrackLayout(kind, dest.pid, dest.start, tuple(truthy), tuple(sets), tuple(present), tuple(numbers))


def _table(kind: str, cls: type, dest: fl.Rows) -> TableLayout:
    numbers, texts = [], []
    for name, r in fl.roles(cls):
        if isinstance(r, fl.Number):
            numbers.append(_scalar(cls, name, r))
        elif isinstance(r, fl.Text):
            texts.append(name)
        else:
            raise TypeError(f"{cls.__name__}.{name}: a {type(r).__name__} role has no meaning in a table")
    return TableLayout(kind, dest.table, tuple(numbers), tuple(texts))


def derive(kind: str, cls: type, track_attrs: frozenset[str]) -> Layout | None:
    dest = fl.destination(cls)
    if isinstance(dest, fl.SeriesGroup):
        return _group(kind, cls, dest)
    if isinstance(dest, fl.Tracks):
        return _tracks(kind, cls, dest, track_attrs)
    if isinstance(dest, fl.Rows):
        return _table(kind, cls, dest)
    if isinstance(dest, fl.Kept):
        return KeptLayout(kind, dest.attr, dest.observation)
    return None


SCOPES = ("host", "cgroups", "gpus", "service", "backends")  # the Timeline's dicts of series groups


def _check(layout: Layout, cls: type) -> None:
    """A declaration the Timeline has no place for fails at import, naming what to add -- never silently unread."""
    timeline = {f.name: f.type for f in dataclasses.fields(Timeline)}
    where = f"{cls.__name__} (kind {layout.kind!r})"
    if isinstance(layout, GroupLayout):
        if layout.scope not in SCOPES:
            raise TypeError(f"{where}: series scope {layout.scope!r} is not one of the Timeline's {SCOPES}")
        if layout.availability is not None and layout.scope != "gpus":
            raise TypeError(f"{where}: the Timeline reports availability for GPUs only")
    tables = [p.table for p in layout.parts if isinstance(p, RowsOfPart)] if isinstance(layout, GroupLayout) else []
    if isinstance(layout, TableLayout):
        tables.append(layout.table)
    for table in tables:
        if table in timeline and timeline[table] not in ("Table", Table):
            raise TypeError(f"{where}: table {table!r} would hide the Timeline attribute of that name")
    if isinstance(layout, KeptLayout) and layout.attr not in timeline:
        raise TypeError(f"{where}: records kept in {layout.attr!r}, which diag.timeline.model.Timeline does not have")


def _derive_all() -> dict[str, Layout]:
    attrs = frozenset(f.name for f in dataclasses.fields(ProcessTrack))
    out = {}
    for kind, cls in RECORD_TYPES.items():
        layout = derive(kind, cls, attrs)
        if layout is not None:
            _check(layout, cls)
            out[kind] = layout
    return out


LAYOUTS: dict[str, Layout] = _derive_all()


# --------------------------------------------------------------------------- what typed decoding keeps

_F = float | None
_FLAT = dict[str, _F]


def _inner_type(inner: Inner) -> Any:
    """A nested record as typed decoding reads it: a dict (of numbers, or of nested dicts) -- the json path's shape."""
    if inner.numbers and not inner.nested:
        return _FLAT
    if inner.nested and not inner.numbers:
        (first, *rest) = {_inner_type(p.inner) for p in inner.nested}
        if rest:
            return None  # nested records of different shapes: no typed decoding
        return dict[str, first | None]  # type: ignore[valid-type]
    return None


def _text_type(hint: Any) -> Any:
    if get_origin(hint) is Literal:
        return Literal[get_args(hint)] | None  # type: ignore[valid-type]
    return str | None


def _scalar_type(s: Scalar) -> Any:
    return bool | None if s.is_bool else _F


def typed_fields(layout: Layout, cls: type) -> list[tuple[str, Any, Any]] | None:
    """``(field, type, default)`` of the fields typed decoding keeps for a kind, beyond ``kind`` and ``ts``.

    None: the kind has no column-wise mapping, or a shape typed decoding does not cover.
    """
    if not layout.bulk:
        return None
    hints = fl.hints(cls)
    out: list[tuple[str, Any, Any]] = []
    if isinstance(layout, TableLayout):
        out += [(s.field, _scalar_type(s), None) for s in layout.numbers]
        out += [(t, _text_type(hints[t]), None) for t in layout.texts]
    elif isinstance(layout, TrackLayout):
        out.append((layout.pid, int, dataclasses.MISSING))
        out.append((layout.start, int | float | None, None))  # an int stays one: it is part of the track key ("42@5")
        out += [(f, str | None, None) for f in layout.truthy]
        out += [(f, int | None, None) for f in layout.present]
        out += [(f, list[str] | None, None) for f in layout.sets]
        out += [(s.field, _scalar_type(s), None) for s in layout.numbers]
    elif isinstance(layout, GroupLayout):
        if layout.key is not None:
            out.append((layout.key, str | None, None))
        for part in layout.parts:
            if isinstance(part, Scalars):
                out += [(s.field, _scalar_type(s), None) for s in part.scalars]
            elif isinstance(part, FamilyPart):
                out.append((part.field, _FLAT | None, None))
            elif isinstance(part, FlagPart):
                out.append((part.field, bool | None, None))
            elif isinstance(part, NestedPart):
                inner = _inner_type(part.inner)
                if inner is None:
                    return None
                out.append((part.field, (dict[str, inner | None] if part.by_key else inner) | None, None))
    else:
        return None
    return out


# --------------------------------------------------------------------------- what strict typed decoding reads as records


def _plain_inner(inner: Inner) -> bool:
    return all(not p.by_key and _plain_inner(p.inner) for p in inner.nested)


def closed(part: Part) -> bool:
    """Whether strict typed decoding (``fastdecode.decode_strict``) reads ``part`` as a record rather than a dict.

    Why: a closed family (meminfo, vmstat) or a PSI file is a dict per row to the json path -- 60 keys a host
    row, each a new dict entry -- while its keys are declared; read as a record with a field per declared key it
    costs half. Open families (any key is a signal) stay dicts, and so does nesting by key inside a nested record.
    """
    if isinstance(part, FamilyPart):
        return part.keys is not None
    if isinstance(part, NestedPart):
        return _plain_inner(part.inner) and (not part.by_key or part.keys is not None)
    return False


def _needs_order(part: Part) -> bool:
    """A family's or a by-key nesting's series follow the keys' order in the JSON, which a record does not keep."""
    return isinstance(part, FamilyPart) or (isinstance(part, NestedPart) and part.by_key)


def strict_parts(layout: Layout) -> frozenset[str]:
    """The fields strict typed decoding reads as records: the closed parts -- of a kind in one group only, for those
    whose series follow the JSON's key order (the loader learns it from a batch's first row, which is the first row
    of its group only when there is one group)."""
    if not isinstance(layout, GroupLayout) or not layout.bulk:
        return frozenset()
    return frozenset(
        p.field
        for p in layout.parts
        if isinstance(p, (FamilyPart, NestedPart)) and closed(p) and (layout.key is None or not _needs_order(p))
    )
