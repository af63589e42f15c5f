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
# * settings (``name=value``) are found from their separators, read backwards (one ``findall`` on the
#   reversed text), not by trying every position as the start of a name;
# * a rule whose literal cannot occur in the text (no ``sk-``, no ``://``, no secret word) is skipped.
#
# And no rule runs Python per match when a text is nothing but secrets (``token=x&`` a thousand times):
# replacements are built in C (``re.subn`` with a literal, ``re.split`` then one ``join``), and Python only
# judges each distinct name once.
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
# "://" then userinfo then "@": only these candidates reach Python (a "://" without userinfo costs nothing).
# Linear: userinfo holds no "/", so a scan never runs past the next "://".
_USERINFO_RE = re.compile(r"://(?P<userinfo>[^/\s@:]*+:[^/\s@]*+)@")
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
# Every secret-looking name contains one of these (case-insensitively): a text without any is left alone.
_SECRET_ROOTS = ("key", "token", "secret", "pass", "pwd", "cred", "auth", "bearer", "cookie")


def _any_case(word: str) -> str:
    """``word`` spelled case by case in ASCII (``[kK][eE][yY]``): re.IGNORECASE would also take the Kelvin
    sign for a "k", which no name run holds."""
    return "".join(f"[{c}{c.upper()}]" for c in word)


def _setting_re(roots: str, name_char: str) -> re.Pattern[str]:
    """The last secret word of a name run, the rest of the run, then the separator.

    Only the *last* secret word of a run can match (the run after it may not start another one), so a run
    yields at most one match and a failed match never rescans the run: each character is looked at a fixed
    number of times, however many secret words a run holds. The pattern starts with the words' first
    letters, so the regex engine skips ahead between them in C."""
    return re.compile(rf"(?:{roots})(?:(?!{roots}){name_char})*+([\"']?[ \t]*+[:=][ \t]*)")


# ASCII text is searched in its lower-cased copy (same positions); other text in itself (``_any_case``).
_SETTING_LOW_RE = _setting_re("|".join(_SECRET_ROOTS), r"[a-z0-9_.\-]")
_SETTING_ANY_RE = _setting_re("|".join(map(_any_case, _SECRET_ROOTS)), r"[A-Za-z0-9_.\-]")
_UNQUOTED_VALUE_RE = re.compile(r"[^\s\"',;&}\])]+")


# The name runs followed by a separator, found backwards: in the reversed text a setting starts at its
# separator (a character the regex engine skips to in C) and its name run is read whole, so one ``findall``
# gives every such name with no Python per setting; only the distinct names are then looked at.
_SETTING_NAMES_REVERSED_RE = re.compile(r"[:=][ \t]*+[\"']?([A-Za-z0-9_.\-]++)")
_ANY_ROOT_RE = re.compile("|".join(map(_any_case, _SECRET_ROOTS)))
# At most this many distinct secret names, none longer than this, take the one-split path, and only when the
# text has this many settings per name (compiling the pattern must pay off); others go through the general
# loop. Why: the split tries every name at each position where one could start, so its cost grows with their
# number and length.
_FAST_NAMES_MAX = 64
_FAST_NAME_LEN_MAX = 64
_FAST_MIN_SETTINGS_PER_NAME = 32
_fast_patterns: dict[frozenset[str], re.Pattern[str]] = {}
# A setting's value: a quoted string up to its closing quote (or, unclosed, to the end of its line; a lone
# opening quote is taken too and then left alone), else an unquoted run.
_VALUE_RE = re.compile(r"\"[^\"\n]*+\"?|'[^'\n]*+'?|[^\s\"',;&}\])]+")
# "-" first (fast literal scan); "(?<!\S-)" = the dash starts a whitespace-separated argument.
_FLAG_RE = re.compile(r"(?P<flag>-(?<!\S-)-?[A-Za-z][A-Za-z0-9_.\-]*+)(?P<sep>[ \t]++)(?P<value>[^\s\-][^\s]*)")
_NAME_CACHE_MAX = 4096
_secret_name_cache: dict[str, bool] = {}
_run_cache: dict[str, bool] = {}
# Setting names (reversed, as the settings scan reads them) already judged, and those found secret.
_judged_reversed: set[str] = set()
_secret_reversed: set[str] = set()


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


