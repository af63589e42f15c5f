"""What every ticket sink shares: the notice it is given, the ticket it returns, and the error that says
whether trying again can help.

Why the error carries a verdict: a tracker that is down or rate-limiting will take the action later, so the
outbox retries it; a tracker that refuses it (a wrong token, a project that does not exist, an endpoint it
removed) will refuse it forever, and retrying would only hide the problem behind a growing backoff. The HTTP
status is the tracker's own word on which it is:

- 429, and 403 with ``Retry-After`` or an exhausted ``X-RateLimit-Remaining`` (GitHub's rate limits): wait as
  long as the tracker says (``Retry-After`` in seconds or as an HTTP date, else ``X-RateLimit-Reset``), then retry;
- 408 (the request timed out on the way), 409 (a conflicting concurrent edit), 5xx and network errors: retry
  with exponential backoff (``Retry-After`` honoured when a 503 carries one);
- any other 4xx, a 3xx (the URL points somewhere else: configure that URL), and a 2xx whose body is not the
  documented JSON (an SSO login page, a proxy): permanent -- the outbox marks the action failed and shows why.

Tokens are sent in headers only; no message built here contains a header.
"""

from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any, Protocol

import httpx

from diag.triage.sinks.text import Doc

TIMEOUT_S = 10.0
MAX_WAIT_S = 3600.0  # a Retry-After further away than this is taken as this (a misread date must not park a queue for days)
USER_AGENT = "llm-diag-triage"


class SinkError(RuntimeError):
    """The tracker did not do what was asked. ``permanent``: it never will (stop retrying and show the reason);
    ``retry_after_s``: it said when to try again."""

    def __init__(
        self, message: str, *, permanent: bool = False, retry_after_s: float | None = None, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.retry_after_s = retry_after_s
        self.status = status


@dataclass(frozen=True)
class Ticket:
    external_id: str
    url: str


@dataclass(frozen=True)
class Notice:
    """One outbox action as every sink needs it: a tracker renders ``doc`` in its own markup, the webhook sends
    the fields as they are. ``idempotency_key`` is the same on every retry of this action."""

    action: str  # create | comment | close | reopen | diagnosis
    marker: str
    title: str
    doc: Doc
    incident: dict[str, Any] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    idempotency_key: str = ""

    @property
    def wontfix(self) -> bool:
        return self.incident.get("resolution") == "wontfix"


class Sink(Protocol):
    """A ticket tracker. ``find`` returns None when the tracker has no lookup (the webhook)."""

    name: str

    @property
    def lookup_settle_s(self) -> float:
        """How long after a create the tracker's lookup may still miss the new ticket (0: consistent at once)."""
        ...

    def find(self, marker: str) -> Ticket | None: ...
    def create(self, notice: Notice) -> Ticket: ...
    def comment(self, ticket: Ticket, notice: Notice) -> None: ...
    def close(self, ticket: Ticket, notice: Notice) -> None: ...
    def reopen(self, ticket: Ticket, notice: Notice) -> None: ...


def one_line(text: str, limit: int) -> str:
    """A title as trackers take it: no line breaks (Jira refuses a summary with one), at most ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delay-seconds or an HTTP date (RFC 9110 section 10.2.3)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if text.isdigit():
        return min(MAX_WAIT_S, float(text))
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return min(MAX_WAIT_S, max(0.0, when.timestamp() - (time.time() if now is None else now)))


def _rate_limit_wait(resp: httpx.Response) -> float | None:
    """GitHub's primary rate limit: ``X-RateLimit-Remaining: 0`` and the reset time in epoch seconds."""
    if resp.headers.get("x-ratelimit-remaining") != "0":
        return None
    reset = resp.headers.get("x-ratelimit-reset", "")
    if not reset.isdigit():
        return 60.0
    return min(MAX_WAIT_S, max(1.0, int(reset) - time.time()))


def _detail(resp: httpx.Response) -> str:
    """The tracker's own explanation, short: Jira's errorMessages/errors, GitHub's and GitLab's message/error."""
    try:
        doc = resp.json()
    except ValueError:
        return " ".join(resp.text.split())[:200]
    if not isinstance(doc, dict):
        return str(doc)[:200]
    parts: list[str] = []
    for key in ("message", "error", "error_description"):
        if doc.get(key):
            parts.append(str(doc[key]))
    parts += [str(m) for m in doc.get("errorMessages") or []]
    errors = doc.get("errors")
    if isinstance(errors, dict):
        parts += [f"{k}: {v}" for k, v in errors.items()]
    elif isinstance(errors, list):
        parts += [str(e.get("message", e)) if isinstance(e, dict) else str(e) for e in errors]
    return ("; ".join(parts) or str(doc))[:300]


def classify(resp: httpx.Response, what: str) -> SinkError:
    """The SinkError for a non-2xx answer, permanent or not as the module docstring lays out."""
    status = resp.status_code
    detail = _detail(resp)
    message = f"{what}: HTTP {status}" + (f": {detail}" if detail else "")
    wait = parse_retry_after(resp.headers.get("retry-after"))
    if status == 429 or (status == 403 and (wait is not None or _rate_limit_wait(resp) is not None)):
        return SinkError(f"{message} (rate limited)", retry_after_s=wait if wait is not None else _rate_limit_wait(resp),
                         status=status)  # fmt: skip
    if 300 <= status < 400:
        where = resp.headers.get("location", "")
        return SinkError(f"{what}: HTTP {status}, redirected to {where or '(no Location)'}: configure that URL instead",
                         permanent=True, status=status)  # fmt: skip
    if 400 <= status < 500 and status not in (408, 409):
        return SinkError(message, permanent=True, status=status)
    return SinkError(message, retry_after_s=wait, status=status)


class Http:
    """One tracker's HTTP client: base URL, fixed headers, answers turned into data or a classified SinkError."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(
            base_url=self.base_url, headers={"User-Agent": USER_AGENT, **headers}, timeout=TIMEOUT_S, trust_env=False
        )

    def call(self, method: str, path: str, what: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise SinkError(f"{what}: {type(exc).__name__}: {exc}") from None
        if not 200 <= resp.status_code < 300:
            raise classify(resp, what)
        return resp

    def json(self, method: str, path: str, what: str, **kwargs: Any) -> Any:
        """The JSON body of a 2xx answer; anything else there means the URL does not lead to the tracker's API."""
        resp = self.call(method, path, what, **kwargs)
        try:
            return resp.json()
        except ValueError:
            kind = resp.headers.get("content-type", "no content type")
            raise SinkError(
                f"{what}: HTTP {resp.status_code} with {kind}, not JSON: {self.base_url} does not answer as the API"
                " (a login page or a proxy?)",
                permanent=True,
                status=resp.status_code,
            ) from None

    def close(self) -> None:
        self.client.close()


def field_of(doc: Any, name: str, what: str) -> Any:
    """A required field of a JSON answer; missing means the server does not speak the documented API."""
    if not isinstance(doc, dict) or doc.get(name) in (None, ""):
        raise SinkError(f"{what}: the answer has no {name!r}: not the documented API", permanent=True)
    return doc[name]
