"""From inside ``diag collect``: ``diag compact`` on the agent's recorder every so often, as a low-priority child.

Why a child and not a thread: storing an hour decodes it (a fraction of a second of CPU, tens of MiB of decoded
rows); in a child that memory goes back to the system when it exits, and the agent's own footprint -- sampling every
second for days -- stays what it was. At nice 19 it yields the CPU to the service the agent watches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FIRST_AFTER_S = 60.0  # the first run, a minute after the agent starts: hours an older agent left are stored soon
NICE = 19  # the child yields the CPU to the service the agent watches
TIMEOUT_S = 1800.0  # a run that takes longer than this is stopped (and tried again next time)
ERROR_TAIL_BYTES = 4096  # of what a failed run printed, the end (its error) goes to the agent's log


def command(recorder: Path) -> list[str]:
    """The child's command line: ``diag compact --quiet`` on ``recorder`` with this interpreter."""
    return [sys.executable, "-m", "diag.cli", "compact", "--recorder", str(recorder), "--quiet"]


def compact_once(recorder: Path, stop: threading.Event, timeout_s: float = TIMEOUT_S) -> int | None:
    """One ``diag compact --quiet`` on ``recorder``: its exit status, or None when it was stopped (the agent stopping,
    or the run outliving ``timeout_s``). What it printed goes to the agent's log when it failed."""
    # Its stderr goes to a temporary file, not a pipe: a pipe read only after the child exits would fill at 64 KiB
    # (a long traceback, a warning per row) and block the child until the timeout, and its error would be lost.
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(command(recorder), stdout=subprocess.DEVNULL, stderr=errors)
        # Lowered from here, not in the child before exec: the agent has threads (scrapers, the live diagnosis,
        # /metrics), and a preexec_fn in a threaded process can deadlock the child. Its imports run at ours.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, NICE)
        waited = 0.0
        while proc.poll() is None:
            if stop.wait(0.5) or waited >= timeout_s:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                if stop.is_set():  # an ordinary stop of the agent: the hour is stored by the next run
                    log.info("diag compact of %s stopped (agent stopping)", recorder)
                else:
                    log.warning("diag compact of %s stopped (timeout after %gs)", recorder, timeout_s)
                return None
            waited += 0.5
        if proc.returncode != 0:
            log.warning("diag compact of %s failed (exit %d): %s", recorder, proc.returncode, _tail(errors))
    return proc.returncode


def _tail(file: Any) -> str:
    """The last ``ERROR_TAIL_BYTES`` of ``file`` (binary, any position), as text."""
    file.seek(0, os.SEEK_END)
    file.seek(max(0, file.tell() - ERROR_TAIL_BYTES))
    return file.read().decode("utf-8", errors="replace").strip()


def compaction_loop(recorder: Path, every_s: float, stop: threading.Event) -> None:
    """``compact_once`` ``FIRST_AFTER_S`` after the start (at most ``every_s``), then every ``every_s``, until ``stop``."""
    wait = min(FIRST_AFTER_S, every_s)
    while not stop.wait(wait):
        compact_once(recorder, stop)
        wait = every_s


def start_compaction(agent: Any, recorder: Path, every_s: float | None) -> threading.Thread | None:
    """Attach the hourly compaction to a ``collectors.agent.Agent`` (no-op when ``every_s`` is None): a daemon thread
    that stops, and stops its child, with the agent."""
    if every_s is None:
        return None
    thread = threading.Thread(target=compaction_loop, args=(Path(recorder), every_s, agent.stop_event),
                              name="llmdiag-compaction", daemon=True)  # fmt: skip
    thread.start()
    log.info("storing the recorder's complete hours every %gs (diag compact, nice 19)", every_s)
    return thread