def _sub_redacted(pattern: re.Pattern[str], rule: str, needles: tuple[str, ...]) -> Callable[[_Text, dict], None]:
    """A rule that replaces every whole match with ``REDACTED``.

    Why not ``_sub``: a literal replacement lets ``re.subn`` build the output in C, with no Python call per
    match, which is what keeps a text made of nothing but tokens fast."""

    def apply(t: _Text, counts: dict[str, int]) -> None:
        text = t.text
        if not any(n in text for n in needles):
            return
        out, n = pattern.subn(REDACTED, text)
        if n:
            counts[rule] = counts.get(rule, 0) + n
            t.set(out)

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
    if "://" not in text:
        return
    out: list[str] = []
    pos = 0  # copied up to here
    floor = 0  # a scheme run never reaches back before the end of the previous match
    for m in _USERINFO_RE.finditer(text):
        at = run_start = m.start()
        while run_start > floor and text[run_start - 1] in _SCHEME_CHARS:
            run_start -= 1
        if run_start == at or not _scheme_starts(text, run_start, at):
            continue
        if m.group("userinfo") != REDACTED:
            out.append(text[pos : at + 3])
            out.append(f"{REDACTED}@")
            pos = m.end()
            counts["url_credentials"] = counts.get("url_credentials", 0) + 1
        floor = m.end()
    if out:
        out.append(text[pos:])
        t.set("".join(out))


def _bearer(t: _Text, counts: dict[str, int]) -> None:
    if "bearer" not in t.low:
        return
    # split() keeps the three groups between the unmatched pieces: [text, word, sep, value, text, ...]; the
    # values are replaced by a slice assignment, so no Python runs per match.
    pieces = _BEARER_RE.split(t.text)
    n = len(pieces) // 4
    if n:
        pieces[3::4] = [REDACTED] * n
        counts["bearer"] = counts.get("bearer", 0) + n
        t.set("".join(pieces))


def _run_is_secret(run: str) -> bool:
    """Whether a name run (letters, digits, ``_ . -``) names a secret: its name starts at the first letter or ``_``."""
    hit = _run_cache.get(run)
    if hit is None:
        lead = _NAME_START_RE.match(run)
        # every secret name holds a secret word: the search spares is_secret_name on most names
        hit = lead is not None and _ANY_ROOT_RE.search(run) is not None and is_secret_name(run[lead.end() :])
        if len(run) <= 256 and len(_run_cache) < _NAME_CACHE_MAX:
            _run_cache[run] = hit
    return hit


def _key_value(t: _Text, counts: dict[str, int]) -> None:
    """``name=value`` settings whose name is secret-looking: the value goes.

    Why two paths: a text made of nothing but secret settings (``token=x&token=y&...``) must not cost
    Python work per setting. The fast path finds the distinct names with one ``findall``; when none is
    secret the text is done, and when a few are, one split on a pattern made of exactly those names does
    every redaction in C. A value the fast path cannot judge on its own (a scheme word as in
    ``Authorization: Bearer x``, an unclosed quote, a value already redacted) sends the text to the
    general loop, which gives the same result one setting at a time."""
    text = t.text
    if "=" not in text and ":" not in text:
        return  # no separator, no setting (a cheap check that spares the scans below)
    if not t.has_secret_word():
        return
    found = _SETTING_NAMES_REVERSED_RE.findall(text[::-1])
    reversed_names = set(found)
    # Set operations in C against the names already judged; Python only for names never seen before.
    for name in reversed_names - _judged_reversed:
        if len(_judged_reversed) >= _NAME_CACHE_MAX:
            break  # the rest are judged below, one at a time
        _judged_reversed.add(name)
        if _run_is_secret(name[::-1]):
            _secret_reversed.add(name)
    secret_reversed = reversed_names & _secret_reversed
    if len(_judged_reversed) >= _NAME_CACHE_MAX:
        secret_reversed |= {r for r in reversed_names - _judged_reversed if _run_is_secret(r[::-1])}
    if not secret_reversed:
        return
    secret = frozenset(r[::-1] for r in secret_reversed)
    # The one-split path compiles a pattern for this set of names (about half a millisecond a name): worth it
    # when the pattern is cached or the text holds many settings per name, else the general loop is cheaper.
    fast = secret in _fast_patterns or (
        len(secret) <= _FAST_NAMES_MAX
        and max(map(len, secret)) <= _FAST_NAME_LEN_MAX
        and len(found) >= _FAST_MIN_SETTINGS_PER_NAME * len(secret)
    )
    if not fast or not _key_value_fast(t, counts, secret):
        _key_value_general(t, counts)


def _secret_settings_re(names: frozenset[str]) -> re.Pattern[str]:
    """A pattern for settings of exactly these names: groups (name and separator)(unquoted value)(quoted value)
    (a quote that opens no closed value). Each name is checked to start a run by a look-behind placed after
    it, so the pattern still starts with literals."""
    pattern = _fast_patterns.get(names)
    if pattern is None:
        alternatives = "|".join(
            f"{re.escape(n)}(?<![A-Za-z0-9_.\\-]{re.escape(n)})" for n in sorted(names, key=len, reverse=True)
        )
        pattern = re.compile(
            rf"((?:{alternatives})[\"']?[ \t]*+[:=][ \t]*+)"
            r"(?:([^\s\"',;&}\])]++)|(\"[^\"\n]*+\"|'[^'\n]*+')|([\"']))?"
        )
        if len(_fast_patterns) >= 64:
            _fast_patterns.clear()
        _fast_patterns[names] = pattern
    return pattern


