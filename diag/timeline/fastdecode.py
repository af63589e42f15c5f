"""Typed batch decoding (msgspec) of the record kinds read column-wise: one Struct per kind, derived from its layout.

Why: a day at 1 Hz plus a million requests is ~2 M JSON rows, and ``json.loads`` builds a dict per
object with every field (ids, strings, ``missing`` maps) only for the loader to throw most of it
away. ``msgspec`` decodes a whole batch (one JSON array of the stored bodies) straight into slotted
Structs that hold only the fields the Timeline reads, numbers already floats: 2-3x less CPU. The
Structs are not written by hand: ``diag.timeline.layout.typed_fields`` derives each from the kind's
declaration in ``collectors.records``, so a field declared there is decoded here.

Contract: ``decode(kind, text)`` returns the rows, or None when *anything* in the batch does not fit
the declared types (a bad row, a string or a bool where a number belongs, a number out of float
range, a missing ``ts``). The caller then takes the json path, which decides row by row -- so typed
decoding can make loading faster but never change what is loaded. The types are strict on purpose:
every value they accept is one the json path turns into the same float (``float(int)`` and
msgspec's int-to-float are both correctly rounded; both parse decimal floats exactly).

``kind`` (and a text field declared as a ``Literal``, such as a request's outcome) is decoded as a
Literal: msgspec hands back one shared string object instead of a new one per row, and a row stored
under the wrong kind fails the batch over to the json path, which sorts it out.

The Structs are ``gc=False`` (they hold no containers that could point back at them), and
``paused_gc`` keeps the cyclic collector from re-scanning a batch's objects over and over while it
is decoded: without it, ~40 % of the json path's time was garbage collection.

msgspec is optional at import time: without it ``AVAILABLE`` is False and ``decode`` returns None.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator
from typing import Any, Literal

from collectors.records import RECORD_TYPES
from diag.timeline.layout import LAYOUTS, FamilyPart, GroupLayout, Inner, Layout, NestedPart, strict_parts, typed_fields

try:
    import msgspec
except ImportError:  # pragma: no cover - a pinned dependency; the json path still works without it
    msgspec = None  # type: ignore[assignment]

AVAILABLE = msgspec is not None
UNSET: Any = None if msgspec is None else msgspec.UNSET  # a key a row of a strict batch does not have


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside the block (the decoded rows are acyclic; refcounting frees them)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _inner_struct(name: str, inner: Inner) -> Any:
    """A nested record as strict decoding reads it: every declared number present (a number or null), its nested
    records absent, null or records themselves; other keys skipped, as the json path skips them."""
    spec: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        (s.field, (bool if s.is_bool else float) | None)
        for s in inner.numbers  # type: ignore[operator]
    ]
    spec += [(p.field, _inner_struct(f"{name}_{p.field}", p.inner) | None, None) for p in inner.nested]
    return msgspec.defstruct(name, spec, gc=False, module=__name__)


def _closed_type(name: str, part: FamilyPart | NestedPart) -> tuple[Any, Any]:
    """The type and default of a closed part's field in the strict Struct (see ``layout.closed``)."""
    unset = msgspec.UNSET
    if isinstance(part, FamilyPart):
        assert part.keys is not None
        spec = [(k, float | None | msgspec.UnsetType, unset) for k in part.keys]
        return msgspec.defstruct(name, spec, gc=False, forbid_unknown_fields=True, module=__name__), dataclasses.MISSING
    inner = _inner_struct(f"{name}_inner", part.inner)
    if not part.by_key:
        return inner | None, None
    assert part.keys is not None
    spec = [(k, inner | msgspec.UnsetType, unset) for k in part.keys]
    return msgspec.defstruct(name, spec, gc=False, forbid_unknown_fields=True, module=__name__), dataclasses.MISSING


def strict_fields(layout: Layout, cls: type) -> list[tuple[str, Any, Any]] | None:
    """``typed_fields`` with every closed part read as a record (None: the kind has no closed part)."""
    fields = typed_fields(layout, cls)
    if fields is None or not isinstance(layout, GroupLayout) or msgspec is None:
        return None
    names = strict_parts(layout)
    parts = {p.field: p for p in layout.parts if isinstance(p, (FamilyPart, NestedPart)) and p.field in names}
    if not parts:
        return None
    head = "".join(part.title() for part in layout.kind.split("_"))
    out = []
    for name, tp, default in fields:
        part = parts.get(name)
        out.append((name, tp, default) if part is None else (name, *_closed_type(f"{head}_{name}", part)))
    return out


def struct(layout: Layout, cls: type, *, strict: bool = False) -> Any:
    """The Struct typed decoding reads a kind into (None: the kind is not read column-wise, or msgspec is absent).

    ``strict``: the one with closed parts read as records (None: the kind has none)."""
    fields = strict_fields(layout, cls) if strict else typed_fields(layout, cls)
    if fields is None or msgspec is None:
        return None
    required = [(name, tp) for name, tp, default in fields if default is dataclasses.MISSING]
    optional = [(name, tp, default) for name, tp, default in fields if default is not dataclasses.MISSING]
    spec = [("kind", Literal[layout.kind]), ("ts", float), *required, *optional]  # type: ignore[valid-type]
    name = "".join(part.title() for part in layout.kind.split("_")) + ("StrictRow" if strict else "Row")
    return msgspec.defstruct(name, spec, gc=False, module=__name__)


def decoder(layout: Layout, cls: type, *, strict: bool = False) -> Any:
    """A decoder of JSON arrays of the kind's bodies into its Structs (None: no typed decoding for it)."""
    row = struct(layout, cls, strict=strict)
    return None if row is None else msgspec.json.Decoder(list[row])


_DECODERS: dict[str, Any] = {
    kind: found for kind, layout in LAYOUTS.items() if (found := decoder(layout, RECORD_TYPES[kind])) is not None
}
TYPED_KINDS: frozenset[str] = frozenset(_DECODERS)
_STRICT: dict[str, Any] = {
    kind: found
    for kind, layout in LAYOUTS.items()
    if kind in _DECODERS and (found := decoder(layout, RECORD_TYPES[kind], strict=True)) is not None
}
STRICT_KINDS: frozenset[str] = frozenset(_STRICT)


def decode(kind: str, text: str | bytes) -> list[Any] | None:
    """The rows of a JSON array of ``kind`` bodies as Structs; None when the kind has no Struct or any row does not fit."""
    decoder = _DECODERS.get(kind)
    if decoder is None:
        return None
    try:
        rows = decoder.decode(text)
    except msgspec.DecodeError:  # ValidationError is a DecodeError
        return None
    return rows


def decode_strict(kind: str, text: str | bytes) -> list[Any] | None:
    """``decode`` with the kind's closed parts read as records (``bulk.STRICT`` reads them); None when the kind has
    none or any row does not fit -- then ``decode`` decides, as before."""
    found = _STRICT.get(kind)
    if found is None:
        return None
    try:
        rows = found.decode(text)
    except msgspec.DecodeError:
        return None
    return rows
