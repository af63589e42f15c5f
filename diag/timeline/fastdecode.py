"""Typed batch decoding (msgspec) of the record kinds a busy day is made of: request, process, host, cgroup.

Why: a day at 1 Hz plus a million requests is ~2 M JSON rows, and ``json.loads`` builds a dict per
object with every field (ids, strings, ``missing`` maps) only for the loader to throw most of it
away. ``msgspec`` decodes a whole batch (one JSON array of the stored bodies) straight into slotted
Structs that hold only the fields the Timeline reads, numbers already floats: 2-3x less CPU.

Contract: ``decode(kind, text)`` returns the rows, or None when *anything* in the batch does not fit
the declared types (a bad row, a string or a bool where a number belongs, a number out of float
range, a missing ``ts``). The caller then takes the json path, which decides row by row -- so typed
decoding can make loading faster but never change what is loaded. The types are strict on purpose:
every value they accept is one the json path turns into the same float (``float(int)`` and
msgspec's int-to-float are both correctly rounded; both parse decimal floats exactly).

The Structs are ``gc=False`` (they hold no containers that could point back at them), and
``paused_gc`` keeps the cyclic collector from re-scanning a batch's objects over and over while it
is decoded: without it, ~40 % of the json path's time was garbage collection.

msgspec is optional at import time: without it ``AVAILABLE`` is False and ``decode`` returns None.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any, Literal

from collectors.records import REQUEST_OUTCOMES

try:
    import msgspec
except ImportError:  # pragma: no cover - a pinned dependency; the json path still works without it
    msgspec = None  # type: ignore[assignment]

AVAILABLE = msgspec is not None


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


_DECODERS: dict[str, Any] = {}
TYPED_KINDS: frozenset[str] = frozenset()

if msgspec is not None:
    _F = float | None
    _Flat = dict[str, _F]  # meminfo, vmstat, memory.stat, events: name -> number
    _Psi = dict[str, _Flat | None]  # some/full -> avg10/avg60/avg300/total_us (dicts: the json path's shape)

    # ``kind`` and ``outcome`` as Literals: msgspec hands back one shared string object instead of a new one per
    # row (~10 % of a request's decoding), and a row stored under the wrong kind fails the batch over to the json
    # path, which sorts it out. An outcome this version does not know does the same.
    class RequestRow(msgspec.Struct, gc=False):
        kind: Literal["request"]
        ts: float
        arrival: _F = None
        start: _F = None
        finish: _F = None
        prompt_tokens: _F = None
        output_tokens: _F = None
        ttft_s: _F = None
        pid: _F = None
        outcome: Literal[REQUEST_OUTCOMES] | None = None  # type: ignore[valid-type]
        route: str | None = None
        model: str | None = None

    class ProcessRow(msgspec.Struct, gc=False):
        kind: Literal["process"]
        ts: float
        pid: int
        start_time_s: int | float | None = None  # int stays int: it is part of the track key ("42@5" vs "42@5.0")
        ppid: int | None = None
        comm: str | None = None
        cmdline: str | None = None
        memory_cgroup: str | None = None
        model_files: list[str] | None = None
        rss_bytes: _F = None
        pss_bytes: _F = None
        uss_bytes: _F = None
        swap_bytes: _F = None
        major_faults: _F = None
        minor_faults: _F = None

    class HostRow(msgspec.Struct, gc=False):
        kind: Literal["host"]
        ts: float
        psi: dict[str, _Psi | None] | None = None
        memory: _Flat | None = None
        vmstat: _Flat | None = None

    class CgroupRow(msgspec.Struct, gc=False):
        kind: Literal["cgroup"]
        ts: float
        path: str | None = None
        usage_bytes: _F = None
        working_set_bytes: _F = None
        peak_bytes: _F = None
        limit_bytes: _F = None
        high_bytes: _F = None
        low_bytes: _F = None
        min_bytes: _F = None
        swap_bytes: _F = None
        events: _Flat | None = None
        events_local: _Flat | None = None
        stat: _Flat | None = None
        under_oom: bool | None = None
        pressure: _Psi | None = None

    _DECODERS = {
        "request": msgspec.json.Decoder(list[RequestRow]),
        "process": msgspec.json.Decoder(list[ProcessRow]),
        "host": msgspec.json.Decoder(list[HostRow]),
        "cgroup": msgspec.json.Decoder(list[CgroupRow]),
    }
    TYPED_KINDS = frozenset(_DECODERS)


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
