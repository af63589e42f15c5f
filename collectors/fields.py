"""What each record field becomes in the Timeline: plain data, declared on the field itself in ``collectors.records``.

Why: a record kind is read by the flight recorder's loader, a bundle's loader, per row and in bulk, with
typed (msgspec) decoding and with ``json`` -- and every one of those paths must put the same field in
the same column. Declared once, on the dataclass field (its *role*) and on the class (its *destination*),
everything else is derived from it by ``diag.timeline.layout``: the typed structs, the Timeline's
columns and series names, the per-row and the bulk mappings, and the signal vocabulary. A new field is
one line in ``collectors/records.py``; so is a new kind.

This module is data only: ``collectors`` never imports ``diag`` or numpy (the agent stays small).

Destinations (a kind's ``TIMELINE`` class attribute):

- ``SeriesGroup(scope, key)``: sampled series in ``Timeline.<scope>`` (``host``, ``cgroups``, ``gpus``,
  ``service``), one group per value of the ``key`` field when there is one (a cgroup's ``path``);
- ``Tracks(pid, start)``: ``Timeline.processes``, one track per (pid, start time), with facts beside the series;
- ``Rows(table)``: an event table, one row per record (``ts`` first, then the fields' columns);
- ``Kept(attr)``: the records themselves, in a list the rules read whole (OOM kills, configurations).

Roles (on fields; a field without one is not read into the Timeline -- and not decoded by the typed path):

- ``number(name)``: a number, the series or column ``name`` (default: the field's own name);
  ``divide_by`` converts a unit (microseconds to seconds);
- ``flag(name)``: a bool as 0/1 (absent when None);
- ``text()``: a string column of a table;
- ``family(name)``: an open map of numbers, one series ``<name>.<key>`` per key (``keys``: the keys the
  signal vocabulary admits, when the family is a closed list such as meminfo's fields);
- ``nested(name)``: a record-valued field (a PSI file): its own fields' roles, named ``<name>.<theirs>``;
- ``nested_by_key(name)``: a map of such records (host PSI per resource): ``<name>.<key>.<theirs>``;
- ``fact(keep)``: a track's fact, the last ``"truthy"`` (or ``"present"``: not None) value seen;
  ``fact_set()``: the union of a list field over the track;
- ``each(key)``: a list of records each naming its own group by its ``key`` field (GPU devices by index);
- ``rows_of(table)``: a list of records as rows of a table, stamped with the record's ``ts``;
- ``availability(reason)``: False means the source is unavailable (``reason`` says why) and nothing else is read.

Order: within a group, a kind's series come in the order numbers, families, flags, nested records, each in
field order (what the Timeline's dicts list first); tables list numbers, then strings.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple, get_type_hints

ROLE = "llmdiag.timeline"  # the key of a field's role in ``dataclasses.field(metadata=...)``
REQUIRED: Any = dataclasses.MISSING  # ``default=REQUIRED``: the field has no default


# --------------------------------------------------------------------------- destinations (a kind's TIMELINE)


class SeriesGroup(NamedTuple):
    scope: str  # the Timeline attribute: host, cgroups, gpus or service
    key: str | None = None  # the field whose value names the group (None: one group)


class Tracks(NamedTuple):
    pid: str = "pid"  # the fields that identify a process over its life
    start: str = "start_time_s"


class Rows(NamedTuple):
    table: str  # the Timeline attribute (or, for a table it does not name, ``Timeline.tables[table]``)
    about: str = ""  # where such rows come from: the report's "why missing" text


class Kept(NamedTuple):
    attr: str  # the Timeline attribute holding the records, oldest first
    signal: str  # the signal name rules ask for
    about: str = ""
    observation: bool = True  # False: the record states a configuration; it does not stretch the Timeline's window


Destination = SeriesGroup | Tracks | Rows | Kept


# --------------------------------------------------------------------------- roles (on fields)


class Number(NamedTuple):
    name: str | None = None
    divide_by: float | None = None


class Flag(NamedTuple):
    name: str | None = None


class Text(NamedTuple):
    """A string column of a table."""


class Family(NamedTuple):
    name: str
    keys: tuple[str, ...] | None = None  # None: open (any key is a signal of the family)


class Nested(NamedTuple):
    name: str


class NestedByKey(NamedTuple):
    name: str
    keys: tuple[str, ...] | None = None


class Fact(NamedTuple):
    keep: Literal["truthy", "present"] = "truthy"


class FactSet(NamedTuple):
    """The union of a list field over a track."""


class Each(NamedTuple):
    key: str


class RowsOf(NamedTuple):
    table: str
    about: str = ""


class Availability(NamedTuple):
    reason: str


Role = Number | Flag | Text | Family | Nested | NestedByKey | Fact | FactSet | Each | RowsOf | Availability


def _field(role: Role, default: Any = None, factory: Any = None) -> Any:
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={ROLE: role})
    return dataclasses.field(default=default, metadata={ROLE: role})


def number(name: str | None = None, *, default: Any = None, divide_by: float | None = None) -> Any:
    return _field(Number(name, divide_by), default)


def flag(name: str | None = None, *, default: Any = None) -> Any:
    return _field(Flag(name), default)


def text(*, default: Any = "") -> Any:
    return _field(Text(), default)


def family(name: str, *, keys: Iterable[str] | None = None) -> Any:
    return _field(Family(name, None if keys is None else tuple(keys)), factory=dict)


def nested(name: str, *, default: Any = None) -> Any:
    return _field(Nested(name), default)


def nested_by_key(name: str, *, keys: Iterable[str] | None = None) -> Any:
    return _field(NestedByKey(name, None if keys is None else tuple(keys)), factory=dict)


def fact(keep: Literal["truthy", "present"] = "truthy", *, default: Any = None) -> Any:
    return _field(Fact(keep), default)


def fact_set() -> Any:
    return _field(FactSet(), factory=list)


def each(key: str) -> Any:
    return _field(Each(key), factory=list)


def rows_of(table: str, about: str = "") -> Any:
    return _field(RowsOf(table, about), factory=list)


def availability(reason: str) -> Any:
    return _field(Availability(reason), default=False)


# --------------------------------------------------------------------------- reading the declaration


def role(f: dataclasses.Field[Any]) -> Role | None:
    return f.metadata.get(ROLE)


def roles(cls: type) -> list[tuple[str, Role]]:
    """``(field name, role)`` of every field of ``cls`` that has one, in field order."""
    return [(f.name, r) for f in dataclasses.fields(cls) if (r := role(f)) is not None]


def destination(cls: type) -> Destination | None:
    return getattr(cls, "TIMELINE", None)


def series_name(cls: type, field_name: str) -> str:
    """The series or column a ``number``/``flag`` field becomes (``CgroupSnapshot.usage_bytes`` -> ``usage``)."""
    r = next((r for name, r in roles(cls) if name == field_name), None)
    if not isinstance(r, (Number, Flag)):
        raise KeyError(f"{cls.__name__}.{field_name} is not a number or flag of the Timeline")
    return r.name or field_name


def filled(cls: type) -> tuple[frozenset[str], tuple[str, ...]]:
    """The series names a kind's group can hold: exact names, and the prefixes of its open families (``stat.``).

    A closed family, or a keyed nesting, holds exactly the keys it declares; ``each`` elements fill the group they name.
    """
    types = nested_types(cls)
    exact: set[str] = set()
    prefixes: list[str] = []
    for name, r in roles(cls):
        if isinstance(r, (Number, Flag)):
            exact.add(r.name or name)
        elif isinstance(r, Family):
            if r.keys is None:
                prefixes.append(r.name + ".")
            else:
                exact.update(f"{r.name}.{k}" for k in r.keys)
        elif isinstance(r, (Nested, NestedByKey, Each)):
            inner, inner_prefixes = filled(types[name])
            if isinstance(r, Each):
                heads: list[str | None] = [None]
            elif isinstance(r, Nested):
                heads = [r.name]
            else:
                heads = [f"{r.name}.{k}" for k in (r.keys or ())]
            exact.update(n if head is None else f"{head}.{n}" for head in heads for n in inner)
            prefixes.extend(p if head is None else f"{head}.{p}" for head in heads for p in inner_prefixes)
    return frozenset(exact), tuple(prefixes)


def record_type(hint: Any) -> type | None:
    """The dataclass inside a field's type hint (``Psi | None``, ``dict[str, Psi]``, ``list[GpuDevice]``), if any."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    for arg in getattr(hint, "__args__", ()) or ():
        found = record_type(arg)
        if found is not None:
            return found
    return None


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a record class (resolving them is slow, and a class never changes)."""
    return get_type_hints(cls)


def nested_types(cls: type) -> dict[str, type]:
    """The record class of each nested, per-key nested, ``each`` and ``rows_of`` field of ``cls``, by field name."""
    found = hints(cls)
    kinds = (Nested, NestedByKey, Each, RowsOf)
    return {name: t for name, r in roles(cls) if isinstance(r, kinds) and (t := record_type(found[name])) is not None}
