"""The redaction engine as it was before it became linear-time: a frozen reference, never used by the product.

Why it is kept: the linear engine in ``collectors.redact`` must give the same output and counts as this one on every
ordinary input (differential tests generate text and compare), and ``bench/redact.py`` measures both side by side in
one run. This copy is quadratic on long words; call it only on short inputs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

REDACTED = "<redacted>"

_SECRET_WORDS = frozenset(
    {
        "key",
        "apikey",
        "token",
        "secret",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "credential",
        "credentials",
        "creds",
        "auth",
        "authorization",
        "bearer",
        "cookie",
    }
)
# A word ending with one of these is a compound of it (PGPASSWORD, hftoken, clientsecret). "key" is
# not here: monkey, hotkey and turkey are not secrets.
_STRONG_SUFFIXES = ("password", "passwd", "secret", "apikey", "token", "credential", "credentials", "passphrase")
# Last words that make the value a description of a secret, not the secret.
_DESCRIPTOR_TAILS = frozenset(
    {
        "file",
        "files",
        "path",
        "paths",
        "dir",
        "directory",
        "filename",
        "filepath",
        "env",
        "var",
        "name",
        "names",
        "type",
        "kind",
        "id",
        "ids",
        "limit",
        "limits",
        "size",
        "len",
        "length",
        "count",
        "num",
        "number",
        "max",
        "min",
        "budget",
        "mode",
        "header",
        "ttl",
        "timeout",
        "expiry",
        "enabled",
        "disabled",
        "required",
        "url",
        "uri",
        "endpoint",
        "host",
        "port",
        "method",
        "provider",
        "scheme",
        "format",
        "prefix",
    }
)
# Whole names that contain a secret word but are well-known non-secrets (the shell's working directory).
_NOT_SECRET_NAMES = frozenset({"pwd", "oldpwd"})
_AUTH_SCHEMES = frozenset({"bearer", "basic", "token", "digest", "negotiate"})

_WORD_RE = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORD_RE.findall(name)]


def is_secret_name(name: str) -> bool:
    """True when a variable/flag/field name looks like it holds a secret (see the module docstring)."""
    if not isinstance(name, str):
        return False
    stripped = name.strip().lstrip("-").strip()
    if not stripped or stripped.lower() in _NOT_SECRET_NAMES:
        return False
    words = _words(stripped)
    alpha = [w for w in words if not w.isdigit()]
    if not alpha:
        return False
    if alpha[-1] in _DESCRIPTOR_TAILS:
        return False
    return any(w in _SECRET_WORDS or w.endswith(_STRONG_SUFFIXES) for w in alpha)


# --------------------------------------------------------------------------- text rules

_PRIVATE_KEY_RE = re.compile(
    r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----.*?(?:-----END \1PRIVATE KEY-----|\Z)",
    re.DOTALL,
)
# userinfo with a colon: user:password. A bare user@ (ssh://git@host) is not a credential.
_URL_CRED_RE = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/\s@:]*:[^/\s@]*)@")
_BEARER_RE = re.compile(r"(?i)\b(?P<word>bearer)(?P<sep>\s+)(?P<value>[A-Za-z0-9._~+/=\-]{4,})")
_TOKEN_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("token_openai", re.compile(r"(?<![A-Za-z0-9_\-])sk-[A-Za-z0-9_\-]{20,}")),
    ("token_huggingface", re.compile(r"(?<![A-Za-z0-9_\-])hf_[A-Za-z0-9]{20,}")),
    ("token_github", re.compile(r"(?<![A-Za-z0-9_\-])(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})")),
    ("token_gitlab", re.compile(r"(?<![A-Za-z0-9_\-])glpat-[A-Za-z0-9_\-]{20,}")),
    ("token_aws", re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])")),
    ("token_slack", re.compile(r"(?<![A-Za-z0-9_\-])xox[abposr]-[A-Za-z0-9\-]{10,}")),
    ("token_google", re.compile(r"(?<![A-Za-z0-9_\-])AIza[0-9A-Za-z_\-]{35}")),
    ("token_jwt", re.compile(r"(?<![A-Za-z0-9_\-])eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}")),
)
# name, optional closing quote of a JSON key, separator. The value is found by hand after the match so
# that a non-secret ``a=b`` never swallows a secret ``password=x`` that follows it.
_KV_NAME_RE = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)(?P<sep>[\"']?[ \t]*[:=][ \t]*)")
_UNQUOTED_VALUE_RE = re.compile(r"[^\s\"',;&}\])]+")
_FLAG_RE = re.compile(r"(?<!\S)(?P<flag>--?[A-Za-z][A-Za-z0-9_.\-]*)(?P<sep>[ \t]+)(?P<value>[^\s\-][^\s]*)")


def _sub(pattern: re.Pattern[str], rule: str, repl: Callable[[re.Match[str]], str | None]) -> Callable[[str, dict], str]:
    """A rule from a pattern and a replacement that returns None to leave a match alone."""

    def apply(text: str, counts: dict[str, int]) -> str:
        def one(match: re.Match[str]) -> str:
            out = repl(match)
            if out is None:
                return match.group(0)
            counts[rule] = counts.get(rule, 0) + 1
            return out

        return pattern.sub(one, text)

    return apply


def _private_key(m: re.Match[str]) -> str:
    return f"-----BEGIN {m.group(1)}PRIVATE KEY-----{REDACTED}-----END {m.group(1)}PRIVATE KEY-----"


def _url_credentials(m: re.Match[str]) -> str | None:
    if m.group("userinfo") == REDACTED:
        return None
    return f"{m.group('scheme')}{REDACTED}@"


def _bearer(m: re.Match[str]) -> str | None:
    return f"{m.group('word')}{m.group('sep')}{REDACTED}"


def _key_value(text: str, counts: dict[str, int]) -> str:
    out: list[str] = []
    pos = 0
    search_from = 0
    while True:
        m = _KV_NAME_RE.search(text, search_from)
        if m is None:
            break
        search_from = m.end()
        if not is_secret_name(m.group("name")):
            # Continue right after the name so "a=password=x" still sees "password=".
            search_from = m.end("name")
            continue
        start = m.end()
        if text.startswith(REDACTED, start):
            continue
        end = _value_end(text, start)
        if end is None:
            continue
        replacement = _quoted_redaction(text[start:end])
        # "Authorization: Bearer x": the secret is the word after the scheme.
        if text[start:end].strip("\"'").lower() in _AUTH_SCHEMES:
            rest = _UNQUOTED_VALUE_RE.match(text, end + 1) if text.startswith(" ", end) else None
            if rest is None or rest.group(0) == REDACTED:
                continue
            start, end, replacement = rest.start(), rest.end(), REDACTED
        out.append(text[pos:start])
        out.append(replacement)
        counts["key_value"] = counts.get("key_value", 0) + 1
        pos = end
        search_from = end
    out.append(text[pos:])
    return "".join(out)


def _value_end(text: str, start: int) -> int | None:
    """End of the value starting at ``start``: a quoted string (kept whole) or an unquoted run."""
    if start >= len(text):
        return None
    quote = text[start]
    if quote in "\"'":
        close = text.find(quote, start + 1)
        newline = text.find("\n", start + 1)
        if close == -1 or (newline != -1 and newline < close):
            close = newline if newline != -1 else len(text)
            return close if close > start + 1 else None
        return close + 1
    m = _UNQUOTED_VALUE_RE.match(text, start)
    return m.end() if m else None


def _quoted_redaction(value: str) -> str:
    if len(value) >= 2 and value[0] in "\"'" and value[-1] == value[0]:
        return f"{value[0]}{REDACTED}{value[0]}"
    return REDACTED


def _flag_value(m: re.Match[str]) -> str | None:
    if not is_secret_name(m.group("flag")) or m.group("value").startswith(REDACTED):
        return None
    return f"{m.group('flag')}{m.group('sep')}{REDACTED}"


_TEXT_RULES: tuple[Callable[[str, dict], str], ...] = (
    _sub(_PRIVATE_KEY_RE, "private_key", _private_key),
    _sub(_URL_CRED_RE, "url_credentials", _url_credentials),
    _sub(_BEARER_RE, "bearer", _bearer),
    *(_sub(pattern, name, lambda m: REDACTED) for name, pattern in _TOKEN_SHAPES),
    _key_value,
    _sub(_FLAG_RE, "flag_value", _flag_value),
)


def redact_text(text: str) -> tuple[str, dict[str, int]]:
    """Apply every rule to free text; return the redacted text and how often each rule fired."""
    counts: dict[str, int] = {}
    if not isinstance(text, str) or not text:
        return (text if isinstance(text, str) else ""), counts
    for rule in _TEXT_RULES:
        text = rule(text, counts)
    return text, counts


# --------------------------------------------------------------------------- argv


def redact_argv_counts(argv: Sequence[str]) -> tuple[str, dict[str, int]]:
    """``redact_argv`` plus the per-rule counts (for bundles' redaction reports)."""
    counts: dict[str, int] = {}
    args = [a if isinstance(a, str) else str(a) for a in argv]
    redact_next = [False] * len(args)
    for i, arg in enumerate(args):
        lowered = arg.lower()
        if i + 1 >= len(args):
            break
        nxt = args[i + 1]
        if arg.startswith("-") and "=" not in arg and len(arg) > 1 and is_secret_name(arg):
            # "--api-key VALUE"; a following flag means this one takes no value.
            if nxt and not nxt.startswith("-"):
                redact_next[i + 1] = True
        elif lowered.rstrip(":") in ("authorization", "proxy-authorization"):
            # curl -H split by a shell: "Authorization:" "Bearer" "X" or "Authorization:" "X".
            if nxt.lower() in _AUTH_SCHEMES and i + 2 < len(args):
                redact_next[i + 2] = True
            elif nxt.lower() not in _AUTH_SCHEMES:
                redact_next[i + 1] = True
        elif lowered == "bearer":
            redact_next[i + 1] = True
    out: list[str] = []
    for i, arg in enumerate(args):
        if redact_next[i] and arg != REDACTED:
            out.append(REDACTED)
            rule = "bearer" if i > 0 and args[i - 1].lower() in _AUTH_SCHEMES else "flag_value"
            counts[rule] = counts.get(rule, 0) + 1
            continue
        redacted, arg_counts = redact_text(arg)
        for rule, n in arg_counts.items():
            counts[rule] = counts.get(rule, 0) + n
        out.append(redacted)
    return " ".join(out), counts


def redact_argv(argv: Sequence[str]) -> str:
    """Join argv for display (space-separated, like ps) with secret argument values replaced by ``<redacted>``."""
    return redact_argv_counts(argv)[0]
