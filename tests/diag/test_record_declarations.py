"""One declaration per record kind: the field roles in ``collectors.records`` drive every way into the Timeline.

Why: the typed structs, the per-row mapping, the bulk mapping, the Timeline's columns and the signal
vocabulary are all derived from the fields' roles (``collectors.fields``, ``diag.timeline.layout``). These
tests hold that to account: every declared field of every kind reaches the Timeline by every path, with the
names the vocabulary lists; a field added to a declaration -- and nothing else -- is read by all of them; a
declaration the Timeline has no place for fails at import instead of being silently unread.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pytest

from collectors import fields as fl
from collectors.records import RECORD_TYPES, CgroupSnapshot, ProcessSample, Record
from diag.timeline import Timeline, TimelineBuilder, builder, bulk, fastdecode, layout, rowwise, signals

T0 = 1_790_000_000.0


def _value(hint: Any, role: Any, seed: int) -> Any:
    """A value of a field's declared type, distinct per ``seed`` (numbers), for a record with every field set."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return args[0]
    if dataclasses.is_dataclass(hint):
        return _filled(hint, seed)
    if isinstance(role, fl.NestedByKey):
        return {k: _value(args[1], None, seed + i) for i, k in enumerate(role.keys or ("k",))}
    if isinstance(role, fl.Family):
        return {k: seed + i for i, k in enumerate(role.keys or ("k",))}
    if isinstance(role, (fl.Each, fl.RowsOf)):
        return [_filled(args[0], seed)]
    if isinstance(role, fl.FactSet):
        return [f"/m/{seed}"]
    if hint is bool:
        return True
    if hint in (int, float):
        return seed + 0.5 if hint is float else seed
    if hint is str:
        return f"s{seed}"
    raise AssertionError(f"no value for {hint}")


def _filled(cls: type, seed: int = 1) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        if f.name == "ts":
            values["ts"] = T0 + seed
        elif fl.role(f) is not None or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
            values[f.name] = _value(hints[f.name], fl.role(f), seed * 100 + i)
    return cls(**values)


def _three_ways(kind: str, bodies: list[str]) -> list[tuple[str, Timeline]]:
    """The same bodies per row, through the bulk json path, and through typed and strict decoding (where the kind
    has them)."""
    per_row = TimelineBuilder()
    for body in bodies:
        per_row.add_json(body, kind)
    out = [("per_row", per_row.build())]
    if kind in builder._BULK:
        json_path = TimelineBuilder()
        json_path._add_decoded(kind, builder._BULK[kind], "[" + ",".join(bodies) + "]", bodies)
        assert json_path.decode_paths == {"json": len(bodies)}, kind
        out.append(("json", json_path.build()))
    if kind in fastdecode.TYPED_KINDS:
        typed = TimelineBuilder()
        assert typed._add_typed(kind, builder._BULK[kind], "[" + ",".join(bodies) + "]", len(bodies), strict=False)
        assert typed.decode_paths == {"typed": len(bodies)}, kind
        out.append(("typed", typed.build()))
    if kind in fastdecode.STRICT_KINDS:  # closed parts read as records: taken by the loaders when every row fits
        strict = TimelineBuilder()
        strict.add_bodies(kind, bodies)
        assert strict.decode_paths == {"strict": len(bodies)}, kind
        out.append(("strict", strict.build()))
    return out


def _names(tl: Timeline, dest: Any) -> set[str]:
    """What a kind filled: series names (every group), table columns, or kept records."""
    if isinstance(dest, fl.SeriesGroup):
        groups = getattr(tl, dest.scope)
        return {name for series in groups.values() for name in series} if dest.key or dest.scope == "gpus" else set(groups)
    if isinstance(dest, fl.Tracks):
        return {name for track in tl.processes.values() for name in track.series}
    if isinstance(dest, fl.Rows):
        return set(tl.table(dest.table).columns)
    return {type(r).__name__ for r in getattr(tl, dest.attr)}


def _expected(cls: type) -> set[str]:
    dest = fl.destination(cls)
    if isinstance(dest, (fl.SeriesGroup, fl.Tracks)):
        exact, prefixes = fl.filled(cls)
        return set(exact) | {p + "k" for p in prefixes}
    if isinstance(dest, fl.Rows):
        found = layout.LAYOUTS[cls.KIND]
        columns = set(found.columns)
        return columns | ({"queue_wait_s", "inference_s", "e2e_s"} if dest.table == "requests" else set())
    return {cls.__name__}


