"""Which finding gives way to which: the one table of precedence between rules, applied by the engine.

Why a table: a rule judges its own evidence and nothing else -- no rule calls another. But two rules
can describe one incident from two sides, and the person on call must be pointed at the one to act
on: memory pressure that ended in an OOM kill is an OOM incident (the pressure is how it got there);
pressure whose stalls come with page-ins is thrashing (pressure is the broader, weaker class). Kept
inside the rules, such precedence was invisible from outside and made rules run each other. Here it
is one list, read top to bottom, applied by ``engine.analyze`` after every rule has run once.

Each entry names the rule whose finding gives way (``rule``), the rule it gives way to
(``yields_to``), from which confidence of the other finding on it counts (``firm_at``), and how far it
steps down:

- ``Ceiling(at)``: capped at ``at`` while the other stands, and a note pointing at the other finding
  is added to its summary (also when it was already under the cap: the reader still learns where to
  look);
- ``JustUnder(margin)``: only when it would rank at or above the other, it is set ``margin`` under
  it, with the note; it keeps ``firm_at - margin`` or more (0.55 for the OOM entry), so a finding
  that was firm stays a contributing one instead of disappearing.

A finding steps down for one class at most once: a rule whose *own* evidence already made it give
way to a class (``Finding.yielded_to``) is not capped or noted again for it.

What is not in the table, on purpose:

- ceilings that describe a rule's own evidence stay in the rule: a leak seen only in a process not
  known to be the service (0.6), thrashing-level stalls in pressure's own look at its group (0.45),
  a token budget that holds, a backlog whose wait is the loader's, a neighbour's pressure while the
  service stalls too -- each is what that rule's evidence is worth, whatever other rules say;
- which test applies to which data: the stall-only thrashing rule and the aggregated queue-vs-thrash
  rule stand aside when the window holds enough request rows for the per-request test, whatever that
  test finds -- a question of data, not of another rule's finding;
- leak vs pressure: both rules read one assessment of the service's memory, and troughs that rise
  regardless of load are the leak's definition and the opposite of pressure's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from diag.rules.base import Finding


@dataclass(frozen=True)
class Ceiling:
    """Capped at ``at`` while the other finding stands."""

    at: float

    def step(self, mine: float, theirs: float) -> float | None:
        return min(mine, self.at)

    def describe(self) -> str:
        return f"capped at {self.at:g}"


@dataclass(frozen=True)
class JustUnder:
    """Set ``margin`` under the other finding when it would rank at or above it; left alone otherwise (None)."""

    margin: float

    def step(self, mine: float, theirs: float) -> float | None:
        return theirs - self.margin if mine >= theirs else None

    def describe(self) -> str:
        return f"just under it ({self.margin:g} below) when it would outrank it"


@dataclass(frozen=True)
class Precedence:
    rule: str  # the rule whose finding gives way
    yields_to: str  # the rule it gives way to
    firm_at: float  # the other finding's confidence from which this entry applies
    step: Ceiling | JustUnder
    note: str  # appended to the yielding finding's summary when the entry applies
    why: str  # the reason, for the reader of this table and of the architecture document

    def describe(self) -> str:
        return f"{self.rule} gives way to {self.yields_to} (from {self.firm_at:g}): {self.step.describe()}"


STALL_THRASHING_FIRM = 0.6  # the stall-only rule's confidence once page-ins back its stalls (0.65+; 0.35-0.4 without)
PRESSURE_UNDER_THRASHING = 0.45  # a suspect at most: the specific class names the incident
OOM_KILL_FIRM = 0.6  # the OOM rule's confidence once the kill is the service's own (0.7-0.85; someone else's: 0.25-0.55)
UNDER_THE_KILL = 0.05  # pressure ranks this far under the kill: 0.55 or more, still contributing
KV_FIRM = 0.75  # the KV rule's confidence once latency rises with the cache full and preempting
BACKLOG_UNDER_KV = 0.45  # a suspect at most: the wait is for KV blocks, not for slots
CUDA_OOM_FIRM = 0.6  # the GPU OOM rule's confidence for a really full device
UNDER_THE_CUDA_OOM = 0.05

CONFIG_OVER_FIRM = 0.7  # the config rule's confidence once its arithmetic is over the limit and memory got there (0.6 alone)
UNDER_THE_CONFIG = 0.05

BACKLOG_FIRM = 0.55  # every backlog rule's confidence once the service time stayed flat or the wait dwarfs it (0.4: a symptom)
UNDER_THE_BACKLOG = 0.05
_NEIGHBOUR_UNDER_BACKLOG_WHY = (
    "a neighbour's host pressure that did not stall the service (the neighbour rule's own condition) and a firm backlog "
    "(service time flat, or the wait many times it) describe one window from two sides: the requests wait because the "
    "slots are too few, not because the neighbour slowed the service, so the backlog is what to act on and the "
    "neighbour stays contributing just under it; a backlog that is partly a symptom (0.4) changes nothing"
)
_NEIGHBOUR_NOTE = "requests wait for too few slots while the service's own speed held: see the queue-backlog finding"

PRECEDENCE: tuple[Precedence, ...] = (
    Precedence(
        rule="memory.pressure",
        yields_to="stalls.thrashing",
        firm_at=STALL_THRASHING_FIRM,
        step=Ceiling(PRESSURE_UNDER_THRASHING),
        note="sustained full stalls with page-ins (refaults, faults or swap): see the thrashing finding",
        why=(
            "pressure is the broader, weaker class: when the stall-only rule finds sustained full stalls with page-ins "
            "-- often refaults of evicted page cache, which pressure's own look at major faults misses -- the verdict "
            "names the specific class; stalls without page-ins are reclaim, not thrashing, and leave pressure as it is"
        ),
    ),
    Precedence(
        rule="memory.pressure",
        yields_to="oom.host",
        firm_at=OOM_KILL_FIRM,
        step=JustUnder(UNDER_THE_KILL),
        note="the kernel OOM-killed in this window: see the OOM finding (pressure is how it got there)",
        why=(
            "pressure that ended in an OOM kill of the service's own is an OOM incident to the person on call: the kill "
            "is what they must act on, the pressure how it got there, so it stays contributing just under the kill; "
            "a kill the OOM rule could not tie to the service changes nothing"
        ),
    ),
    Precedence(
        rule="requests.queue_backlog",
        yields_to="kv_cache.saturation",
        firm_at=KV_FIRM,
        step=Ceiling(BACKLOG_UNDER_KV),
        note="the KV cache is full and the engine preempts: the wait is for KV blocks, see the KV-cache finding",
        why=(
            "requests also wait when the KV cache is full, but the fixes are opposite: a backlog wants more slots, a "
            "full cache fewer sequences (more slots compete for the same blocks); with the cache at its ceiling and "
            "preempting, the verdict names the cache"
        ),
    ),
    Precedence(
        rule="aggregated.queue_vs_thrash",
        yields_to="kv_cache.saturation",
        firm_at=KV_FIRM,
        step=Ceiling(BACKLOG_UNDER_KV),
        note="the KV cache is full and the engine preempts: the wait is for KV blocks, see the KV-cache finding",
        why="the same as for the per-request backlog, on aggregated histograms (the Prometheus and --scrape paths)",
    ),
    Precedence(
        rule="aggregated.queue_from_gauges",
        yields_to="kv_cache.saturation",
        firm_at=KV_FIRM,
        step=Ceiling(BACKLOG_UNDER_KV),
        note="the KV cache is full and the engine preempts: the wait is for KV blocks, see the KV-cache finding",
        why="the same as for the per-request backlog, on the engine's waiting and running gauges (no latency histograms)",
    ),
    *(
        Precedence(
            rule="placement.noisy_neighbour",
            yields_to=backlog,
            firm_at=BACKLOG_FIRM,
            step=JustUnder(UNDER_THE_BACKLOG),
            note=_NEIGHBOUR_NOTE,
            why=_NEIGHBOUR_UNDER_BACKLOG_WHY,
        )
        for backlog in ("requests.queue_backlog", "aggregated.queue_vs_thrash", "aggregated.queue_from_gauges")
    ),
    Precedence(
        rule="oom.host",
        yields_to="config.unsafe",
        firm_at=CONFIG_OVER_FIRM,
        step=JustUnder(UNDER_THE_CONFIG),
        note="the configuration alone does not fit the limit: see the unsafe-configuration finding (the kill is how it showed)",
        why=(
            "a kill the configuration's own arithmetic predicts -- its settings need more than the limit, and memory got "
            "there -- is explained by the settings: changing them is what stops the kills, so the kill stays contributing "
            "just under it; settings that are only risky (below 0.5) or over the limit on paper alone (0.6) change nothing"
        ),
    ),
    Precedence(
        rule="kv_cache.saturation",
        yields_to="oom.gpu",
        firm_at=CUDA_OOM_FIRM,
        step=JustUnder(UNDER_THE_CUDA_OOM),
        note="CUDA allocations failed in this window: see the GPU OOM finding (a full cache is how it got there)",
        why=(
            "a full KV cache is the engine managing a fixed budget; a CUDA OOM is an allocation that failed -- requests "
            "lost now, which the person on call must act on first"
        ),
    ),
)


def apply_precedence(findings: Mapping[str, Finding], table: Iterable[Precedence] = PRECEDENCE) -> list[str]:
    """Step the findings (by rule id) down as the table says, in its order; what applied, described.

    Mutates the yielding findings (confidence, summary, ``yielded_to``); the engine calls this once per
    analysis, after every rule ran and before ranking.
    """
    applied = []
    for entry in table:
        mine, theirs = findings.get(entry.rule), findings.get(entry.yields_to)
        if mine is None or theirs is None or theirs.confidence < entry.firm_at or theirs.cls in mine.yielded_to:
            continue
        stepped = entry.step.step(mine.confidence, theirs.confidence)
        if stepped is None:
            continue
        mine.confidence = max(0.0, min(1.0, stepped))
        mine.summary = f"{mine.summary}; {entry.note}"
        mine.yielded_to.add(theirs.cls)
        applied.append(entry.describe())
    return applied
