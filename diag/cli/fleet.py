"""``diag analyze --fleet``: the rules run on every target of a fleet, in worker processes, and the ranked table.

Why processes, not threads: the rules are CPU-bound Python and numpy on small arrays, holding the GIL most of
the time, so threads would run them one at a time. Each worker is forked with the rules already imported and the
fleet's query results already loaded: it is sent only a target's index, reads that target's share from the memory
it inherited (pages shared with the parent until written, and the arrays are only read), assembles its Timeline,
runs the rules and sends back the row. Sending each share pickled instead cost a copy of every array through a
pipe and again in the worker (at 800 targets ~1.8 GB each way). One process (``--jobs 1``, or a single target)
runs them in place.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from diag.sources.fleet import MIN_POINTS, FleetTarget


def default_jobs() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def judge_target(target: FleetTarget) -> dict[str, Any]:
    """One target: its Timeline assembled, the rules run, its row (top level, so a worker process can run it).

    A target whose data breaks the assembly or the rules is a row saying so, with the error: one odd target
    (a series no other has, a bug met only there) must not cost the answer for the other hundreds."""
    from diag.rules.engine import analyze
    from diag.views.fleet import failed_row, fleet_row

    try:
        analysis = analyze(target.timeline())
    except Exception as exc:
        return failed_row(target.name, target.points, f"{type(exc).__name__}: {exc}")
    return fleet_row(target.name, target.points, MIN_POINTS, analysis)


# The targets the forked workers judge, by index: set before the pool forks, so each worker inherits them.
_SHARED: Sequence[FleetTarget] = ()


def _judge_shared(index: int) -> dict[str, Any]:
    return judge_target(_SHARED[index])


def judge_fleet(targets: Sequence[FleetTarget], jobs: int, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every target's row, in ``jobs`` forked workers (in this process for one job or one target)."""
    from diag.rules.engine import load_rules

    load_rules()  # imported once here, inherited by every forked worker
    rows: list[dict[str, Any]] = []
    step = max(1, len(targets) // 10)
    jobs = min(jobs, len(targets))
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for target in targets:
            rows.append(judge_target(target))
            if len(rows) % step == 0:
                say(f"judged {len(rows)}/{len(targets)} targets")
        return rows
    global _SHARED
    _SHARED = targets
    # The loaded objects moved out of the collector's reach: a collection in a worker would otherwise write to
    # each object's header, copying every page of the inherited fleet into that worker.
    gc.freeze()
    try:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            for future in as_completed([pool.submit(_judge_shared, i) for i in range(len(targets))]):
                rows.append(future.result())
                if len(rows) % step == 0:
                    say(f"judged {len(rows)}/{len(targets)} targets ({jobs} processes)")
    finally:
        _SHARED = ()
        gc.unfreeze()
    return rows


def progress(message: str) -> None:
    """Progress on stderr (stdout stays the table or the JSON document)."""
    print(f"diag analyze --fleet: {message}", file=sys.stderr, flush=True)
