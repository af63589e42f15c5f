"""The webhook paths ``diag triage serve`` answers, shared by the receiver and the Alertmanager generator.

Why one module: Alertmanager drops a delivery answered 4xx without retrying, so a route the generator
writes that the receiver does not serve loses every alert on it -- silently, since ``amtool
check-config`` cannot know which paths the receiver serves. Both sides import these names, and a test
posts to every URL the generated ``alertmanager.yaml`` holds.

``/webhook`` takes any alert; ``/webhook/page`` and ``/webhook/ticket`` also record the severity of
the route that delivered it, so an alert without a ``severity`` label routed as a page stays a page.
"""

from __future__ import annotations

DEFAULT_RECEIVER_URL = "http://127.0.0.1:9095"
WEBHOOK_PATH = "/webhook"
SEVERITIES = ("page", "ticket")
SEVERITY_PATHS: dict[str, str] = {severity: f"{WEBHOOK_PATH}/{severity}" for severity in SEVERITIES}


def receiver_url(base: str, severity: str) -> str:
    """The webhook URL a route of this severity posts to, on a receiver reachable at ``base``."""
    return base.rstrip("/") + SEVERITY_PATHS[severity]


def route_severity(path: str) -> str | None:
    """The severity a webhook path stands for: '' for the plain ``/webhook``; None when it is not served."""
    if path == WEBHOOK_PATH:
        return ""
    for severity, served in SEVERITY_PATHS.items():
        if path == served:
            return severity
    return None


def served_paths() -> tuple[str, ...]:
    return (WEBHOOK_PATH, *SEVERITY_PATHS.values())
