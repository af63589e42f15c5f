"""The flight recorder's last ``--since``, streamed (redacted per field) into staged ``timeline/*.jsonl``.

One JSON record per line, one file per kind, oldest first: what ``diag.sources.load_bundle`` reads (the
bundle's own analysis reads the folder with it, so findings.json is what ``diag analyze --bundle`` gives
anywhere). Every row passes the redactor here, in the worker, because an hour of history is too much to hand
to the main thread whole; the main thread adopts the staged files only when the plugin finished or
acknowledged its cancellation. A record no rule touches is written as it was stored. Over ``history_cap``
bytes the OLDEST rows are left out (the window starts later). Cancelled at its deadline, it stops at the next
batch and returns what it has (marked truncated). The SQL is the recorder's own (``RecorderReader``).
"""

from __future__ import annotations

import itertools
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from collectors.recorder import FlightRecorder, RecorderCorrupt, default_recorder_path
from collectors.recorder_queries import RecorderReader
from diag.bundle.bounded import describe
from diag.bundle.plugin import Context, Output, State
from diag.bundle.redactor import Redactor, parse_many

_KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,40}$")
BATCH = 1000


@dataclass
class History:
    """What the history plugin staged: one file per kind, for the main thread to adopt."""

    files: dict[str, Path]  # kind -> staged jsonl
    rows: dict[str, int] = field(default_factory=dict)  # kind -> rows written
    bytes: int = 0
    oom_keys: set[tuple[int | None, int]] = field(default_factory=set)


def oom_key(obj: dict[str, Any]) -> tuple[int | None, int]:
    """The same kill as the agent recorded it and as the kernel plugin parses it again: (pid, second)."""
    pid = obj.get("pid")
    return (pid if isinstance(pid, int) else None, round(float(obj.get("ts") or 0.0)))


def read_history(state: State, ctx: Context) -> Output:
    o = state.options
    path = Path(o.recorder) if o.recorder is not None else default_recorder_path()
    if not path.exists():
        return Output(status="skipped", reason=f"no flight recorder at {path} (run `diag collect` to keep history)")
    try:
        FlightRecorder(path, readonly=True).close()
        return _stream(path, state, ctx)
    except (RecorderCorrupt, sqlite3.DatabaseError) as exc:
        why = exc if isinstance(exc, RecorderCorrupt) else f"{path} is not a readable flight recorder ({exc})"
        return Output(status="error", reason=f"history missing: {why}; the agent moves such a file aside on its "
                      "next start, or pass --recorder with another file")  # fmt: skip
    except PermissionError as exc:
        return Output(status="error", reason=f"history missing: cannot read {path}: {describe(exc)}")


def _stream(path: Path, state: State, ctx: Context) -> Output:
    o = state.options
    since, truncated, skipped_rows = _window_under_cap(path, state.since, o.history_cap, ctx)
    hist = History({})
    cancelled = False
    handles: dict[str, Any] = {}
    state.staging.mkdir(parents=True, exist_ok=True)
    redactor = state.redactor
    try:
        with RecorderReader.open(path) as rec:
            rows = rec.rows(since=since)
            while chunk := list(itertools.islice(rows, BATCH)):
                if ctx.cancel.is_set():
                    cancelled = True
                    break
                lines: dict[str, list[str]] = {}  # this batch's lines by kind, written at once
                for kind, line, obj in _redacted(chunk, redactor):
                    k = kind if _KIND_RE.match(kind or "") else "unknown"
                    own = obj["kind"]
                    if own != kind and isinstance(own, str) and _KIND_RE.match(own):
                        k = own  # the record's own kind wins over the row's label
                    if k == "oom":
                        hist.oom_keys.add(oom_key(obj))
                    batch = lines.get(k)
                    if batch is None:
                        batch = lines[k] = []
                    batch.append(line)
                for k, batch in lines.items():
                    fh = handles.get(k)
                    if fh is None:
                        hist.files[k] = state.staging / f"{k}.jsonl"
                        fh = handles[k] = open(hist.files[k], "w", encoding="utf-8")  # noqa: SIM115 - closed below
                    text = "\n".join(batch) + "\n"
                    fh.write(text)
                    hist.rows[k] = hist.rows.get(k, 0) + len(batch)
                    hist.bytes += len(text)
    finally:
        for fh in handles.values():
            fh.close()
    total = sum(hist.rows.values())
    out = Output(extra={"history": hist, "rows": total, "bytes": hist.bytes, "recorder": str(path),
                        "since": since, "rows_left_out": skipped_rows})  # fmt: skip
    if cancelled:
        out.timeout_hit = True
        out.extra["truncated"] = True
        out.reason = f"stopped at its deadline after {total} rows: the newest records of the window are missing"
    elif truncated:
        out.reason = f"history over {o.history_cap} bytes: the oldest {skipped_rows} rows left out (window starts later)"
        out.extra["truncated"] = True
    if total == 0:
        out.status, out.reason = "skipped", f"the flight recorder {path} has no records in the window"
    return out


class _Head(msgspec.Struct):
    """The three fields the stream needs of a record it writes as it came (the rest is validated and skipped)."""

    kind: Any = None
    ts: Any = None
    pid: Any = None


_HEADS = msgspec.json.Decoder(list[_Head])
Row = tuple[float, str, str]


def _redacted(chunk: list[Row], redactor: Redactor) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(row kind, line to write, what the line decodes to -- or its head) for each row that is a JSON object.

    Fast path: the batch is decoded once into heads (every row validated as a JSON object, nothing else
    built) and, when no string in it is one a rule acts on (``json_text_is_clean``), every row is written as
    it was stored. Otherwise each row is decoded and redacted on its own (``record_line``).
    """
    bodies = [r[2] for r in chunk]
    joined = "[" + ",".join(bodies) + "]"
    try:
        heads = _HEADS.decode(joined)
    except (msgspec.DecodeError, RecursionError):
        heads = None
    if heads is not None and len(heads) == len(chunk) and redactor.json_text_is_clean(joined):
        for (_ts, kind, body), head in zip(chunk, heads, strict=True):
            yield kind, body, {"kind": head.kind, "ts": head.ts, "pid": head.pid}
        return
    for (_ts, kind, body), parsed in zip(chunk, parse_many(bodies), strict=True):
        got = redactor.record_line(body, f"timeline/{kind if _KIND_RE.match(kind or '') else 'unknown'}.jsonl", parsed)
        if got is not None:
            yield kind, got[0], {"kind": got[1].get("kind"), "ts": got[1].get("ts"), "pid": got[1].get("pid")}


def _window_under_cap(path: Path, since: float, cap: int, ctx: Context) -> tuple[float, bool, int]:
    """Move the window's start forward until the rows in it fit ``cap`` bytes of JSON (newest kept).

    A recorder whose files (database and write-ahead log) are no bigger than the cap cannot hold more JSON than
    that, so it is not asked: summing the bodies' lengths reads every one of them (0.05-0.2 s for an hour).
    """
    on_disk = sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())
    if on_disk <= cap:
        return since, False, 0
    with RecorderReader.open(path, timeout_s=5.0) as reader:
        total, count = reader.size_from(since)
        if total <= cap:
            return since, False, 0
        kept = rows = 0
        cutoff = since
        for ts, length in reader.lengths_newest_first(since):
            if rows % 5000 == 0:
                ctx.check()
            if kept + length > cap:
                break
            kept += length
            rows += 1
            cutoff = ts
        return cutoff, True, count - rows
