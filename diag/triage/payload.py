"""Strict validation of Alertmanager's webhook body (version 4).

Why strict: Alertmanager retries a 5xx forever but drops a 4xx, so everything wrong with a body must
be found here -- before anything is stored -- and answered with a 4xx that says what is wrong.
Why tolerant of unknown keys: newer Alertmanagers add fields (``notification_reason`` in 0.32,
``routeLabels`` in 0.34); a receiver that refused them would break on upgrade.

Limits bound the work a hostile body can cause (it is parsed on the request thread); real
notifications are far below them (one alert group, a few dozen labels).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

MAX_BODY_BYTES = 1 << 20
MAX_ALERTS = 1000
MAX_LABELS = 128
MAX_VALUE_CHARS = 8192
MAX_STRING_CHARS = 65536

LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
FINGERPRINT = re.compile(r"[0-9a-fA-F]{1,64}\Z")
# RFC 3339 as Go's time.Time marshals it: up to nanoseconds, Z or a numeric offset.
RFC3339 = re.compile(r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))\Z")
STATUSES = ("firing", "resolved")


class PayloadError(ValueError):
    """The body is not a valid Alertmanager v4 notification; the message says where."""


@dataclass(frozen=True)
class Alert:
    status: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    ends_at: float | None  # None: Go's zero time, i.e. no end known yet
    generator_url: str
    fingerprint: str


@dataclass(frozen=True)
class Notification:
    version: str
    group_key: str
    status: str
    receiver: str
    group_labels: dict[str, str]
    common_labels: dict[str, str]
    common_annotations: dict[str, str]
    external_url: str
    truncated_alerts: int
    alerts: tuple[Alert, ...]
    # The severity of the receiver route that delivered it ('' for the plain /webhook): an alert with no
    # severity label still carries the page/ticket decision Alertmanager's routing made.
    route_severity: str = ""


def parse_time(text: str, where: str) -> float | None:
    """Seconds since the epoch, or None for Go's zero time (``0001-01-01T00:00:00Z``)."""
    m = RFC3339.match(text)
    if not m:
        raise PayloadError(f"{where}: not an RFC 3339 time: {text[:40]!r}")
    year, month, day, hour, minute, second = (int(g) for g in m.group(1, 2, 3, 4, 5, 6))
    if year <= 1:
        return None
    try:
        base = datetime(year, month, day, hour, minute, min(second, 59), tzinfo=UTC)
    except ValueError as exc:
        raise PayloadError(f"{where}: invalid date {text[:40]!r}: {exc}") from None
    ts = base.timestamp() + (int(m.group(7).ljust(9, "0")) / 1e9 if m.group(7) else 0.0)
    if m.group(9):
        offset = int(m.group(10)) * 3600 + int(m.group(11)) * 60
        ts -= offset if m.group(9) == "+" else -offset
    return ts


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PayloadError(f"duplicate key {key[:40]!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> float:
    raise PayloadError(f"{name} is not JSON")


# One decoder for all bodies: json.loads with hooks would build a new decoder (and its scanner) per call.
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)


def _string(obj: dict[str, Any], key: str, where: str, *, required: bool = True, limit: int = MAX_STRING_CHARS) -> str:
    if key not in obj:
        if required:
            raise PayloadError(f"{where}: missing {key!r}")
        return ""
    value = obj[key]
    if not isinstance(value, str):
        raise PayloadError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    if len(value) > limit:
        raise PayloadError(f"{where}.{key}: longer than {limit} characters")
    return value


def _labels(obj: dict[str, Any], key: str, where: str, *, names: bool = True, required: bool = True) -> dict[str, str]:
    if key not in obj:
        if required:
            raise PayloadError(f"{where}: missing {key!r}")
        return {}
    value = obj[key]
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise PayloadError(f"{where}.{key}: expected an object of strings")
    if len(value) > MAX_LABELS:
        raise PayloadError(f"{where}.{key}: more than {MAX_LABELS} entries")
    for name, text in value.items():
        if names and not LABEL_NAME.match(name):
            raise PayloadError(f"{where}.{key}: invalid label name {name[:40]!r}")
        if not isinstance(text, str):
            raise PayloadError(f"{where}.{key}.{name[:40]}: expected a string, got {type(text).__name__}")
        if len(text) > (MAX_VALUE_CHARS if names else MAX_STRING_CHARS):
            raise PayloadError(f"{where}.{key}.{name[:40]}: value too long")
    return dict(value)


