"""Alertmanager auto-triage: one diagnosed, deduplicated incident per problem, not one ticket per notification.

Modules, one job each: ``payload`` (strict webhook v4 validation), ``keys`` (incident identity),
``correlate`` (incidents that are one problem joined), ``store`` (SQLite, the only durable state),
``ingest`` (group commit), ``lifecycle`` (state transitions), ``diagnosis`` (the asynchronous
``diag analyze`` worker), ``agreement`` (the diagnosis checked against the alert), ``outbox`` +
``sinks`` (GitHub, GitLab, Jira, JSON webhook tickets, exactly once), ``web`` (the read-only page),
``asgi`` + ``server`` (HTTP). The commands, ``diag triage`` / ``diag tickets``, are ``diag.cli.triage``.
"""
