"""The Alertmanager side, from the same spec: routes by severity, inhibition between tiers.

The webhook URLs are the receiver's own paths (``alerts.receiver_routes``), on the base URL the spec names:
Alertmanager drops a delivery answered 4xx without retrying, so a path the receiver does not serve would lose
every alert routed to it. A page route posts to the page path and a ticket route to the ticket path, so the
receiver keeps the severity even for an alert that carries no ``severity`` label.

Inhibition rules carry ``alertname`` and ``slo=~".+"`` in their source matchers: Alertmanager treats
a missing label as empty, so without them an OOM page (no ``slo`` label) would silence every other
ticket that also lacks one. ``equal: [slo, model]`` keeps one SLO's page from muting another's.
"""

from __future__ import annotations

from typing import Any

from alerts.receiver_routes import receiver_url
from alerts.slo_names import BURN_ALERT
from alerts.spec import Spec

PAGE_RECEIVER = "llm-diag-page"
TICKET_RECEIVER = "llm-diag-ticket"
GROUP_BY = ["alertname", "slo", "model", "diag_class", "tier"]


def alertmanager_config(spec: Spec, *, group_wait: str = "30s", group_interval: str = "5m",
                        repeat_interval: str = "4h") -> dict[str, Any]:  # fmt: skip
    """A complete config (``amtool check-config`` accepts it); merge ``route.routes`` and ``inhibit_rules`` into yours."""
    burn = f'alertname="{BURN_ALERT}"'
    inhibit: list[dict[str, Any]] = []
    tiers = list(spec.tiers)
    for i, faster in enumerate(tiers[:-1]):
        slower = "|".join(t.name for t in tiers[i + 1 :])
        inhibit.append({
            "source_matchers": [burn, f'tier="{faster.name}"', 'slo=~".+"'],
            "target_matchers": [burn, f'tier=~"{slower}"'],
            "equal": ["slo", "model"],
        })  # fmt: skip
    inhibit.append({
        "source_matchers": [burn, 'severity="page"', 'slo=~".+"'],
        "target_matchers": [burn, 'severity="ticket"'],
        "equal": ["slo", "model"],
    })  # fmt: skip
    return {
        "route": {
            "receiver": TICKET_RECEIVER,
            "group_by": GROUP_BY,
            "group_wait": group_wait,
            "group_interval": group_interval,
            "repeat_interval": repeat_interval,
            "routes": [
                {"matchers": ['severity="page"'], "receiver": PAGE_RECEIVER},
                {"matchers": ['severity="ticket"'], "receiver": TICKET_RECEIVER},
            ],
        },
        "receivers": [
            {"name": PAGE_RECEIVER, "webhook_configs": [{"url": receiver_url(spec.receiver_url, "page"), "send_resolved": True}]},
            {
                "name": TICKET_RECEIVER,
                "webhook_configs": [{"url": receiver_url(spec.receiver_url, "ticket"), "send_resolved": True}],
            },
        ],
        "inhibit_rules": inhibit,
    }
