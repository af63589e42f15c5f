"""The ``unsafe-config`` scenario: a service whose configuration makes an incident likely, before it happens.

What is injected is a configuration, not a fault: two workers, 128 inference slots each, an
unbounded queue with no queue or request timeout, no memory guard and no prompt cap, under a memory
limit that the *observed* load stays well inside. The load varies the number of requests in flight
(1 to 6, prompts of a few hundred tokens) so the memory each in-flight request costs can be measured from the
recording -- and that per-request cost times 2 workers x 128 slots lands far over the limit. Nothing
goes wrong during the run (no OOM, no pressure, no queueing): the incident is the arithmetic, which
is exactly what ``unsafe_config`` is for.

Registered into the library's ``SCENARIOS`` when the library is imported (it imports this module).
"""

from __future__ import annotations

from typing import Any

from diag.demo.scenarios.context import MiB, ScenarioContext
from diag.demo.scenarios.load import Phase, completion, idle
from diag.demo.scenarios.registry import scenario


@scenario(
    "unsafe-config",
    "unsafe_config",
    "2 workers x 128 slots, unbounded queue, no timeouts/guard/prompt cap: light load fits, full configured load cannot",
    needs_cgroups=True,
    limit_mib=320,
    workers=2,
    slots=128,
    weights_mb=64,
    prompt_tokens=300,
    levels="1,3,6,2,5,1,4,6,2,3,5,1",
    step_s=6.0,
)
def unsafe_config(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: a config record with max_concurrency 128 x 2 workers, queue unbounded, timeouts, guard and
    prompt cap off; group memory rising and falling with requests in flight (a few MiB per request),
    its peak well under the limit; no OOM kill, no memory PSI to speak of, no queue wait."""
    group = ctx.group("service", p["limit_mib"] * MiB)
    assert group is not None
    slots = str(p["slots"])
    args = [
        "--preload", "shared", "--max-concurrency", slots, "--queue-size", "-1", "--queue-timeout", "0",
        "--request-timeout", "0", "--memory-guard", "0", "--max-prompt-tokens", "0",
        "--max-batch-requests", slots, "--max-batch-tokens", "65536",
    ]  # fmt: skip
    server = ctx.serve(args, group=group, workers=p["workers"], weights_mb=p["weights_mb"])
    ctx.record()
    ctx.pause(3, "baseline")
    n = p["prompt_tokens"]
    body = completion((int(n * 0.8), n), (2, 4))
    levels = [int(x) for x in str(p["levels"]).split(",")]
    phases: list[Phase] = []
    for i, level in enumerate(levels):
        phases.append(Phase(f"in-flight-{level}-{i + 1}", p["step_s"], level, body))
    phases.append(idle("idle", 3.0))
    ctx.load(server, phases, request_timeout_s=60.0)
    ctx.notes["oom_kills"] = group.oom_kills()
    ctx.notes["limit_mib"] = p["limit_mib"]
