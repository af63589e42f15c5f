"""Incident identity: which alerts are the same problem.

Why not ``groupKey``: it embeds the route path, so editing the Alertmanager route tree renames every
open incident, and two routes (or two tiers of one SLO) that page for one problem would open two.
The key is built from the alert's own labels instead. Each part is a list of alternatives, the
first present wins: by default ``diag_class|slo|alertname`` (what is wrong -- the live diagnosis's
class, else the SLO whose budget burns, so the fast and slow tiers of one SLO are one incident,
else the alert's name), then ``job``, ``instance`` and ``model|model_name`` (where).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

DEFAULT_KEY_LABELS: tuple[str, ...] = ("diag_class|slo|alertname", "job", "instance", "model|model_name")


def parse_key_labels(spec: str) -> tuple[str, ...]:
    """``"slo|alertname,job"`` -> ``("slo|alertname", "job")``; raises ValueError on an empty or invalid part."""
    from diag.triage.payload import LABEL_NAME

    parts = tuple(p.strip() for p in spec.split(",") if p.strip())
    if not parts:
        raise ValueError("--key-labels: give at least one label, e.g. alertname,job,instance")
    for part in parts:
        for name in part.split("|"):
            if not LABEL_NAME.match(name):
                raise ValueError(f"--key-labels: {name!r} is not a label name")
    return parts


def key_labels(labels: Mapping[str, str], spec: Sequence[str] = DEFAULT_KEY_LABELS) -> dict[str, str]:
    """The labels that identify the incident this alert belongs to (absent parts are left out)."""
    out: dict[str, str] = {}
    for part in spec:
        for name in part.split("|"):
            if labels.get(name):
                out[name] = labels[name]
                break
    return out


def incident_key(labels: Mapping[str, str], spec: Sequence[str] = DEFAULT_KEY_LABELS) -> tuple[str, dict[str, str]]:
    """(stable key string, the labels it was built from). The key is a digest: fixed length, safe in a URL or a label."""
    chosen = key_labels(labels, spec)
    if not chosen:  # none of the key labels present: the alert's full label set is its identity
        chosen = dict(labels)
    canonical = json.dumps(sorted(chosen.items()), separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:24], chosen
