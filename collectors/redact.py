"""Secret redaction for command lines and free text.

Why: process samples carry command lines, and incident bundles carry logs and configs. Serving
processes are routinely started with ``--api-key sk-...``, ``HF_TOKEN=hf_...`` or a database URL with a
password in it; none of that may reach a record, a log or a bundle. Redaction happens at the source.

The rules, in the order they run (each name is the key of the counts ``redact_text`` returns):

``private_key``      a PEM ``-----BEGIN ... PRIVATE KEY-----`` block (text only).
``url_credentials``  ``scheme://user:password@host`` -> ``scheme://<redacted>@host``.
``bearer``           ``Bearer <token>`` (any case), as in an ``Authorization`` header.
``token_<kind>``     well-known token shapes wherever they appear: ``sk-`` (OpenAI/Anthropic), ``hf_``
                     (Hugging Face), ``ghp_``/``gho_``/``github_pat_`` (GitHub), ``glpat-`` (GitLab),
                     ``AKIA``/``ASIA`` (AWS access key ids), ``xox?-`` (Slack), ``AIza`` (Google), JWTs.
``key_value``        ``name=value`` / ``name: value`` / ``"name": "value"`` where ``name`` is secret-looking.
``flag_value``       ``--name value`` (the value in the next argument) where ``name`` is secret-looking.

What makes a *name* secret-looking (``is_secret_name``) is decided on words, not substrings, so that
``--max-tokens``, ``--tokenizer``, ``--keyboard`` and ``TOKENIZERS_PARALLELISM`` are left alone:

* the name is split into words (``-``, ``_``, ``.``, camelCase), and it is secret when one word is a
  secret word (key, apikey, token, secret, password, passwd, pwd, passphrase, credential(s), creds, auth,
  authorization, bearer, cookie) or ends in a strong one (``pgpassword``, ``hftoken``);
* unless its last word says the value is *about* a secret rather than the secret itself: a path
  (``--key-file``, ``--token-path``), a name/id/type (``--auth-type``, ``AWS_ACCESS_KEY_ID``), a size or
  limit (``--key-size``, ``--token-limit``), a switch (``AUTH_ENABLED``) or an endpoint (``AUTH_URL``;
  credentials inside a URL are still caught by ``url_credentials``).

The rules prefer over-redaction to leaks: ``--sort-key name`` loses ``name``, which costs nothing.
Nothing here ever raises on odd input.
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
_LONGEST_SCHEME = max(len(s) for s in _AUTH_SCHEMES)

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
#
# Every rule is linear in the text by construction, because one process with a 20 000-character argument
# or one long log line must not stall the 1 Hz sampler or a bundle:
#
# * a rule only starts where its token can start: literal prefixes come first in the pattern (the regex
#   engine then skips ahead with a fast literal scan) and "not inside a longer word" is checked by a
#   fixed-width look-behind *after* the literal, never by trying every position of a long word;
# * runs of word characters are consumed possessively (``*+``), so a failed match never backtracks
#   over them;
# * settings (``name=value``) are found from occurrences of secret words, not by trying every position
#   as the start of a name, and every character of a name run is walked at most once;
# * a rule whose literal cannot occur in the text (no ``sk-``, no ``://``, no secret word) is skipped.
#
# The output is the same as the straightforward patterns give (``bench/redact_reference.py`` keeps them;
# tests compare the two on generated text).

_PRIVATE_KEY_RE = re.compile(
    r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----.*?(?:-----END \1PRIVATE KEY-----|\Z)",
    re.DOTALL,
)
# userinfo with a colon: user:password. A bare user@ (ssh://git@host) is not a credential. Matched only
# at the start of a run of scheme characters; whether a scheme may start inside that run is checked
# afterwards (``_scheme_starts``), which keeps the search linear.
_SCHEME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+.-")
_USERINFO_RE = re.compile(r"(?P<userinfo>[^/\s@:]*+:[^/\s@]*+)@")
_WORDCHAR_RE = re.compile(r"\w")
_BEARER_RE = re.compile(r"(?i)\b(?P<word>bearer)(?P<sep>\s++)(?P<value>[A-Za-z0-9._~+/=\-]{4,})")
# "(?<![A-Za-z0-9_\-]sk-)" after the literal = "sk-" not preceded by a token character.
_TOKEN_SHAPES: tuple[tuple[str, tuple[str, ...], re.Pattern[str]], ...] = (
    ("token_openai", ("sk-",), re.compile(r"sk-(?<![A-Za-z0-9_\-]sk-)[A-Za-z0-9_\-]{20,}")),
    ("token_huggingface", ("hf_",), re.compile(r"hf_(?<![A-Za-z0-9_\-]hf_)[A-Za-z0-9]{20,}")),
    (
        "token_github",
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
        re.compile(r"g(?<![A-Za-z0-9_\-]g)(?:h[pousr]_[A-Za-z0-9]{20,}|ithub_pat_[A-Za-z0-9_]{20,})"),
    ),
    ("token_gitlab", ("glpat-",), re.compile(r"glpat-(?<![A-Za-z0-9_\-]glpat-)[A-Za-z0-9_\-]{20,}")),
    ("token_aws", ("AKIA", "ASIA"), re.compile(r"A(?<![A-Za-z0-9]A)(?:KIA|SIA)[A-Z0-9]{16}(?![A-Za-z0-9])")),
    ("token_slack", ("xox",), re.compile(r"xox(?<![A-Za-z0-9_\-]xox)[abposr]-[A-Za-z0-9\-]{10,}")),
    ("token_google", ("AIza",), re.compile(r"AIza(?<![A-Za-z0-9_\-]AIza)[0-9A-Za-z_\-]{35}")),
    (
        "token_jwt",
        ("eyJ",),
        re.compile(r"eyJ(?<![A-Za-z0-9_\-]eyJ)[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
    ),
)
# Settings: a *name run* (letters, digits, ``_ . -``) directly followed by the separator (an optional
# closing quote of a JSON key, then ``:`` or ``=``). The name is the run from its first letter or ``_``.
# The value is found by hand after the separator so that a non-secret ``a=b`` never swallows a secret
# ``password=x`` that follows it.
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_NAME_START_RE = re.compile(r"[0-9.\-]*+(?=[A-Za-z_])")
_RUN_SEP_RE = re.compile(r"[A-Za-z0-9_.\-]*+(?P<sep>[\"']?[ \t]*+[:=][ \t]*)?")
# Every secret-looking name contains one of these (case-insensitively): a text without any is left alone.
_SECRET_ROOTS = ("key", "token", "secret", "pass", "pwd", "cred", "auth", "bearer", "cookie")
_SECRET_ROOT_RE = re.compile("|".join(_SECRET_ROOTS), re.IGNORECASE)
_UNQUOTED_VALUE_RE = re.compile(r"[^\s\"',;&}\])]+")
# "-" first (fast literal scan); "(?<!\S-)" = the dash starts a whitespace-separated argument.
_FLAG_RE = re.compile(r"(?P<flag>-(?<!\S-)-?[A-Za-z][A-Za-z0-9_.\-]*+)(?P<sep>[ \t]++)(?P<value>[^\s\-][^\s]*)")
_NAME_CACHE_MAX = 4096
_secret_name_cache: dict[str, bool] = {}
_run_cache: dict[str, bool] = {}


def _secret_name_cached(name: str) -> bool:
    hit = _secret_name_cache.get(name)
    if hit is None:
        hit = is_secret_name(name)
        if len(name) <= 256 and len(_secret_name_cache) < _NAME_CACHE_MAX:
            _secret_name_cache[name] = hit
    return hit


class _Text:
    """The text being redacted plus its lower-cased copy, refreshed only when a rule changed the text."""

    __slots__ = ("_low", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self._low: str | None = None

    def set(self, text: str) -> None:
        if text is not self.text:
            self.text = text
            self._low = None

    @property
    def low(self) -> str:
        if self._low is None:
            self._low = self.text.lower()
        return self._low

    def has_secret_word(self) -> bool:
        low = self.low
        return any(root in low for root in _SECRET_ROOTS)


def _sub(
    pattern: re.Pattern[str], rule: str, repl: Callable[[re.Match[str]], str | None], needles: tuple[str, ...]
) -> Callable[[_Text, dict], None]:
    """A rule from a pattern and a replacement that returns None to leave a match alone.

    ``needles``: literals one of which every match contains; without any of them the pass is skipped."""

    def apply(t: _Text, counts: dict[str, int]) -> None:
        if needles and not any(n in t.text for n in needles):
            return

        def one(match: re.Match[str]) -> str:
            out = repl(match)
            if out is None:
                return match.group(0)
            counts[rule] = counts.get(rule, 0) + 1
            return out

        t.set(pattern.sub(one, t.text))

    return apply


def _private_key(m: re.Match[str]) -> str:
    return f"-----BEGIN {m.group(1)}PRIVATE KEY-----{REDACTED}-----END {m.group(1)}PRIVATE KEY-----"


def _scheme_starts(text: str, run_start: int, run_end: int) -> bool:
    """True when a URL scheme (a letter at a word boundary) can start inside ``text[run_start:run_end]``."""
    first = text[run_start]
    if first.isascii() and first.isalpha() and (run_start == 0 or not _WORDCHAR_RE.match(text, run_start - 1)):
        return True
    for i in range(run_start, run_end - 1):
        if text[i] in "+.-":
            nxt = text[i + 1]
            if nxt.isascii() and nxt.isalpha():
                return True
    return False


def _url_credentials(t: _Text, counts: dict[str, int]) -> None:
    text = t.text
    at = text.find("://")
    if at == -1:
        return
    out: list[str] = []
    pos = 0  # copied up to here
    floor = 0  # a scheme run never reaches back before the end of the previous match
    while at != -1:
        run_start = at
        while run_start > floor and text[run_start - 1] in _SCHEME_CHARS:
            run_start -= 1
        m = _USERINFO_RE.match(text, at + 3)
        if m is None or run_start == at or not _scheme_starts(text, run_start, at):
            at = text.find("://", at + 1)
            continue
        if m.group("userinfo") != REDACTED:
            out.append(text[pos : at + 3])
            out.append(f"{REDACTED}@")
            pos = m.end()
            counts["url_credentials"] = counts.get("url_credentials", 0) + 1
        floor = m.end()
        at = text.find("://", m.end())
    if out:
        out.append(text[pos:])
        t.set("".join(out))


def _bearer(t: _Text, counts: dict[str, int]) -> None:
    if "bearer" not in t.low:
        return
    n = 0

    def one(m: re.Match[str]) -> str:
        nonlocal n
        n += 1
        return f"{m.group('word')}{m.group('sep')}{REDACTED}"

    text = _BEARER_RE.sub(one, t.text)
    if n:
        counts["bearer"] = counts.get("bearer", 0) + n
        t.set(text)


def _secret_name_runs(t: _Text) -> list[tuple[int, int, int]]:
    """(run start, name end, separator end) of every name run holding a secret word and followed by a separator.

    Only runs holding a secret word can have a secret-looking name, so the runs are found from occurrences
    of the secret words (in the lower-cased copy when its positions are the text's); each run is walked
    once, however many secret words it holds."""
    text = t.text
    runs: list[tuple[int, int, int]] = []
    last_end = 0
    run_sep, chars = _RUN_SEP_RE.match, _NAME_CHARS
    for at in _secret_word_positions(t):
        if at < last_end:
            continue
        floor = last_end
        m = run_sep(text, at)
        end = m.start("sep")
        if end == -1:  # not followed by a separator: not a setting
            last_end = m.end()
            continue
        last_end = end
        start = at
        while start > floor and text[start - 1] in chars:
            start -= 1
        if _run_is_secret(text[start:end]):
            runs.append((start, end, m.end()))
    return runs


def _secret_word_positions(t: _Text) -> list[int]:
    """Sorted start positions of the secret words in the text (a superset is fine, a miss is not).

    ASCII text: ``str.find`` on the lower-cased copy (far faster than a case-insensitive regex). Other text:
    the case-insensitive regex on the text itself, whose positions are the text's."""
    if not t.text.isascii():
        return [m.start() for m in _SECRET_ROOT_RE.finditer(t.text)]
    low = t.low
    found: list[int] = []
    for root in _SECRET_ROOTS:
        find = low.find
        at = find(root)
        while at != -1:
            found.append(at)
            at = find(root, at + 1)
    found.sort()
    return found


def _run_is_secret(run: str) -> bool:
    """Whether a name run (letters, digits, ``_ . -``) names a secret: its name starts at the first letter or ``_``."""
    hit = _run_cache.get(run)
    if hit is None:
        lead = _NAME_START_RE.match(run)
        hit = lead is not None and is_secret_name(run[lead.end() :])
        if len(run) <= 256 and len(_run_cache) < _NAME_CACHE_MAX:
            _run_cache[run] = hit
    return hit


def _key_value(t: _Text, counts: dict[str, int]) -> None:
    if not t.has_secret_word():
        return
    text = t.text
    out: list[str] = []
    append = out.append
    pos = 0
    search_from = 0
    fired = 0
    for run_start, _name_end, sep_end in _secret_name_runs(t):
        if run_start < search_from:
            continue  # inside a value already redacted
        search_from = start = sep_end
        if text.startswith(REDACTED, start):
            continue
        end = _value_end(text, start)
        if end is None:
            continue
        # an unquoted value never starts with a quote, so only a quoted one keeps its quotes
        quoted = text[start] in "\"'"
        replacement = _quoted_redaction(text[start:end]) if quoted else REDACTED
        # "Authorization: Bearer x": the secret is the word after the scheme (an unquoted value holds no
        # quote to strip, so it is a scheme only when it is as short as one).
        if (quoted or end - start <= _LONGEST_SCHEME) and text[start:end].strip("\"'").lower() in _AUTH_SCHEMES:
            rest = _UNQUOTED_VALUE_RE.match(text, end + 1) if text.startswith(" ", end) else None
            if rest is None or rest.group(0) == REDACTED:
                continue
            start, end, replacement = rest.start(), rest.end(), REDACTED
        append(text[pos:start])
        append(replacement)
        fired += 1
        pos = search_from = end
    if out:
        counts["key_value"] = counts.get("key_value", 0) + fired
        append(text[pos:])
        t.set("".join(out))


def _value_end(text: str, start: int) -> int | None:
    """End of the value starting at ``start``: a quoted string (kept whole) or an unquoted run."""
    if start >= len(text):
        return None
    quote = text[start]
    if quote in "\"'":
        close = text.find(quote, start + 1)
        newline = text.find("\n", start + 1, close if close != -1 else len(text))
        if close == -1 or newline != -1:
            close = newline if newline != -1 else len(text)
            return close if close > start + 1 else None
        return close + 1
    m = _UNQUOTED_VALUE_RE.match(text, start)
    return m.end() if m else None


def _quoted_redaction(value: str) -> str:
    if len(value) >= 2 and value[0] in "\"'" and value[-1] == value[0]:
        return f"{value[0]}{REDACTED}{value[0]}"
    return REDACTED


def _flag_value(t: _Text, counts: dict[str, int]) -> None:
    if not t.has_secret_word():
        return
    n = 0

    def one(m: re.Match[str]) -> str:
        nonlocal n
        if not _secret_name_cached(m.group("flag")) or m.group("value").startswith(REDACTED):
            return m.group(0)
        n += 1
        return f"{m.group('flag')}{m.group('sep')}{REDACTED}"

    text = _FLAG_RE.sub(one, t.text)
    if n:
        counts["flag_value"] = counts.get("flag_value", 0) + n
        t.set(text)


_TEXT_RULES: tuple[Callable[[_Text, dict], None], ...] = (
    _sub(_PRIVATE_KEY_RE, "private_key", _private_key, ("-----BEGIN ",)),
    _url_credentials,
    _bearer,
    *(_sub(pattern, name, lambda m: REDACTED, needles) for name, needles, pattern in _TOKEN_SHAPES),
    _key_value,
    _flag_value,
)


# Lower-cased literals one of which every rule needs (a superset check: lower-casing only adds matches).
_ANY_TRIGGER_RE = re.compile(
    "|".join(
        re.escape(x)
        for x in (
            *_SECRET_ROOTS,
            "-----begin ",
            "://",
            "sk-",
            "hf_",
            "gh",
            "github_pat_",
            "glpat-",
            "akia",
            "asia",
            "xox",
            "aiza",
            "eyj",
        )
    )
)
_SHORT = 512


def redact_text(text: str) -> tuple[str, dict[str, int]]:
    """Apply every rule to free text; return the redacted text and how often each rule fired.

    Linear in the length of the text (see the notes above the rules)."""
    counts: dict[str, int] = {}
    if not isinstance(text, str) or not text:
        return (text if isinstance(text, str) else ""), counts
    t = _Text(text)
    if len(text) <= _SHORT and not _ANY_TRIGGER_RE.search(t.low):
        return text, counts  # most arguments and short lines: one search instead of every rule's checks
    for rule in _TEXT_RULES:
        rule(t, counts)
    return t.text, counts


# --------------------------------------------------------------------------- argv


def redact_argv_counts(argv: Sequence[str]) -> tuple[str, dict[str, int]]:
    """``redact_argv`` plus the per-rule counts (for bundles' redaction reports)."""
    counts: dict[str, int] = {}
    args = [a if isinstance(a, str) else str(a) for a in argv]
    joined = " ".join(args)
    if not _ANY_TRIGGER_RE.search(joined.lower()):
        return joined, counts  # no rule and no flag can fire: one search instead of one redact_text per argument
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
