"""The fleet recording rules' names: the contract ``alerts.fleet_rules`` writes and the fleet dashboard reads.

Why recorded and not computed in the dashboard: the fleet overview ranks every host at once, and its panels
would each re-read an hour of every host's series on every refresh; a rule evaluates it once a minute into one
series per host. Each keeps ``job`` and ``instance``, so the dashboard's target variables still apply.

This module imports nothing: ``alerts`` (which writes the rules) and ``dashboards`` (which queries them) both read it.
"""

from __future__ import annotations

GROUP = "llmdiag-fleet"
RULE_FILE = "fleet.rules.yaml"

# The worst memory PSI "full" of a host over 5 min: its own, or any watched group's (a share of time, 0-1).
WORST_MEMORY_STALL = "llmdiag:fleet_memory_stalled_worst:rate5m"
# 1 for each incident class the host's live diagnosis concluded at any time in the last hour (label ``class``).
INCIDENT_1H = "llmdiag:fleet_incident:max1h"
# Kernel OOM kills of the host over the last hour.
OOM_KILLS_1H = "llmdiag:fleet_oom_kills:increase1h"
# Series in the agent's last scrape (Prometheus' scrape_samples_scraped, for the agent's targets only).
AGENT_SERIES = "llmdiag:fleet_agent_series:count"

NAMES: frozenset[str] = frozenset({WORST_MEMORY_STALL, INCIDENT_1H, OOM_KILLS_1H, AGENT_SERIES})