def _alert(raw: Any, i: int) -> Alert:
    where = f"alerts[{i}]"
    if not isinstance(raw, dict):
        raise PayloadError(f"{where}: expected an object")
    status = _string(raw, "status", where)
    if status not in STATUSES:
        raise PayloadError(f"{where}.status: expected firing or resolved, got {status[:20]!r}")
    labels = _labels(raw, "labels", where)
    if not labels:
        raise PayloadError(f"{where}.labels: empty (an alert is identified by its labels)")
    starts = parse_time(_string(raw, "startsAt", where, limit=64), f"{where}.startsAt")
    if starts is None:
        raise PayloadError(f"{where}.startsAt: zero time")
    ends = parse_time(_string(raw, "endsAt", where, limit=64), f"{where}.endsAt") if "endsAt" in raw else None
    fingerprint = _string(raw, "fingerprint", where, limit=64)
    if not FINGERPRINT.match(fingerprint):
        raise PayloadError(f"{where}.fingerprint: expected a hex string, got {fingerprint[:20]!r}")
    return Alert(
        status=status,
        labels=labels,
        annotations=_labels(raw, "annotations", where, names=False, required=False),
        starts_at=starts,
        ends_at=ends,
        generator_url=_string(raw, "generatorURL", where, required=False, limit=8192),
        fingerprint=fingerprint.lower(),
    )


def parse(body: bytes, route_severity: str = "") -> Notification:
    """Validate ``body`` and return the notification; raises PayloadError with the first problem found.

    ``route_severity``: the severity of the webhook path it arrived on ('' for the plain ``/webhook``).
    """
    if len(body) > MAX_BODY_BYTES:
        raise PayloadError(f"body larger than {MAX_BODY_BYTES} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PayloadError(f"body is not UTF-8 (byte {exc.start})") from None
    try:
        doc = _DECODER.decode(text)
    except RecursionError:
        raise PayloadError("JSON nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise PayloadError(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(doc, dict):
        raise PayloadError("expected a JSON object")
    version = _string(doc, "version", "body", limit=8)
    if version != "4":
        raise PayloadError(f"version {version[:8]!r} is not supported (Alertmanager webhook version 4 expected)")
    status = _string(doc, "status", "body")
    if status not in STATUSES:
        raise PayloadError(f"body.status: expected firing or resolved, got {status[:20]!r}")
    raw_alerts = doc.get("alerts")
    if not isinstance(raw_alerts, list) or not raw_alerts:
        raise PayloadError("body.alerts: expected a non-empty list")
    if len(raw_alerts) > MAX_ALERTS:
        raise PayloadError(f"body.alerts: more than {MAX_ALERTS} alerts")
    truncated = doc.get("truncatedAlerts", 0)
    if isinstance(truncated, bool) or not isinstance(truncated, int) or truncated < 0 or truncated > 2**31:
        raise PayloadError("body.truncatedAlerts: expected a non-negative integer")
    return Notification(
        version=version,
        group_key=_string(doc, "groupKey", "body"),
        status=status,
        receiver=_string(doc, "receiver", "body", required=False, limit=1024),
        group_labels=_labels(doc, "groupLabels", "body", required=False),
        common_labels=_labels(doc, "commonLabels", "body", required=False),
        common_annotations=_labels(doc, "commonAnnotations", "body", names=False, required=False),
        external_url=_string(doc, "externalURL", "body", required=False, limit=8192),
        truncated_alerts=int(truncated),
        alerts=tuple(_alert(a, i) for i, a in enumerate(raw_alerts)),
        route_severity=route_severity,
    )
