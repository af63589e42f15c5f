"""The fleet recording rules (names in ``alerts.fleet_names``) and their promtool unit tests.

Why these four: the fleet overview answers "which hosts, and why" at a glance -- the host stalling most on
memory, the incident classes concluded in the last hour, who is OOM-killing, and how many series each agent
costs the Prometheus (the bound the agent's --max-processes / --max-cgroups keep). Every rule keeps ``job``
and ``instance`` (one series per host, or per host and class), so a fleet of N hosts records about 3 N series.
"""

from __future__ import annotations

from typing import Any

from alerts import fleet_names as fleet
from collectors import catalog as cat

BY = "job, instance"


def _tagged(expr: str, source: str) -> str:
    """``expr`` with a ``source`` label: two sources of one host stay two series until ``max by`` picks one."""
    return f'label_replace({expr}, "source", "{source}", "", "")'


WORST_MEMORY_STALL_EXPR = (
    f"max by ({BY}) (\n  rate({cat.HOST_PSI_STALLED['memory'].name}[5m])\n  or\n  rate({cat.CGROUP_PSI_STALLED.name}[5m])\n)"
)
INCIDENT_EXPR = f"max by ({BY}, class) (max_over_time({cat.INCIDENT.name}[1h]))"
# The kernel log's count (llmdiag_oom_kills_total); where the agent cannot read /dev/kmsg it stays 0, so the
# largest hierarchical oom_kill count of one watched group stands in (the largest, not the sum: watched groups
# may nest, and a parent's count includes its children's).
_KMSG_KILLS = f"sum by ({BY}) (increase({cat.OOM_KILLS.name}[1h]))"
_GROUP_KILLS = f'max by ({BY}) (increase({cat.CGROUP_EVENTS.name}{{event="oom_kill", scope="hierarchical"}}[1h]))'
OOM_KILLS_EXPR = f"max by ({BY}) (\n  {_tagged(_KMSG_KILLS, 'kmsg')}\n  or\n  {_tagged(_GROUP_KILLS, 'cgroup')}\n)"
# Only the agents' targets: the engine's own /metrics (vLLM's hundreds of series) is not the agent's cost.
AGENT_SERIES_EXPR = f"max by ({BY}) ({cat.PROMETHEUS_SCRAPED.name})\nand on ({BY})\n{cat.AGENT_SAMPLE_DURATION.name}"

RULES: tuple[tuple[str, str], ...] = (
    (fleet.WORST_MEMORY_STALL, WORST_MEMORY_STALL_EXPR),
    (fleet.INCIDENT_1H, INCIDENT_EXPR),
    (fleet.OOM_KILLS_1H, OOM_KILLS_EXPR),
    (fleet.AGENT_SERIES, AGENT_SERIES_EXPR),
)


def fleet_rule_groups() -> list[dict[str, Any]]:
    return [{"name": fleet.GROUP, "rules": [{"record": name, "expr": expr} for name, expr in RULES]}]


# --------------------------------------------------------------------------- promtool unit tests

_A = 'job="llm-diag-host", instance="host-a:9464"'
_B = 'job="llm-diag-host", instance="host-b:9464"'
_ENGINE = 'job="vllm", instance="host-a:8000"'
_OUT_A = {"job": "llm-diag-host", "instance": "host-a:9464"}
_OUT_B = {"job": "llm-diag-host", "instance": "host-b:9464"}


def _series(name: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f"{name}{{{labels}}}", "values": values}


def fleet_tests() -> dict[str, Any]:
    """Two hosts over 80 minutes, one a's group stalling more than a's host, b without kernel-log access."""
    host_stall, group_stall = cat.HOST_PSI_STALLED["memory"].name, cat.CGROUP_PSI_STALLED.name
    events = cat.CGROUP_EVENTS.name
    series = [
        # a: host stalled 0.3 s/s, its service's group 0.5 s/s -> 0.5; b: host 0.1 s/s, no group -> 0.1
        _series(host_stall, _A, "0+18x80"),
        _series(group_stall, f'{_A}, cgroup="/system.slice/llm.service"', "0+30x80"),
        _series(host_stall, _B, "0+6x80"),
        # a: 1 kill a minute in the kernel log, its group saw half; b: kernel log unreadable (0), its group 30 an hour
        _series(cat.OOM_KILLS.name, f'{_A}, constraint="CONSTRAINT_MEMCG"', "0+1x80"),
        _series(cat.OOM_KILLS.name, f'{_A}, constraint="CONSTRAINT_NONE"', "0x80"),
        _series(events, f'{_A}, cgroup="/system.slice/llm.service", event="oom_kill", scope="hierarchical"', "0+0.5x80"),
        _series(cat.OOM_KILLS.name, f'{_B}, constraint="CONSTRAINT_MEMCG"', "0x80"),
        _series(events, f'{_B}, cgroup="/llm", event="oom_kill", scope="hierarchical"', "0+0.5x80"),
        _series(events, f'{_B}, cgroup="/llm", event="oom_kill", scope="local"', "0+5x80"),  # local: not read
        # a: queue_backlog for the first 30 min (still within the hour at 70m); thrashing only in the first 5 min
        _series(cat.INCIDENT.name, f'{_A}, class="queue_backlog"', "1x30 0x50"),
        _series(cat.INCIDENT.name, f'{_A}, class="thrashing"', "1x5 0x75"),
        _series(cat.INCIDENT.name, f'{_B}, class="memory_leak"', "0x80"),
        # the agents' scrapes and an engine's: only the agents count
        _series(cat.PROMETHEUS_SCRAPED.name, _A, "240x80"),
        _series(cat.PROMETHEUS_SCRAPED.name, _B, "180x80"),
        _series(cat.PROMETHEUS_SCRAPED.name, _ENGINE, "5000x80"),
        _series(cat.AGENT_SAMPLE_DURATION.name, _A, "0.02x80"),
        _series(cat.AGENT_SAMPLE_DURATION.name, _B, "0.02x80"),
    ]
    at = "70m"

    def expect(expr: str, *samples: tuple[dict[str, str], float]) -> dict[str, Any]:
        return {"expr": expr, "eval_time": at, "exp_samples": [
            {"labels": _labels(expr, lbl), "value": value} for lbl, value in samples]}  # fmt: skip

    checks = [
        expect(fleet.WORST_MEMORY_STALL, (_OUT_A, 0.5), (_OUT_B, 0.1)),
        expect(
            fleet.INCIDENT_1H,
            ({**_OUT_A, "class": "queue_backlog"}, 1),
            ({**_OUT_A, "class": "thrashing"}, 0),
            ({**_OUT_B, "class": "memory_leak"}, 0),
        ),
        expect(fleet.OOM_KILLS_1H, (_OUT_A, 60), (_OUT_B, 30)),
        expect(fleet.AGENT_SERIES, (_OUT_A, 240), (_OUT_B, 180)),
    ]
    return {
        "rule_files": [f"../{fleet.RULE_FILE}"],
        "evaluation_interval": "1m",
        "tests": [{"name": "fleet rules: worst PSI, incidents in the hour, OOM kills, agent series", "interval": "1m",
                   "input_series": series, "promql_expr_test": checks}],
    }  # fmt: skip


def _labels(name: str, labels: dict[str, str]) -> str:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}}"
