"""Which process and cgroup label values the agent exports, so the series per host stay bounded.

Why a cap on /metrics and not on sampling: the rules need every model holder and watched group in the flight
recorder, but a Prometheus of 200 hosts pays for every label value on every host. A host with 64 workers each
mapping the model would otherwise export 64 x the per-process families; with the cap it exports at most ``cap``
labelled copies plus one overflow series (``pid="other"``, ``cgroup="other"``) holding the rest's total.

Which ones are kept is stable: the largest by memory, with hysteresis -- a label value kept at the last sample
is ranked as if it were ``1 + margin`` times its size, so a newcomer displaces it only when clearly larger.
Two workers of about the same size therefore do not swap places (and churn series) at every scrape. Operator-
named targets (``--pid``, ``--cgroup``) rank before everything else.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

DEFAULT_MAX_PROCESSES = 30  # the sampler's default top 10 by RSS plus room for a service's workers
DEFAULT_MAX_CGROUPS = 10  # named groups and the model holders' groups: a few on an inference host
HYSTERESIS_MARGIN = 0.25  # a newcomer must be 25 % larger than a kept one to take its place
OVERFLOW = "other"  # the label value of the overflow series (never a pid or a cgroup path)


@dataclass(frozen=True)
class SeriesCaps:
    """How many process and cgroup label values /metrics carries (each beyond: folded into ``other``)."""

    max_processes: int = DEFAULT_MAX_PROCESSES
    max_cgroups: int = DEFAULT_MAX_CGROUPS
    margin: float = HYSTERESIS_MARGIN

    def __post_init__(self) -> None:
        if self.max_processes < 1 or self.max_cgroups < 1:
            raise ValueError("series caps must be at least 1 (the overflow series holds the rest)")
        if self.margin < 0:
            raise ValueError("the hysteresis margin cannot be negative")


def choose(sizes: Mapping[K, float], kept_before: Iterable[K], cap: int, margin: float, pinned: Iterable[K] = ()) -> set[K]:
    """The at most ``cap`` keys to export: pinned first, then by size (kept ones boosted by ``margin``).

    Ties are broken by the key's text so the choice is the same whatever the order the sampler listed them in.
    """
    if len(sizes) <= cap:
        return set(sizes)
    before = set(kept_before)
    pin = set(pinned)

    def rank(key: K) -> tuple[int, float, str]:
        size = sizes[key] * (1.0 + margin) if key in before else sizes[key]
        return (0 if key in pin else 1, -size, str(key))

    return set(sorted(sizes, key=rank)[:cap])


class FoldedCounters:
    """Monotonic totals for the overflow series of counters whose members change.

    Why not the plain sum of the folded members' counters: a member leaving the overflow (kept now, or exited)
    would make that sum drop, and Prometheus reads a drop as a counter reset -- rate() would jump. Instead each
    overflow total grows by what its members' counters grew since the previous sample while folded; a member
    first seen folded adds nothing until its second sample.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[Hashable, Hashable], float] = {}
        self.totals: dict[Hashable, float] = {}  # only families some folded member has had: no invented zeros

    def observe(self, values: Mapping[tuple[Hashable, Hashable], float], folded: set[Hashable]) -> None:
        """``values``: (family, member) -> the member's counter now, for every member present."""
        for (fam, member), value in values.items():
            if member in folded:
                self.totals.setdefault(fam, 0.0)
                last = self._last.get((fam, member))
                if last is not None and value >= last:
                    self.totals[fam] += value - last
        self._last = dict(values)  # members gone are forgotten: a pid reused later starts afresh