_DOUBLE_QUOTED_REDACTED = f'"{REDACTED}"'
_SINGLE_QUOTED_REDACTED = f"'{REDACTED}'"


def _key_value_fast(t: _Text, counts: dict[str, int], names: frozenset[str]) -> bool:
    """Redact the settings of ``names`` with one split; False (text untouched) when a value needs the
    general loop's judgement."""
    pieces = _secret_settings_re(names).split(t.text)
    # pieces: [text, head, unquoted, quoted, lone quote, text, head, ...]
    found = len(pieces) // 5
    unquoted, quoted, lone = pieces[2::5], pieces[3::5], pieces[4::5]
    if lone.count(None) != found:
        return False
    # Values left as they are, uncounted, as the general loop leaves them: exactly REDACTED (redacted before),
    # and a scheme word whose secret after it was redacted already (``Authorization: Bearer <redacted>``).
    kept = {REDACTED}
    for value in set(unquoted):
        if value is None or value == REDACTED:
            continue
        if value.startswith(REDACTED):
            return False  # it may hold another setting, which the general loop finds
        if len(value) <= _LONGEST_SCHEME and value.lower() in _AUTH_SCHEMES:
            kept.add(value)
    if len(kept) > 1:
        last = len(pieces) - 1
        for k, value in enumerate(unquoted):
            if value in kept and value != REDACTED and not _redacted_follows(pieces[5 * k + 5], 5 * k + 5 == last):
                return False  # a scheme word before a secret: the general loop redacts the word after it
    for value in set(quoted):
        if value is not None and value.strip("\"'").lower() in _AUTH_SCHEMES:
            return False
    fired = 2 * found - quoted.count(None) - sum(unquoted.count(v) for v in (None, *kept))
    if fired:
        pieces[2::5] = ["" if v is None else v if v in kept else REDACTED for v in unquoted]
        pieces[3::5] = ["" if v is None else _DOUBLE_QUOTED_REDACTED if v[0] == '"' else _SINGLE_QUOTED_REDACTED for v in quoted]
        pieces[4::5] = [""] * found
        counts["key_value"] = counts.get("key_value", 0) + fired
        t.set("".join(pieces))
    return True


_SPACE_REDACTED = " " + REDACTED


def _redacted_follows(after: str, at_end: bool) -> bool:
    """Whether the text after a scheme word is one space and then exactly REDACTED as a whole value (what
    follows ends a value), so the general loop would leave the setting alone. ``after`` runs to the next
    setting's name, or to the end of the text when ``at_end``."""
    if not after.startswith(_SPACE_REDACTED):
        return False
    if len(after) == len(_SPACE_REDACTED):
        return at_end  # else the next setting's name follows directly and the value runs on into it
    nxt = after[len(_SPACE_REDACTED)]
    return nxt.isspace() or nxt in "\"',;&}])"


def _key_value_general(t: _Text, counts: dict[str, int]) -> None:
    """The settings one at a time (see ``_setting_re``): Python runs once per setting, never per character."""
    text = t.text
    matches = _SETTING_LOW_RE.finditer(t.low) if text.isascii() else _SETTING_ANY_RE.finditer(text)
    out: list[str] = []
    append = out.append
    pos = search_from = 0
    chars, run_get, value_at, redacted = _NAME_CHARS, _run_cache.get, _VALUE_RE.match, REDACTED
    for m in matches:
        start, sep_end = m.span()
        if start < search_from:
            continue  # inside a value already redacted
        while start and text[start - 1] in chars:  # back to the start of the name run
            start -= 1
        run = text[start : m.start(1)]
        secret = run_get(run)
        if secret is None:
            secret = _run_is_secret(run)
        if not secret:
            continue
        search_from = sep_end
        vm = value_at(text, sep_end)
        if vm is None:
            continue
        value = vm.group()
        if value.startswith(redacted):
            continue
        end = vm.end()
        first = value[0]
        if first == '"' or first == "'":
            if len(value) == 1:
                continue  # an opening quote at the end of the line: nothing to redact
            replacement = f"{first}{redacted}{first}" if value[-1] == first else redacted
            is_scheme = value.strip("\"'").lower() in _AUTH_SCHEMES
        else:
            replacement = redacted
            # an unquoted value holds no quote, so it is a scheme only when it is as short as one
            is_scheme = len(value) <= _LONGEST_SCHEME and value.lower() in _AUTH_SCHEMES
        if is_scheme:
            # "Authorization: Bearer x": the secret is the word after the scheme.
            rest = _UNQUOTED_VALUE_RE.match(text, end + 1) if text.startswith(" ", end) else None
            if rest is None or rest.group(0) == redacted:
                continue
            sep_end, end, replacement = rest.start(), rest.end(), redacted
        append(text[pos:sep_end])
        append(replacement)
        pos = search_from = end
    if out:
        counts["key_value"] = counts.get("key_value", 0) + len(out) // 2
        append(text[pos:])
        t.set("".join(out))


