"""What several benchmarks measure the same way: a free loopback port, a process's CPU seconds, and a seeded
bootstrap interval of a median. One copy, so two benchmarks that print the same kind of figure compute it alike.

Imported as ``bench.common`` by scripts that put the repository's root first on ``sys.path`` (each does).
"""

from __future__ import annotations

import os
import random
import socket
import statistics
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (benchmarks only ever listen on loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stat_ticks(stat_path: str | Path) -> int:
    """utime + stime of a /proc/<pid>[/task/<tid>]/stat file, in clock ticks (fields 14 and 15 of proc(5)); the
    split after the last ')' keeps a command name with spaces or parentheses from shifting the fields."""
    fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used so far."""
    return stat_ticks(f"/proc/{pid}/stat") / CLK_TCK


def bootstrap_median_ci(values: list[float], level: float = 0.95, n: int = 4000) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of ``values`` (seeded: the same data print the same interval)."""
    if len(values) < 2:
        return values[0], values[0]
    rng = random.Random(20261202)
    k = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=k)) for _ in range(n))
    return meds[int((1 - level) / 2 * n)], meds[min(n - 1, int((1 + level) / 2 * n))]
