"""The incident bundle a gate takes at its first failed step: ``diag bundle`` over the run so far, once.

Why a subprocess (``python -m diag.cli bundle``) rather than calling the bundle in-process: it is the same code
path as the command an on-call engineer runs, options checked the same way; the bundle is a peer of the gate in
the layer order (neither imports the other); and it changes the process it runs in -- it moves itself out of the
watched cgroup, sets the malloc arenas, abandons hung collectors' threads -- none of which the gate's own
process, still to send the next steps' load, should suffer. Its own deadline bounds it; a wall-clock timeout
beyond that kills its process group, so a bundle can delay the gate but never hang it.

Taken between steps, not beside the next one: the bundle's own CPU and disk would otherwise be charged to the
next step's latencies. A bundle that cannot be written is a note, never a change of the gate's verdict.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

DEADLINE_S = 30.0  # the bundle's own deadline (its default): what it may cost the run
GRACE_S = 30.0  # past the deadline, the interpreter's start and the archive: then it is killed
POLL_S = 0.25  # how often a Ctrl-C of the gate is looked for while the bundle runs
MARGIN_S = 30.0  # history before the run's start: the baseline the first step is compared with


@dataclass(frozen=True)
class BundleOutcome:
    """Where the bundle went (``path`` the folder, ``archive`` its .tar.gz), or why there is none (``note``)."""

    path: str | None
    archive: str | None
    duration_s: float
    note: str = ""


def bundle_argv(out_dir: Path, recorder: Path, since_s: float, pids: Sequence[int], cgroups: Sequence[str],
                deadline_s: float = DEADLINE_S) -> list[str]:  # fmt: skip
    """The ``diag bundle`` command line: the run's recorder, the run's history, the gate's targets."""
    argv = [sys.executable, "-m", "diag.cli", "bundle", "--out", str(out_dir), "--recorder", str(recorder),
            "--since", f"{max(1, math.ceil(since_s))}s", "--deadline", f"{deadline_s:g}s", "--quiet"]  # fmt: skip
    for pid in pids:
        argv += ["--pid", str(pid)]
    for path in cgroups:
        argv += ["--cgroup", path]
    return argv


def _field(stdout: str, name: str) -> str | None:
    for line in stdout.splitlines():
        if line.startswith(f"{name}: "):
            return line[len(name) + 2 :].strip()
    return None


def take_bundle(out_dir: Path, recorder: Path, run_start: float, pids: Sequence[int] = (), cgroups: Sequence[str] = (),
                deadline_s: float = DEADLINE_S, cancelled: Callable[[], bool] = lambda: False) -> BundleOutcome:  # fmt: skip
    """Run ``diag bundle`` over [run_start - MARGIN_S, now]; never raises (a failure is the outcome's note).
    ``cancelled`` (polled) abandons it: a Ctrl-C of the gate is not held up by the bundle."""
    t0 = time.monotonic()
    argv = bundle_argv(out_dir, recorder, time.time() - run_start + MARGIN_S, pids, cgroups, deadline_s)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
    except OSError as exc:
        return BundleOutcome(None, None, 0.0, f"bundle not taken: cannot start diag bundle ({exc})")
    why = ""
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            if cancelled():
                why = "bundle not taken: the run was interrupted while it was being written"
            elif time.monotonic() - t0 > deadline_s + GRACE_S:
                why = f"bundle not taken: diag bundle did not finish in {time.monotonic() - t0:.0f} s (killed)"
            if why:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the bundle and its commands
                proc.communicate()
                return BundleOutcome(None, None, time.monotonic() - t0, why)
    took = time.monotonic() - t0
    path = _field(stdout, "Bundle")
    if proc.returncode != 0 or path is None:
        last = (stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return BundleOutcome(None, None, took, f"bundle not taken: {last.removeprefix('diag: ')}")
    return BundleOutcome(path, _field(stdout, "Archive"), took)
