"""Store the complete hours of a flight recorder as blocks (``diag.sources.blocks``), and drop the stale ones.

Its own module because it reads the recorder as ``load_recorder`` does (``diag.sources.recorder.read_range``) and
writes what ``load_recorder`` reads (``blocks``): the two readers' modules then stay one-way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from collectors.recorder_queries import RecorderReader
from diag.sources import blocks
from diag.sources.blocks import Block, BlockFile
from diag.sources.recorder import read_range
from diag.timeline.fastdecode import paused_gc


@dataclass
class Compacted:
    """What one ``compact`` did."""

    written: int = 0  # hours decoded and stored now
    kept: int = 0  # hours whose stored block still held
    dropped: int = 0  # blocks removed (the recorder no longer holds their hour, or older code wrote them)
    bytes_written: int = 0
    seconds: float = 0.0


def compact(recorder: str | Path, *, now: float | None = None, progress: Callable[[str], None] | None = None) -> Compacted:
    """Decode and store every complete hour of ``recorder`` that has no valid block; drop the blocks that lost theirs.

    An hour is stored only when the recorder holds all of it (it starts at or after the first row) and it ended
    ``blocks.LATE_S`` before ``now``. Each hour is summarised and read in one snapshot of the recorder.
    """
    t0 = time.monotonic()
    done = Compacted()
    current = blocks.version()
    if current is None:
        raise RuntimeError("the decoding code's sources cannot be read, so no block can be vouched for")
    now = time.time() if now is None else now
    with RecorderReader.open(recorder) as reader, BlockFile.open_for_writing(recorder) as store, paused_gc():
        span = reader.ts_range()
        stored = {b.lo: b for b in store.index()}
        lo = math.ceil(span[0] / blocks.BLOCK_S) * blocks.BLOCK_S if span is not None else math.inf  # the first hour held whole
        end = blocks.hour_floor(now - blocks.LATE_S)  # hours ending by then are complete
        stale = [b.lo for b in stored.values() if b.version != current or b.lo < lo or b.hi > end]
        store.drop(stale)
        done.dropped = len(stale)
        while lo + blocks.BLOCK_S <= end:
            hi = lo + blocks.BLOCK_S
            reader.begin()  # one snapshot: the summary and the rows it vouches for
            try:
                ids = reader.ids_between(lo, hi)
                old = stored.get(lo)
                if ids[0] and old is not None and old.version == current and old.ids == ids:
                    done.kept += 1
                elif ids[0]:  # an hour with nothing recorded keeps nothing
                    builder = read_range(reader, lo, math.nextafter(hi, -math.inf), f"recorder:{recorder}")
                    done.bytes_written += store.put(Block(lo, hi, current, ids), builder)
                    done.written += 1
                    if progress is not None:
                        progress(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(lo))} UTC: {ids[0]} rows stored")
            finally:
                reader.end()
            lo = hi
    done.seconds = time.monotonic() - t0
    return done
