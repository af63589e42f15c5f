"""Where the whole suite's time goes: seconds per xdist group, from the JUnit XML of a ``make test`` run.

Why: ``make test`` spreads the suite over xdist workers with ``--dist loadgroup``, and a group runs on one worker
from its first test to its last. The run cannot end before its longest group does, so the serial ``live`` group
(tests that inject faults the host shows, one after another) is a floor under the wall time whatever the number of
workers; this prints that floor beside the sum of everything, so a change to the suite is measured against the
right figure.

    PYTEST_ADDOPTS="--junitxml=/tmp/suite.xml" make test
    .venv/bin/python bench/suite.py /tmp/suite.xml --workers 4

Group names come from the test ids xdist writes (``path::test@group``); a test without one was spread freely.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def durations(junit: Path) -> list[tuple[str, str, float]]:
    """(test id, group or "", seconds) for every test case of the file (setup, call and teardown together)."""
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        test, _, group = name.partition("@")
        out.append((f"{case.get('classname', '')}::{test}", group, float(case.get("time", "0") or 0)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("junit", type=Path, help="the JUnit XML of a whole-suite run (pytest --junitxml)")
    ap.add_argument("--workers", type=int, default=4, help="xdist workers of that run (make test: 4)")
    ap.add_argument("--top", type=int, default=15, help="groups and tests listed")
    args = ap.parse_args(argv)
    if not args.junit.is_file():
        print(f"suite.py: {args.junit}: no such file (run the suite with --junitxml first)", file=sys.stderr)
        return 2
    try:
        rows = durations(args.junit)
    except ET.ParseError as exc:
        print(f"suite.py: {args.junit}: not JUnit XML ({exc})", file=sys.stderr)
        return 2
    groups: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for _, group, seconds in rows:
        groups[group or "(no group)"] += seconds
        counts[group or "(no group)"] += 1
    total = sum(s for _, _, s in rows)
    grouped = {g: s for g, s in groups.items() if g != "(no group)"}
    longest = max(grouped.items(), key=lambda kv: kv[1], default=("-", 0.0))
    spread = total / args.workers
    print(f"{len(rows)} tests, {total:.0f} s summed; {spread:.0f} s per worker if perfectly spread over {args.workers}")
    print(f"longest group: {longest[0]} {longest[1]:.0f} s ({counts.get(longest[0], 0)} tests) -- a floor under the wall time")
    print(f"\n{'group':<60} {'tests':>6} {'seconds':>9}")
    for group, seconds in sorted(groups.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{group[:60]:<60} {counts[group]:>6} {seconds:>9.1f}")
    print(f"\nslowest tests of {longest[0]}:")
    for test, _group, seconds in sorted((r for r in rows if r[1] == longest[0]), key=lambda r: -r[2])[: args.top]:
        print(f"  {seconds:7.1f} s  {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
