"""Duplicate model copies that hold no file: sibling workers with large, similar private memory.

What ``torch.load`` and most preload-per-worker code do is read the checkpoint into private memory
and close it; no process then maps or holds a model file, and ``placement.duplicate_models`` has
nothing to group on. The copies still show: several siblings -- same parent or the same command
line -- each with a large private (USS) footprint of about the same size, and, when the tracker's
loader ran, each of them loading about the same number of bytes.

Thresholds (also in the README):
- a sibling group is >= ``MIN_SIBLINGS`` (2) processes of the service sharing a parent (other than
  PID 0/1, which parents everything in a container or on a host) or an identical command line;
- each member's private memory (median USS) is >= ``MIN_PRIVATE_BYTES`` (48 MiB) and >= ``PRIVATE_SHARE``
  (50 %) of its RSS -- a forked worker sharing a preloaded model has a small USS and does not count;
- the members are similar: smallest / largest private >= ``SIMILAR_RATIO`` (0.75);
- the extra copies ((n - 1) x the smallest) cost >= ``MATERIAL_WASTE_OF_LIMIT`` (5 %) of the limit;
- the members were alive at the same instant (workers restarted one after another are not copies);
- loader records corroborate when >= 2 of the members each loaded >= ``MIN_PRIVATE_BYTES`` of
  similar size (same ratio); loads alone count only for processes whose USS was never measured, and make
  only a suspect (0.4).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from diag.rules import numstats, stats
from diag.rules.base import Evidence, Finding, TooLittleData, rule
from diag.rules.context import AnalysisContext
from diag.timeline import ProcessTrack, Timeline
from diag.units import format_bytes

MIN_SIBLINGS = 2
MIN_PRIVATE_BYTES = 48 * (1 << 20)
PRIVATE_SHARE = 0.5
SIMILAR_RATIO = 0.75
MATERIAL_WASTE_OF_LIMIT = 0.05
BIG_WASTE_OF_LIMIT = 0.25  # extra copies taking a quarter of the limit add confidence
UNIVERSAL_PARENTS = (0, 1)


@dataclass
class Member:
    track: ProcessTrack
    private: float  # median USS over the window, bytes
    rss: float
    loaded: float  # bytes this process loaded per the tracker's loader records (0 when none)


def _median(track: ProcessTrack, name: str) -> float:
    s = track.series.get(name)
    v = s.valid().values if s is not None else np.empty(0)
    return float(numstats.median(v)) if v.size else math.nan


def _loaded_by_pid(tl: Timeline) -> dict[int, float]:
    """Largest single load per pid from the loader records (a refresh re-reads; the copy is one load)."""
    t = tl.loader
    if not len(t) or "pid" not in t or "bytes_read" not in t:
        return {}
    out: dict[int, float] = {}
    for pid, read in zip(t["pid"], t["bytes_read"], strict=True):
        if np.isfinite(pid) and np.isfinite(read):
            out[int(pid)] = max(out.get(int(pid), 0.0), float(read))
    return out


def _groups(tracks: list[ProcessTrack]) -> list[tuple[str, list[ProcessTrack]]]:
    """Sibling groups by parent and by command line (a group found both ways is kept once)."""
    by_parent: dict[int, list[ProcessTrack]] = defaultdict(list)
    by_cmd: dict[str, list[ProcessTrack]] = defaultdict(list)
    for t in tracks:
        if t.ppid is not None and t.ppid not in UNIVERSAL_PARENTS:
            by_parent[t.ppid].append(t)
        if t.cmdline:
            by_cmd[t.cmdline].append(t)
    out: list[tuple[str, list[ProcessTrack]]] = []
    seen: set[frozenset[str]] = set()
    for how, members in [*((f"children of pid {p}", m) for p, m in by_parent.items()),
                         *((f"command line {c[:60]!r}", m) for c, m in by_cmd.items())]:  # fmt: skip
        key = frozenset(t.key for t in members)
        if len(members) >= MIN_SIBLINGS and key not in seen:
            seen.add(key)
            out.append((how, members))
    return out


def _together(members: list[Member]) -> list[Member]:
    """The largest subset sampled alive at one instant: workers restarted one after another are not copies at once."""
    stamps = [m.track.series["rss"].valid().ts for m in members if "rss" in m.track.series]
    if not stamps:
        return []
    all_ts, counts = np.unique(np.concatenate(stamps), return_counts=True)
    when = all_ts[int(np.argmax(counts))]
    return [m for m in members if "rss" in m.track.series and np.isin(when, m.track.series["rss"].ts)]


def _copies(members: list[Member]) -> list[Member]:
    """The members alive together that each hold a large private copy of about the same size (the largest such set)."""
    big = [m for m in members if m.private >= MIN_PRIVATE_BYTES and m.private >= PRIVATE_SHARE * m.rss]
    big = _together(big)
    big.sort(key=lambda m: m.private, reverse=True)
    best: list[Member] = []
    for i in range(len(big)):  # the largest run whose smallest is within SIMILAR_RATIO of its largest
        run = [m for m in big[i:] if m.private >= SIMILAR_RATIO * big[i].private]
        if len(run) > len(best):
            best = run
    return best


@rule("private_copies.duplicate_models", "duplicate_model_processes", needs_any=("process:uss", "loader"))
def duplicate_private_copies(tl: Timeline, ac: AnalysisContext | None = None) -> Finding | TooLittleData | None:
    """Sibling processes each holding a large, similar private copy (no model file needed), or loading one."""
    scope = stats.service_scope(tl, ac)
    tracks = scope.tracks if scope.known else list(tl.processes.values())
    loaded = _loaded_by_pid(tl)
    best: tuple[str, list[Member]] | None = None
    for how, group in _groups(tracks):
        members = [Member(t, _median(t, "uss"), _median(t, "rss"), loaded.get(t.pid, 0.0)) for t in group]
        copies = _copies([m for m in members if math.isfinite(m.private) and math.isfinite(m.rss)])
        if len(copies) >= MIN_SIBLINGS and (best is None or len(copies) > len(best[1])):
            best = (how, copies)
    uss = {t.pid: _median(t, "uss") for t in tl.processes.values()}
    # Loads alone are the fallback for processes whose private memory was never measured: where USS is known, the
    # sibling test above has judged it (a load into a shared mapping leaves a small USS and is no copy).
    by_load = sorted(
        ((pid, b) for pid, b in loaded.items() if b >= MIN_PRIVATE_BYTES and not math.isfinite(uss.get(pid, math.nan))),
        key=lambda x: -x[1],
    )
    load_copies = [x for x in by_load if by_load and x[1] >= SIMILAR_RATIO * by_load[0][1]]
    if best is None and len(load_copies) < MIN_SIBLINGS:
        return None
    group_cgroup = scope.cgroups[0] if scope.cgroups else None
    limit, limit_source = stats.limit_for(tl, group_cgroup)
    evidence: list[Evidence] = []
    if best is not None:
        how, copies = best
        smallest = min(m.private for m in copies)
        waste = (len(copies) - 1) * smallest
        if limit and waste < MATERIAL_WASTE_OF_LIMIT * limit:
            return None
        for m in copies:
            t = m.track
            s = t.series["uss"].valid()
            evidence.append(
                Evidence(
                    f"process {t.pid} ({t.comm or '?'}) private memory (USS, median)",
                    round(m.private),
                    "bytes",
                    float(s.ts[0]) if len(s) else None,
                    float(s.ts[-1]) if len(s) else None,
                )
            )
        evidence.append(Evidence("siblings", f"{len(copies)} processes, {how}", ""))
        evidence.append(Evidence("extra copies beyond one", round(waste), "bytes"))
        corroborated = sum(1 for m in copies if m.loaded >= SIMILAR_RATIO * smallest)
        if corroborated:
            evidence.append(Evidence("of them, loaded about a copy each (loader records)", corroborated, "processes"))
        conf = 0.6 + (0.1 if corroborated >= MIN_SIBLINGS else 0.0)
        conf += 0.1 if limit and waste >= BIG_WASTE_OF_LIMIT * limit else 0.0
        n, each = len(copies), format_bytes(smallest)
        pids = ", ".join(str(m.track.pid) for m in copies[:6])
        summary = f"{n} sibling processes ({pids}) each hold >= {each} of private memory: {n} copies of the model"
        start = min(e.start for e in evidence if e.start is not None) if any(e.start for e in evidence) else None
        end = max(e.end for e in evidence if e.end is not None) if any(e.end for e in evidence) else None
    else:
        waste = sum(b for _, b in load_copies[1:])
        if limit and waste < MATERIAL_WASTE_OF_LIMIT * limit:
            return None
        for pid, b in load_copies:
            evidence.append(Evidence(f"process {pid} loaded (loader records)", round(b), "bytes"))
        conf = 0.4  # loads alone: the bytes may have gone into a shared mapping
        n = len(load_copies)
        summary = f"{n} processes each loaded ~{format_bytes(load_copies[-1][1])} of weights: possibly {n} private copies"
        start = end = None
    if limit:
        evidence.append(Evidence(f"limit ({limit_source})", round(limit), "bytes"))
    return Finding(
        cls="duplicate_model_processes",
        rule="private_copies.duplicate_models",
        confidence=min(conf, 0.85),
        summary=summary,
        evidence=evidence,
        rules_out=["not one shared copy: each process's private (unshared) memory is about a model's size"]
        if best is not None
        else [],
        remediation=[
            "load the weights once in the parent and fork the workers (copy-on-write), or mmap the file (safetensors)",
            "run fewer workers with more threads or a batching server instead of one copy per worker",
        ],
        start=start,
        end=end,
    )
