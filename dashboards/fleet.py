"""The fleet overview: which hosts are sick, and why, across every agent one Prometheus scrapes.

Read from the fleet recording rules (``alerts.fleet_names``: one series per host, evaluated once a minute)
rather than from the raw families, so the page stays cheap with hundreds of hosts; the raw overflow gauge
(``llmdiag_series_folded``) is the one exception, already one series per host and kind. Every selector keeps
the job and instance variables, so the same page narrows to one rack or one host.
"""

from __future__ import annotations

from alerts import fleet_names as fleet
from dashboards.promql import q, sel
from dashboards.spec import Dashboard, Row, Variable, stat, ts

UID = "llmdiag-fleet"
RANKED = 10  # hosts drawn in a ranking panel: the worst ten, whatever the fleet's size


def fleet_dashboard(variables: tuple[Variable, ...]) -> Dashboard:
    psi = sel(fleet.WORST_MEMORY_STALL)
    incidents = sel(fleet.INCIDENT_1H)
    kills = sel(fleet.OOM_KILLS_1H)
    series = sel(fleet.AGENT_SERIES)
    sick = Row("Which hosts are sick", (
        stat("Hosts stalling on memory", "Hosts whose worst memory PSI 'full' over 5 min (the host's own or any "
             f"watched group's, {fleet.WORST_MEMORY_STALL}) is at least 5 %: the level at which `diag analyze` "
             "calls it thrashing. Open Memory & pressure for those hosts.", "short",
             q(f"count({psi} >= 0.05) or vector(0)")),
        stat("Hosts with an incident in the last hour", f"Hosts whose live diagnosis concluded any incident class "
             f"in the last hour ({fleet.INCIDENT_1H}). Which class: the panel beside; the evidence: `diag analyze "
             "--prometheus URL --fleet ...` or the host's own `diag analyze`.", "short",
             q(f"count(max by (job, instance) ({incidents}) == 1) or vector(0)")),
        stat("OOM kills in the last hour", f"Kernel OOM kills over the last hour, all hosts ({fleet.OOM_KILLS_1H}: "
             "the kernel log's count, or the largest watched group's where the agent cannot read /dev/kmsg).",
             "short", q(f"sum({kills})")),
        stat("Agent series, largest host", f"Series in the largest agent's last scrape ({fleet.AGENT_SERIES}). "
             "It is bounded by --max-processes and --max-cgroups (README: Series per host): a host near its bound "
             "folds processes into pid=\"other\".", "short", q(f"max({series})")),
        ts("Worst memory PSI by host", f"The {RANKED} hosts stalling most on memory ({fleet.WORST_MEMORY_STALL}: "
           "rate of PSI 'full', the host's or its worst group's). Above 5 % sustained is thrashing: lower concurrency "
           "or memory per request there, or move a neighbour away.", "percentunit",
           q(f"topk({RANKED}, {psi})", legend="{{instance}}"), w=16),
    ))  # fmt: skip
    why = Row("Why: incidents and OOM kills", (
        ts("Incident classes in the last hour", f"How many hosts concluded each incident class at some time in "
           f"the last hour ({fleet.INCIDENT_1H}, summed by class). One class on many hosts at once is a fleet "
           "problem (a deploy, a model change); one host alone is that host's.", "short",
           q(f"sum by (class) ({incidents})", legend="{{class}}")),
        ts("Who is OOM-killing", f"The {RANKED} hosts with the most OOM kills over the last hour "
           f"({fleet.OOM_KILLS_1H}). A host that keeps killing needs a larger limit or fewer copies of the model: "
           "Memory & pressure shows which group and which process grew.", "short",
           q(f"topk({RANKED}, {kills})", legend="{{instance}}")),
    ))  # fmt: skip
    cost = Row("What the fleet costs Prometheus", (
        ts("Series per agent", f"Series in each agent's last scrape ({fleet.AGENT_SERIES}, from Prometheus' own "
           "scrape_samples_scraped). Flat per host by design; a step up is a new GPU, cgroup or model file.",
           "short", q(f"topk({RANKED}, {series})", legend="{{instance}}")),
        ts("Label values folded into 'other'", "llmdiag_series_folded by kind: processes and cgroups beyond the "
           "agent's cap, summed into one pid=\"other\" / cgroup=\"other\" series. Often non-zero on a host: raise "
           "--max-processes / --max-cgroups there, or accept the fold (the flight recorder keeps them all).",
           "short", q(f"max by (instance, kind) ({sel('llmdiag_series_folded')})", legend="{{kind}} {{instance}}")),
    ))  # fmt: skip
    return Dashboard(UID, "llm-diag / Fleet overview", "Which hosts are sick, and why, across the fleet?",
                     (sick, why, cost), variables)  # fmt: skip