def _flag_value(t: _Text, counts: dict[str, int]) -> None:
    if not t.has_secret_word():
        return
    # [text, flag, sep, value, text, ...]: one split in C, then one cached decision per flag.
    pieces = _FLAG_RE.split(t.text)
    if len(pieces) == 1:
        return
    n = 0
    cache_get = _secret_name_cache.get
    for i in range(1, len(pieces), 4):
        flag = pieces[i]
        secret = cache_get(flag)
        if secret is None:
            secret = _secret_name_cached(flag)
        if secret and not pieces[i + 2].startswith(REDACTED):
            pieces[i + 2] = REDACTED
            n += 1
    if n:
        counts["flag_value"] = counts.get("flag_value", 0) + n
        t.set("".join(pieces))


_TEXT_RULES: tuple[Callable[[_Text, dict], None], ...] = (
    _sub(_PRIVATE_KEY_RE, "private_key", _private_key, ("-----BEGIN ",)),
    _url_credentials,
    _bearer,
    *(_sub_redacted(pattern, name, needles) for name, needles, pattern in _TOKEN_SHAPES),
    _key_value,
    _flag_value,
)


# Lower-cased literals one of which every rule needs (a superset check: lower-casing only adds matches).
_TRIGGERS = (
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


def _has_trigger(low: str) -> bool:
    """Whether a lower-cased text holds a literal some rule needs. ``in`` per literal (a C scan each) beats
    one alternation regex, which tries every branch at every position."""
    # A plain loop: any() over a generator costs more than the scans themselves on short texts.
    for x in _TRIGGERS:  # noqa: SIM110
        if x in low:
            return True
    return False


_SHORT = 512


def redact_text(text: str) -> tuple[str, dict[str, int]]:
    """Apply every rule to free text; return the redacted text and how often each rule fired.

    Linear in the length of the text (see the notes above the rules)."""
    counts: dict[str, int] = {}
    if not isinstance(text, str) or not text:
        return (text if isinstance(text, str) else ""), counts
    t = _Text(text)
    if len(text) <= _SHORT and not _has_trigger(t.low):
        return text, counts  # most arguments and short lines: one search instead of every rule's checks
    for rule in _TEXT_RULES:
        rule(t, counts)
    return t.text, counts


# --------------------------------------------------------------------------- argv


def redact_argv_counts(argv: Sequence[str]) -> tuple[str, dict[str, int]]:
    """``redact_argv`` plus the per-rule counts (for bundles' redaction reports)."""
    counts: dict[str, int] = {}
    try:
        joined = " ".join(argv)  # in C; a non-string argument (rare) makes it raise
        args = argv if isinstance(argv, list) else list(argv)
    except TypeError:
        args = [a if isinstance(a, str) else str(a) for a in argv]
        joined = " ".join(args)
    joined_low = joined.lower()
    present = [x for x in _TRIGGERS if x in joined_low]
    if not present:
        return joined, counts  # no rule and no flag can fire: one search instead of one redact_text per argument
    # An argument without any of the literals present in the whole line is left as it is, by every rule and
    # by the flag checks below (a secret flag name, "authorization" and "bearer" each hold one).
    lows = [a.lower() for a in args]
    hot = [any(x in low for x in present) for low in lows]
    redact_next = [False] * len(args)
    for i, arg in enumerate(args):
        if i + 1 >= len(args):
            break
        if not hot[i]:
            continue
        lowered = lows[i]
        nxt = args[i + 1]
        if arg.startswith("-") and "=" not in arg and len(arg) > 1 and _secret_name_cached(arg):
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
        if not hot[i]:
            out.append(arg)
            continue
        redacted, arg_counts = redact_text(arg)
        for rule, n in arg_counts.items():
            counts[rule] = counts.get(rule, 0) + n
        out.append(redacted)
    return " ".join(out), counts


def redact_argv(argv: Sequence[str]) -> str:
    """Join argv for display (space-separated, like ps) with secret argument values replaced by ``<redacted>``."""
    return redact_argv_counts(argv)[0]
