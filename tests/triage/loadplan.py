"""The load both kill -9 tests send: Alertmanager-like deliveries of many groups, 30 % duplicates and retries."""

from __future__ import annotations

import random
from collections import defaultdict

from tests.triage.helpers import alert, body

GROUPS = 300
TOTAL = 5000
DUPLICATE_SHARE = 0.30
CONCURRENCY = 32


def plan(seed: int = 7) -> tuple[list[dict], dict[str, set[str]]]:
    """Deliveries like Alertmanager's: each group's later notifications carry all its alerts so far."""
    rng = random.Random(seed)
    unique = int(TOTAL * (1 - DUPLICATE_SHARE))
    per_group: dict[int, int] = defaultdict(int)
    originals: list[dict] = []
    expected: dict[str, set[str]] = defaultdict(set)
    for i in range(unique):
        g = i if i < GROUPS else rng.randrange(GROUPS)
        per_group[g] += 1
        labels = [{"alertname": "LoadTest", "job": "llm", "instance": f"node-{g}", "pod": f"p{k}"} for k in range(per_group[g])]
        alerts = [alert(lab, starts=1_700_000_000.0 + g) for lab in labels]
        originals.append(body(*alerts, group_key=f'{{}}:{{instance="node-{g}"}}'))
        expected[f"node-{g}"] |= {a["fingerprint"] for a in alerts}
    duplicates = [rng.choice(originals) for _ in range(TOTAL - unique)]
    deliveries = originals + duplicates
    rng.shuffle(deliveries)
    return deliveries, expected