@pytest.mark.parametrize("kind", sorted(layout.LAYOUTS))
def test_every_declared_field_reaches_the_timeline_by_every_path(kind: str) -> None:
    cls = RECORD_TYPES[kind]
    records = [_filled(cls, seed) for seed in (1, 2, 3)]
    dest = fl.destination(cls)
    ways = _three_ways(kind, [r.to_json() for r in records])
    for path, tl in ways:
        assert _names(tl, dest) == _expected(cls), (kind, path)
        assert tl.counts == {kind: 3} and not tl.skipped, (kind, path)
    reference = ways[0][1]
    for path, tl in ways[1:]:
        _assert_same_values(reference, tl, f"{kind} {path}")


def _assert_same_values(a: Timeline, b: Timeline, where: str) -> None:
    for scope in ("host", "service"):
        assert _flat(getattr(a, scope)) == _flat(getattr(b, scope)), where
    for scope in ("cgroups", "gpus"):
        ga, gb = getattr(a, scope), getattr(b, scope)
        assert list(ga) == list(gb), where
        for key in ga:
            assert _flat(ga[key]) == _flat(gb[key]), (where, key)
    assert list(a.processes) == list(b.processes), where
    for key, track in a.processes.items():
        other = b.processes[key]
        assert dataclasses.replace(track, series={}) == dataclasses.replace(other, series={}), where
        assert _flat(track.series) == _flat(other.series), where
    for name in signals.TABLE_ATTRS.values():
        ta, tb = a.table(name), b.table(name)
        assert list(ta.columns) == list(tb.columns), (where, name)
        assert all(list(ta[c]) == list(tb[c]) for c in ta.columns), (where, name)


