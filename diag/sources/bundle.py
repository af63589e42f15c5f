"""Build a Timeline from an incident bundle directory (``timeline/<kind>.jsonl``, one JSON record per line)."""

from __future__ import annotations

from pathlib import Path

from diag.sources.archive import read_timeline
from diag.sources.recorder import BATCH_BYTES, BATCH_ROWS
from diag.timeline import Timeline, TimelineBuilder
from diag.timeline.fastdecode import paused_gc


def load_bundle(path: str | Path) -> Timeline:
    """Records from a bundle's ``timeline/*.jsonl`` (one JSON record per line; a bad line is counted, not fatal).

    ``path`` is the bundle folder or its archive (``.tar.gz``/``.tar``, read without extracting)."""
    root = Path(path)
    if root.is_file():  # a .tar.gz / .tar: read in place, never extracted (untrusted input)
        builder = TimelineBuilder(source=f"bundle:{root}")
        with paused_gc():
            for kind, lines in read_timeline(root, batch_rows=BATCH_ROWS, batch_bytes=BATCH_BYTES):
                builder.add_bodies(kind, lines)
        return builder.build()
    folder = root / "timeline"
    if not folder.is_dir():
        raise FileNotFoundError(f"{root} is not an llm-diag bundle (no timeline/ folder)")
    builder = TimelineBuilder(source=f"bundle:{root}")
    with paused_gc():
        _read_bundle_files(builder, folder)
    return builder.build()


def _read_bundle_files(builder: TimelineBuilder, folder: Path) -> None:
    for file in sorted(folder.glob("*.jsonl")):
        with file.open(encoding="utf-8", errors="replace") as fh:
            batch: list[str] = []
            size = 0
            for line in fh:
                line = line.strip()
                if line:
                    batch.append(line)
                    size += len(line)
                    if size >= BATCH_BYTES or len(batch) >= BATCH_ROWS:
                        builder.add_bodies(file.stem, batch)
                        batch, size = [], 0
            builder.add_bodies(file.stem, batch)
