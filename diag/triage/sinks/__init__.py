"""Ticket sinks: where incidents become tickets -- GitHub Issues, GitLab Issues, Jira (Cloud and Data Center) and
a generic JSON webhook. One module per tracker; ``base`` holds what they share (the notice, the ticket, the
error that says whether to retry), ``text`` the ticket text and its markups.

Exactly one ticket per incident, even when the receiver dies between "the tracker created it" and "we stored
its id": every ticket carries a marker label (``llmdiag-<key>-g<generation>``) and the outbox asks
``find(marker)`` before ``create`` -- for every tracker that can look labels up. The webhook cannot; its
receiver deduplicates on the marker it is sent. Tokens come from the environment and are never logged or stored.
"""

from diag.triage.sinks.base import Notice, Sink, SinkError, Ticket
from diag.triage.sinks.github import GitHubSink
from diag.triage.sinks.gitlab import GitLabSink
from diag.triage.sinks.jira import JiraSink
from diag.triage.sinks.webhook import WebhookSink

__all__ = ["GitHubSink", "GitLabSink", "JiraSink", "Notice", "Sink", "SinkError", "Ticket", "WebhookSink"]
