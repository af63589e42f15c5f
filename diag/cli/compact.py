"""``diag compact``: store a flight recorder's complete hours decoded beside it, so analysing a day reads columns.

``diag collect`` runs it itself once an hour (``--compact-every``), as a low-priority child: decoding an hour costs a
fraction of a second of CPU and a few tens of MiB that the child gives back when it exits, not the agent.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Annotated

import typer

from collectors.recorder import default_recorder_path
from diag.cli.errors import fail


def compact_command(
    recorder: Annotated[
        Path | None, typer.Option(readable=False, help="Flight recorder whose hours to store (default: the agent's).")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
) -> None:
    """Store every complete hour of the flight recorder decoded, in <recorder>.blocks beside it.

    `diag analyze` and the triage receiver then read those hours as columns instead of decoding each JSON row
    again: a day of 1 Hz samples and a million requests loads in about a fifth of the time. An hour is stored once
    it has been over for 10 minutes, and only while the recorder holds all of it. A stored hour whose rows changed
    since (a late row, a trim), or that older code wrote, is read from the rows and stored again; blocks of hours
    the recorder no longer holds are dropped, so the file stays a fraction of the recorder's size. Safe while `diag
    collect` writes the recorder. Readers never need it: without it, or with a damaged one, they read every row.

    Exit status: 0 done; 2 no recorder at the path, or it is not a readable flight recorder.

    Examples:\n
      diag compact                                  # the agent's recorder (diag collect runs this hourly)\n
      diag compact --recorder /var/lib/llm-diag/recorder.db
    """
    from collectors.recorder import FlightRecorder, RecorderCorrupt
    from diag.sources.blocks import blocks_path
    from diag.sources.compact import compact

    path = recorder or default_recorder_path()
    if not path.exists():
        fail(f"no flight recorder at {path}; run `diag collect` first, or pass --recorder")
    try:
        FlightRecorder(path, readonly=True).close()
        done = compact(path, progress=None if quiet else lambda line: typer.echo(f"diag compact: {line}", err=True))
    except (RecorderCorrupt, sqlite3.DatabaseError) as exc:
        fail(f"{exc if isinstance(exc, RecorderCorrupt) else f'{path} is not a readable flight recorder ({exc})'}")
    except (OSError, RuntimeError) as exc:
        fail(f"cannot store the hours of {path} beside it: {exc}")
    if not quiet:
        typer.echo(
            f"diag compact: {done.written} hour(s) stored ({done.bytes_written / 2**20:.1f} MiB), {done.kept} still "
            f"valid, {done.dropped} dropped, in {done.seconds:.1f} s: {blocks_path(path)}",
            err=True,
        )


def register(app: typer.Typer) -> None:
    """Add ``compact`` to the ``diag`` app."""
    app.command("compact")(compact_command)
