"""The noisy neighbour: a process that thrashes its *own* memory cgroup, next to the service.

``python -m diag.demo.scenarios.hog --anon-mib 100 --file F --seconds 60`` allocates and writes
``anon-mib`` of anonymous memory (which cannot be reclaimed: there is no swap), maps ``F``
read-only and reads one byte of a random 4 KiB page of it, in a loop, for ``seconds``. Started in
a group whose limit is below anon + file, every read misses the page cache it just lost to the
previous ones: real memory-PSI stalls, major faults and refaults -- in the neighbour's group and,
because the host's /proc/pressure/memory counts memcg stalls too, on the host -- while the
service's group stays calm (measured on a 2-core host: 100 MiB anon + random 4 KiB reads over a
100 MiB mmap under a 150 MiB limit gave 10-23 % PSI some).

It must run inside a limited cgroup (the scenario runner spawns it with ``MemoryGroup.spawn``);
it refuses to start when its own memory cgroup has no limit.
"""

from __future__ import annotations

import argparse
import mmap
import random
import sys
import time
from pathlib import Path

PAGE = 4096


def own_limit_bytes() -> int | None:
    """The v1 memory limit of this process's group (None: unlimited or unknown)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            try:
                value = int(Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.limit_in_bytes").read_text())
            except (OSError, ValueError):
                return None
            return value if value < 1 << 60 else None
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--anon-mib", type=int, required=True)
    ap.add_argument("--file", required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if own_limit_bytes() is None:
        print("hog: refusing to run outside a memory cgroup with a limit", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    anon = bytearray(b"\xa5") * (args.anon_mib << 20)  # written: resident, unreclaimable without swap
    with open(args.file, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    pages = len(m) // PAGE
    deadline = time.monotonic() + args.seconds
    reads = 0
    total = 0
    while time.monotonic() < deadline:
        for _ in range(256):
            total += m[rng.randrange(pages) * PAGE]
        reads += 256
        anon[rng.randrange(len(anon))] = total & 0xFF  # keep the anon pages in use too
    print(f"hog: {reads} random page reads in {args.seconds:g} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
