"""Alertmanager auto-triage: one diagnosed, deduplicated incident per problem, not one ticket per notification.

Modules, one job each: ``payload`` (strict webhook v4 validation), ``keys`` (incident identity),
``store`` (SQLite, the only durable state), ``ingest`` (group commit), ``lifecycle`` (state
transitions), ``diagnosis`` (the asynchronous ``diag analyze`` worker), ``outbox`` + ``sinks``
(GitHub/Jira tickets, exactly once), ``web`` (the read-only page), ``server`` (HTTP), ``cli``
(``diag triage`` / ``diag tickets``).
"""