def _flat(series: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    return {name: list(zip(s.ts.tolist(), s.values.tolist(), strict=True)) for name, s in series.items()}


def test_the_vocabulary_is_what_the_declarations_fill() -> None:
    """The signal vocabulary's exact keys per scope are the declared ones: nothing listed by hand drifts from them."""
    for scope, cls in (("cgroup:", CgroupSnapshot), ("process:", ProcessSample)):
        exact, prefixes = fl.filled(cls)
        assert signals.FILLED[scope] == exact and signals.FAMILIES[scope] == prefixes
    assert signals.CG_USAGE == "usage" and signals.CG_STAT == "stat." and signals.PSI_TOTAL == "total_s"
    assert {t: t for t in ("requests", "batches", "routing", "loader", "torch", "gpu_processes")} == signals.TABLE_ATTRS


# --------------------------------------------------------------------------- a field added in one place


@dataclass
class _CgroupWithMore(CgroupSnapshot):
    """The cgroup kind with one more counter and one more family: declared here, nowhere else."""

    anon_thp_bytes: int | None = fl.number("anon_thp")
    numa: dict[str, int] = fl.family("numa")


def test_a_field_declared_once_is_read_by_every_path(monkeypatch: pytest.MonkeyPatch) -> None:
    derived = layout.derive("cgroup", _CgroupWithMore, frozenset(f.name for f in dataclasses.fields(builder.ProcessTrack)))
    assert derived is not None
    monkeypatch.setitem(builder._HANDLERS, "cgroup", rowwise.handler(derived))
    monkeypatch.setitem(builder._BULK, "cgroup", bulk.bulk(derived))
    monkeypatch.setitem(fastdecode._DECODERS, "cgroup", fastdecode.decoder(derived, _CgroupWithMore))
    monkeypatch.setitem(fastdecode._STRICT, "cgroup", fastdecode.decoder(derived, _CgroupWithMore, strict=True))
    bodies = [_CgroupWithMore(ts=T0 + i, path="/svc", usage_bytes=i, anon_thp_bytes=10 * i, numa={"n0": i}).to_json()
              for i in range(4)]  # fmt: skip
    for path, tl in _three_ways("cgroup", bodies):
        series = tl.cgroups["/svc"]
        assert series["anon_thp"].values.tolist() == [0.0, 10.0, 20.0, 30.0], path
        assert series["numa.n0"].values.tolist() == [0.0, 1.0, 2.0, 3.0], path
    exact, prefixes = fl.filled(_CgroupWithMore)
    assert "anon_thp" in exact and "numa." in prefixes  # what a vocabulary derived from it would admit


def test_without_its_declaration_the_field_is_not_read() -> None:
    """The counter-test of the one above: the same body through the shipped cgroup kind has no such series."""
    body = _CgroupWithMore(ts=T0, path="/svc", usage_bytes=1, anon_thp_bytes=10).to_json()
    b = TimelineBuilder()
    b.add_bodies("cgroup", [body])
    assert "anon_thp" not in b.build().cgroups["/svc"] and b.decode_paths == {"strict": 1}


# --------------------------------------------------------------------------- declarations the Timeline cannot hold


def _derive(cls: type) -> Any:
    found = layout.derive(cls.KIND, cls, frozenset(f.name for f in dataclasses.fields(builder.ProcessTrack)))
    layout._check(found, cls)
    return found


def test_a_declaration_without_a_place_in_the_timeline_fails_loudly() -> None:
    @dataclass
    class Kept(Record):
        KIND: typing.ClassVar[str] = "x"
        TIMELINE: typing.ClassVar[Any] = fl.Kept("nowhere", "x")

    @dataclass
    class Clash(Record):
        KIND: typing.ClassVar[str] = "y"
        TIMELINE: typing.ClassVar[Any] = fl.Rows("host")
        n: int = fl.number(default=0)

    @dataclass
    class Fact(ProcessSample):
        uid: int | None = fl.fact("present")

    @dataclass
    class Scope(Record):
        KIND: typing.ClassVar[str] = "z"
        TIMELINE: typing.ClassVar[Any] = fl.SeriesGroup("hosts")

    for cls, words in ((Kept, "does not have"), (Clash, "would hide"), (Fact, "ProcessTrack"), (Scope, "not one of")):
        with pytest.raises(TypeError, match=words):
            _derive(cls)


def test_a_new_table_kind_lands_in_timeline_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind whose table the Timeline does not name is still read, into ``Timeline.tables``, and is a signal."""

    @dataclass
    class Preemption(Record):
        KIND: typing.ClassVar[str] = "preemption"
        TIMELINE: typing.ClassVar[Any] = fl.Rows("preemptions", "requests preempted by the backend")
        tokens: int = fl.number(default=0)

    derived = _derive(Preemption)
    monkeypatch.setitem(builder._HANDLERS, "preemption", rowwise.handler(derived))
    b = TimelineBuilder()
    b.add({"kind": "preemption", "ts": T0, "tokens": 12})
    tl = b.build()
    assert tl.table("preemptions")["tokens"].tolist() == [12.0] and tl.tables["preemptions"] is tl.table("preemptions")
    assert len(tl.table("requests")) == 0


# --------------------------------------------------------------------------- facts read the same on both paths


def test_a_present_fact_is_the_last_value_that_is_not_none_on_both_paths() -> None:
    """ppid 0 is a value (the per-row path always kept it; the bulk path used to drop it as falsy), and a ppid that
    is not an int makes the per-row path skip its record -- so the bulk path hands such a batch to it."""
    zero = [json.dumps({"kind": "process", "ts": T0 + i, "pid": 5, "ppid": 0, "rss_bytes": 1}) for i in range(3)]
    bad = [json.dumps({"kind": "process", "ts": T0 + i, "pid": 5, "ppid": "x" if i == 1 else 2, "rss_bytes": 1})
           for i in range(3)]  # fmt: skip
    for bodies, ppid, counts in ((zero, 0, {"process": 3}), (bad, 2, {"process": 2})):
        per_row = TimelineBuilder()
        for body in bodies:
            per_row.add_json(body, "process")
        together = TimelineBuilder()
        together.add_bodies("process", bodies)
        for tl in (per_row.build(), together.build()):
            assert tl.processes["5@None"].ppid == ppid and tl.counts == counts


def test_typed_structs_are_derived_for_every_column_wise_kind() -> None:
    """Every kind read column-wise has typed decoding, its Struct keeping exactly the declared fields."""
    for kind, found in layout.LAYOUTS.items():
        if not found.bulk:
            assert kind not in fastdecode.TYPED_KINDS
            continue
        row = fastdecode.struct(found, RECORD_TYPES[kind])
        names = set(row.__struct_fields__) - {"kind", "ts"}
        declared = {name for name, _ in fl.roles(RECORD_TYPES[kind])}
        keys = {getattr(found, "key", None), getattr(found, "pid", None), getattr(found, "start", None)} - {None}
        assert names == declared | keys, kind
    assert np.isnan(fastdecode.decode("request", '[{"kind":"request","ts":1}]')[0].arrival or np.nan)
