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

The rules run in a ``RedactionEngine``, which owns everything they remember between texts (names already
judged, patterns compiled for a text's secret names): no module-level state changes, so two engines never
share memory and a test can start from a fresh one. ``redact_text``, ``redact_argv`` and
``redact_argv_counts`` use one default engine; ``is_secret_name`` is a pure function.
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
#
# Every rule is linear in the text by construction, because one process with a 20 000-character argument
# or one long log line must not stall the 1 Hz sampler or a bundle:
#
# * a rule only starts where its token can start: literal prefixes come first in the pattern (the regex
#   engine then skips ahead with a fast literal scan) and "not inside a longer word" is checked by a
#   fixed-width look-behind *after* the literal, never by trying every position of a long word;
# * runs of word characters are consumed possessively (``*+``), so a failed match never backtracks
#   over them;
# * settings (``name=value``) are found from their separators, read backwards (a ``findall`` per separator
#   on the reversed text), not by trying every position as the start of a name;
# * a rule whose literal cannot occur in the text (no ``sk-``, no ``://``, no secret word) is skipped, and so
#   is one whose character is absent (no ``J``, no JWT: one memchr instead of a scan for a literal).
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
        ("gh", "github_pat_"),  # "gh" starts every other GitHub shape: two scans instead of six
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
# The value follows the separator; a non-secret ``a=b`` never swallows a secret ``password=x`` after it,
# because only settings with a secret name are matched at all.
#
# Whether a run names a secret is itself a regular expression (``_SECRET_RUN``), built from the word lists
# above, so a whole text of settings is redacted by one ``split`` with no Python per setting, whatever the
# names. It reads the run word by word exactly as ``_words`` splits it, each word once, and gives the same
# answer as ``is_secret_name`` on the name (tests compare the two on generated names):
#
# * words are ``[A-Z]+(?![a-z])`` (atomic, as ``findall`` takes it), ``[A-Z]?[a-z]+``, digits, or a lone
#   ``_ . -`` that separates them;
# * the words before the first secret one are consumed (possessively) while each is checked not to be
#   secret, then one secret word, then the rest of the run while each word is checked not to be a
#   descriptor that only ``_ . -`` and digits follow (the last word);
# * a secret word is one of ``_SECRET_WORDS`` in one of the three spellings a word can have (lower,
#   Capitalized, UPPER), or a word that ends in a strong suffix (a look-behind after the word);
# * the name (after digits, ``.`` and ``-`` that lead the run) is not one of ``_NOT_SECRET_NAMES``.
#
# Linear: every word is read a fixed number of times (once to consume it, once per look-ahead at its
# start, whose alternatives fail on their first letters), and nothing is retried after a failure.
_NAME_CHAR = r"[A-Za-z0-9_.\-]"
_NOT_NAME_CHAR_AFTER = r"(?![A-Za-z0-9_.\-])"
# Every secret-looking name contains one of these (case-insensitively): a text without any is left alone.
_SECRET_ROOTS = ("key", "token", "secret", "pass", "pwd", "cred", "auth", "bearer", "cookie")


def _any_case(word: str) -> str:
    """``word`` spelled case by case in ASCII (``[kK][eE][yY]``): re.IGNORECASE would also take the Kelvin
    sign for a "k", which no name run holds."""
    return "".join(f"[{c}{c.upper()}]" for c in word)


def _spellings(words: frozenset[str] | tuple[str, ...]) -> tuple[str, str, str]:
    """Alternations of ``words`` as a word of a name can be spelled: lower, Capitalized, UPPER."""

    def alternation(ws: list[str]) -> str:
        return "|".join(sorted(ws, key=len, reverse=True))

    return (
        alternation([w.lower() for w in words]),
        alternation([w.capitalize() for w in words]),
        alternation([w.upper() for w in words]),
    )


def _ends_with(words: list[str]) -> str:
    """Look-behinds (one per length: each must be fixed-width) that hold when the text so far ends with a word."""
    by_length: dict[int, list[str]] = {}
    for w in words:
        by_length.setdefault(len(w), []).append(w)
    return "|".join(f"(?<={'|'.join(sorted(ws))})" for _, ws in sorted(by_length.items()))


_WORD = r"(?>[A-Z]+(?![a-z]))|[A-Z]?[a-z]++|[0-9]++|[_.\-]"
_SECRET_LOW, _SECRET_CAP, _SECRET_UP = _spellings(_SECRET_WORDS)
# At the start of a word: the word is secret. An UPPER word ends where no lower-case letter follows and
# the next capital does not continue it (``KEYAb`` is KEY, Ab; ``KEYS`` is one word).
_SECRET_WORD_AT = (
    rf"(?:(?:{_SECRET_LOW}|{_SECRET_CAP})(?![a-z])"
    rf"|(?:{_SECRET_UP})(?![a-z])(?![A-Z](?![a-z]))"
    rf"|[A-Z]?[a-z]++(?:{_ends_with(list(_STRONG_SUFFIXES))})"
    rf"|(?>[A-Z]+(?![a-z]))(?:{_ends_with([s.upper() for s in _STRONG_SUFFIXES])}))"
)
_TAIL_LOW, _TAIL_CAP, _TAIL_UP = _spellings(_DESCRIPTOR_TAILS)
# At the start of a word: the word is a descriptor and the last word of the run.
# The first look-ahead (only letters, then no letter to the end of the run) spares the descriptors on every
# word but the last ones.
_LAST_WORD_DESCRIBES_AT = (
    rf"(?=[A-Za-z]++[0-9_.\-]*+{_NOT_NAME_CHAR_AFTER})"
    rf"(?:{_TAIL_LOW}|{_TAIL_CAP}|{_TAIL_UP})[0-9_.\-]*+{_NOT_NAME_CHAR_AFTER}"
)
# Every secret name holds a root (``_SECRET_ROOTS``): a run without one is turned down by a quick scan (one
# character class per position) before its words are read.
_ROOT_FIRST = "".join(sorted({c for r in _SECRET_ROOTS for c in (r[0], r[0].upper())}))
# The runs of words are atomic groups around a greedy repeat, not possessive repeats (``(?:...)*+``): the two
# mean the same, but CPython before 3.11.5 matches a possessive repeat of a group holding alternatives wrongly
# (it found no secret name at all in ``--api-key=...`` on Debian 12's Python 3.11.2, so nothing was redacted).
_SECRET_RUN = (
    r"[0-9.\-]*+"
    rf"(?=[A-Za-z0-9_.\-]*?(?=[{_ROOT_FIRST}])(?:{'|'.join(map(_any_case, _SECRET_ROOTS))}))"
    rf"(?!(?:{'|'.join(map(_any_case, sorted(_NOT_SECRET_NAMES)))}){_NOT_NAME_CHAR_AFTER})"
    rf"(?>(?:(?!{_SECRET_WORD_AT})(?:{_WORD}))*)"
    rf"(?={_SECRET_WORD_AT})(?:{_WORD})"
    rf"(?>(?:(?!{_LAST_WORD_DESCRIBES_AT})(?:{_WORD}))*)"
    rf"{_NOT_NAME_CHAR_AFTER}"
)
_SECRET_RUN_RE = re.compile(_SECRET_RUN)

# The separator, then the value, in groups that say what becomes of it (the order of the alternatives is
# the order of the decisions): a value that starts with REDACTED was redacted before and is left alone; an
# auth scheme (``Authorization: Bearer x``) keeps the scheme and loses the word after it, unless that word
# is REDACTED or missing; a closed quoted value keeps its quotes; an unquoted value, or a quoted one left
# open (to the end of its line), goes whole; a lone quote at the end of a line is left.
# Groups: 1 name and separator, 2 scheme and space (kept), 3 the word after it, 4 "...", 5 '...', 6 the rest.
_UNQUOTED = r"""[^\s"',;&}\])]"""
_UNQUOTED_ENDS = rf"(?!{_UNQUOTED})"
# ``value.lower()`` is the test: the Kelvin sign lowers to "k" (a test checks no other character lowers into
# an ASCII letter).
_SCHEME = "|".join("".join("[kK\u212a]" if c == "k" else f"[{c}{c.upper()}]" for c in s) for s in sorted(_AUTH_SCHEMES))
_SCHEME_FIRST = "".join(sorted({c for s in _AUTH_SCHEMES for c in (s[0], s[0].upper())}))
_REDACTED_ESC = re.escape(REDACTED)
_SEPARATOR = r"[\"']?[ \t]*+[:=][ \t]*+"


def _value(mark: str = "") -> str:
    """The value part of a settings pattern. ``mark``: a pattern for what may stand before a name run inside
    a value (``_key_value_marked``), so that a scheme word still reads as one when a mark precedes it."""
    scheme = rf"{mark}(?:{_SCHEME})"
    value = rf"(?:{scheme}{_UNQUOTED_ENDS}|\"'*+{scheme}'*+\"|'\"*+{scheme}\"*+')"
    alone = rf"(?:{scheme}{_UNQUOTED_ENDS}|\"'*+{scheme}'*+(?:[\"\n]|\Z)|'\"*+{scheme}\"*+(?:['\n]|\Z))"
    return (
        rf"(?:(?={_REDACTED_ESC})"
        rf"|(?=[\"']*+{mark}[{_SCHEME_FIRST}])"  # a quick look at the first letter spares the schemes on most values
        rf"(?:({value} )(?!{_REDACTED_ESC}{_UNQUOTED_ENDS})({_UNQUOTED}++)|(?={alone}))"
        rf"|(\"[^\"\n]*+\")|('[^'\n]*+')|({_UNQUOTED}++|\"[^\"\n]++|'[^'\n]++))?"
    )


_VALUE = _value()
_GROUPS = 6
# Any secret setting, judged by the pattern: it starts at the start of a run (a look-behind) that a separator
# follows (a quick look-ahead before the words are read). The regex engine tries every position here, so
# this pattern serves texts whose names are many or new; known names take ``_named_settings_re``.
_SECRET_SETTING_RE = re.compile(rf"((?<!{_NAME_CHAR})(?={_NAME_CHAR}++[\"']?[ \t]*+[:=]){_SECRET_RUN}{_SEPARATOR}){_VALUE}")

# The name runs followed by a separator, found backwards: in the reversed text a setting starts at its
# separator (a character the regex engine skips to in C) and its name run is read whole, so one ``findall``
# gives every such name with no Python per setting; only the distinct names are then looked at.
_SETTING_NAMES_REVERSED_RE = re.compile(r"[:=][ \t]*+[\"']?([A-Za-z0-9_.\-]++)")
# The same scan from one separator only. A pattern that starts with a literal is searched for by a fast C scan
# (memchr-like), one that starts with a class ``[:=]`` by testing every character (ten times slower on a log
# line). No match holds a separator, so every separator starts its own match whichever scan reads it: the
# names of the two one-separator scans together are exactly those of the two-separator scan.
_SETTING_NAMES_AFTER_RE = {sep: re.compile(rf"{sep}[ \t]*+[\"']?([A-Za-z0-9_.\-]++)") for sep in ("=", ":")}
# A pattern made of the text's secret names (literals first, so the regex engine skips between them) is
# faster than ``_SECRET_SETTING_RE``; it is compiled (about half a millisecond a name) only for at most this
# many names, none longer than this, and only when the text has this many settings per name, or it is cached
# (an engine keeps at most ``_FAST_PATTERNS_MAX`` of them).
_FAST_NAMES_MAX = 64
_FAST_NAME_LEN_MAX = 64
_FAST_MIN_SETTINGS_PER_NAME = 32
_FAST_PATTERNS_MAX = 64
# The same backward scan as a split: [text, separator, name, "" (where a mark goes), text, ...].
_SETTING_NAMES_REVERSED_SPLIT_RE = re.compile(r"([:=][ \t]*+[\"']?)([A-Za-z0-9_.\-]++)()")
# ... from one separator, for a text that holds only that one (literal first: the fast scan above).
_SETTING_NAMES_AFTER_SPLIT_RE = {sep: re.compile(rf"({sep}[ \t]*+[\"']?)([A-Za-z0-9_.\-]++)()") for sep in ("=", ":")}
# Names one a line: each line is the name when it is secret, else "" (the second alternative eats it).
_SECRET_RUN_LINES_RE = re.compile(rf"(?:({_SECRET_RUN})|[^\n]*+)\n")
# Characters that mark secret settings (``_key_value_marked``); the first one a text does not hold is used.
_MARKS = ("\x00", "\x01", "\x02", "\x03", "\ufdd0", "\ufdd1", "\ufdd2", "\ufdd3")


def _marked_settings_re(mark: str) -> re.Pattern[str]:
    """A setting that starts with ``mark``, in ``_SECRET_SETTING_RE``'s groups (the mark is in group 1).
    Compiled on demand (an engine keeps what it compiled): most texts need only the first mark."""
    mark_re = re.escape(mark)
    return re.compile(rf"({mark_re}{_NAME_CHAR}++{_SEPARATOR}){_value(f'{mark_re}?')}")


# "-" first (fast literal scan); "(?<!\S-)" = the dash starts a whitespace-separated argument.
_FLAG_RE = re.compile(r"(?P<flag>-(?<!\S-)-?[A-Za-z][A-Za-z0-9_.\-]*+)(?P<sep>[ \t]++)(?P<value>[^\s\-][^\s]*)")
# How many names an engine remembers judging (flags and argv names; setting names, reversed, apart).
_NAME_CACHE_MAX = 4096


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


def _sub(pattern: re.Pattern[str], rule: str, repl: Callable[[re.Match[str]], str | None]) -> Callable[[_Text, dict], None]:
    """A rule from a pattern and a replacement that returns None to leave a match alone."""

    def apply(t: _Text, counts: dict[str, int]) -> None:
        def one(match: re.Match[str]) -> str:
            out = repl(match)
            if out is None:
                return match.group(0)
            counts[rule] = counts.get(rule, 0) + 1
            return out

        t.set(pattern.sub(one, t.text))

    return apply


def _sub_redacted(pattern: re.Pattern[str], rule: str) -> Callable[[_Text, dict], None]:
    """A rule that replaces every whole match with ``REDACTED``.

    Why not ``_sub``: a literal replacement lets ``re.subn`` build the output in C, with no Python call per
    match, which is what keeps a text made of nothing but tokens fast."""

    def apply(t: _Text, counts: dict[str, int]) -> None:
        out, n = pattern.subn(REDACTED, t.text)
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
    return _SECRET_RUN_RE.fullmatch(run) is not None


_NEW_NAMES_ONE_BY_ONE = 8
# At least one separator in this many characters makes a text dense (``_key_value``).
_DENSE_SEPARATORS = 16
_SECRET_ROOTS_REVERSED = tuple(root[::-1] for root in _SECRET_ROOTS)


def _holds_root_reversed(reversed_name: str) -> bool:
    low = reversed_name.lower()
    for root in _SECRET_ROOTS_REVERSED:  # noqa: SIM110 (a plain loop: any() over a generator costs more)
        if root in low:
            return True
    return False


def _reversed_split(text: str) -> list[str]:
    """The backward scan of ``text`` as a split: [text, separator, name, "", text, ...] (the text reversed).
    A text with one kind of separator is read by the pattern that starts with it (a faster scan)."""
    if ":" not in text:
        return _SETTING_NAMES_AFTER_SPLIT_RE["="].split(text[::-1])
    if "=" not in text:
        return _SETTING_NAMES_AFTER_SPLIT_RE[":"].split(text[::-1])
    return _SETTING_NAMES_REVERSED_SPLIT_RE.split(text[::-1])


_DOUBLE_QUOTED_REDACTED = f'"{REDACTED}"'
_SINGLE_QUOTED_REDACTED = f"'{REDACTED}'"


def _filled(values: list[str | None], replacement: str | None) -> list[str]:
    """``values`` with None as "" and every other value as ``replacement`` (kept as is when None)."""
    missing = values.count(None)
    if missing == len(values):
        return [""] * len(values)
    if replacement is None:
        return ["" if v is None else v for v in values]
    if not missing:
        return [replacement] * len(values)
    return ["" if v is None else replacement for v in values]


def _redact_settings(t: _Text, counts: dict[str, int], pattern: re.Pattern[str]) -> None:
    """One split on a settings pattern (groups as in ``_SECRET_SETTING_RE``), then the values replaced by
    slice assignments: C does the work, Python a few list operations per text."""
    pieces = pattern.split(t.text)
    stride = _GROUPS + 1
    found = len(pieces) // stride
    if not found:
        return
    after_scheme, double, single, plain = (pieces[k::stride] for k in range(3, 7))
    fired = 4 * found - after_scheme.count(None) - double.count(None) - single.count(None) - plain.count(None)
    if not fired:
        return
    pieces[2::stride] = _filled(pieces[2::stride], None)
    pieces[3::stride] = _filled(after_scheme, REDACTED)
    pieces[4::stride] = _filled(double, _DOUBLE_QUOTED_REDACTED)
    pieces[5::stride] = _filled(single, _SINGLE_QUOTED_REDACTED)
    pieces[6::stride] = _filled(plain, REDACTED)
    counts["key_value"] = counts.get("key_value", 0) + fired
    t.set("".join(pieces))


# Each rule with the literals one of which it needs (in the text, or in its lower-cased copy): a rule whose
# literals are all absent is not called (``in`` per literal: a C scan each, cheaper than the call). And a
# character the rule cannot fire without (in every literal, or in every match of its pattern), or "": a scan
# for one character (memchr) costs a fraction of a scan for a literal, and most texts lack some of these
# (a text of settings holds no "-", "_", "A" or "J"; a log line rarely a "J" or "B").
_RULE_CHAR = {
    "token_openai": "-",
    "token_huggingface": "_",
    "token_github": "_",  # "gh[pousr]_" or "github_pat_"
    "token_gitlab": "-",
    "token_aws": "A",
    "token_slack": "-",  # "xox" then a letter then "-"
    "token_google": "A",
    "token_jwt": "J",
}
_Rule = Callable[[_Text, dict], None]
# The rules that keep no memory, in order; an engine appends its two that do (settings, then flags).
_STATELESS_RULES: tuple[tuple[_Rule, tuple[str, ...], bool, str], ...] = (
    (_sub(_PRIVATE_KEY_RE, "private_key", _private_key), ("-----BEGIN ",), False, "B"),
    (_url_credentials, ("://",), False, ""),
    (_bearer, ("bearer",), True, ""),
    *((_sub_redacted(pattern, name), needles, False, _RULE_CHAR[name]) for name, needles, pattern in _TOKEN_SHAPES),
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


# Longer texts skip the check above: most hold some literal, and on a long repetitive text (``sk-`` ten thousand
# times) scanning for every literal costs more than the rules' own checks.
_SHORT = 512


# --------------------------------------------------------------------------- the engine


class RedactionEngine:
    """The rules plus everything they remember between texts: which names were judged secret, the patterns
    compiled for the secret names of busy texts and for each mark character.

    Why an object: the memory makes repeated texts cheap (a serving log names the same few settings on every
    line), but memory shared through module globals couples every caller -- a test could not start from a
    clean state, and one caller's unusual texts would evict another's names. Each engine owns its memory; two
    engines never share any, and their answers are the same (the memory only saves work). The module-level
    functions use one default engine, so callers that do not care need no object.

    The keyword arguments tune when each settings path is taken (tests force one path with them); the
    defaults are the module's. Not thread-safe beyond what CPython's dict and set operations give, as before:
    a lost update only costs a name judged again."""

    __slots__ = (
        "_fast_min_settings_per_name",
        "_fast_names_max",
        "_fast_patterns",
        "_fast_patterns_max",
        "_judged_reversed",
        "_marked_patterns",
        "_marks",
        "_name_cache_max",
        "_rules",
        "_secret_name_cache",
        "_secret_reversed",
    )

    def __init__(
        self,
        *,
        fast_names_max: int = _FAST_NAMES_MAX,
        fast_min_settings_per_name: int = _FAST_MIN_SETTINGS_PER_NAME,
        fast_patterns_max: int = _FAST_PATTERNS_MAX,
        marks: tuple[str, ...] = _MARKS,
        name_cache_max: int = _NAME_CACHE_MAX,
    ) -> None:
        self._fast_names_max = fast_names_max
        self._fast_min_settings_per_name = fast_min_settings_per_name
        self._fast_patterns_max = fast_patterns_max
        self._marks = marks
        self._name_cache_max = name_cache_max
        self._secret_name_cache: dict[str, bool] = {}
        # Setting names (reversed, as the settings scan reads them) already judged, and those found secret.
        self._judged_reversed: set[str] = set()
        self._secret_reversed: set[str] = set()
        self._fast_patterns: dict[frozenset[str], re.Pattern[str]] = {}
        self._marked_patterns: dict[str, re.Pattern[str]] = {}
        self._rules: tuple[tuple[_Rule, tuple[str, ...], bool, str], ...] = (
            *_STATELESS_RULES,
            (self._key_value, ("=", ":"), False, ""),  # separators first (two scans), the roots inside
            (self._flag_value, _SECRET_ROOTS, True, "-"),  # every flag starts with "-"
        )

    def remembered(self) -> dict[str, int]:
        """How much this engine holds: judged flag/argv names, judged setting names, compiled patterns of
        secret names and of mark characters (for tests and benchmarks; the sizes are bounded)."""
        return {
            "names": len(self._secret_name_cache),
            "setting_names": len(self._judged_reversed),
            "name_patterns": len(self._fast_patterns),
            "mark_patterns": len(self._marked_patterns),
        }

    # ----------------------------------------------------------------------- names

    def is_secret_name(self, name: str) -> bool:
        """``is_secret_name``, remembered for names up to 256 characters (at most ``name_cache_max`` of them)."""
        hit = self._secret_name_cache.get(name)
        if hit is None:
            hit = is_secret_name(name)
            if len(name) <= 256 and len(self._secret_name_cache) < self._name_cache_max:
                self._secret_name_cache[name] = hit
        return hit

    # ----------------------------------------------------------------------- text

    def redact_text(self, text: str) -> tuple[str, dict[str, int]]:
        """Apply every rule to free text; return the redacted text and how often each rule fired.

        Linear in the length of the text (see the notes above the rules)."""
        counts: dict[str, int] = {}
        if not isinstance(text, str) or not text:
            return (text if isinstance(text, str) else ""), counts
        t = _Text(text)
        if len(text) <= _SHORT and not _has_trigger(t.low):
            return text, counts  # most arguments and short lines: one scan per literal instead of every rule's checks
        for rule, needles, lowered, char in self._rules:
            if char and char not in t.text:
                continue
            haystack = t.low if lowered else t.text
            for needle in needles:
                if needle in haystack:
                    rule(t, counts)
                    break
        return t.text, counts

    # ----------------------------------------------------------------------- settings (name=value)

    def _key_value(self, t: _Text, counts: dict[str, int]) -> None:
        """``name=value`` settings whose name is secret-looking: the value goes.

        Why this way: the names are read backwards from their separators (a scan the regex engine runs in C from
        separator to separator), each distinct name is judged once, and the text is then redacted by one split,
        with no Python per setting. Known secret names in a text with many settings take a pattern of literals;
        other texts have each secret name marked by a character absent from them (``_key_value_marked``)."""
        text = t.text
        low = t.low
        for root in _SECRET_ROOTS:  # every secret name holds one
            if root in low:
                break
        else:
            return
        # A text dense with separators likely takes the marked path, which needs the backward scan as a split: the
        # split then also gives the names (one scan instead of two); others take the cheaper findall.
        pieces = None
        equals = text.count("=")
        colons = text.count(":")
        if (equals + colons) * _DENSE_SEPARATORS > len(text):
            pieces = _reversed_split(text)
            found = pieces[2::4]
        elif not colons:
            found = _SETTING_NAMES_AFTER_RE["="].findall(text[::-1])
        elif not equals:
            found = _SETTING_NAMES_AFTER_RE[":"].findall(text[::-1])
        else:
            reverse = text[::-1]
            found = _SETTING_NAMES_AFTER_RE["="].findall(reverse) + _SETTING_NAMES_AFTER_RE[":"].findall(reverse)
        reversed_names = set(found)
        secret_reversed = self._secret_among(reversed_names)
        if not secret_reversed:
            return
        pattern = None
        if len(secret_reversed) <= self._fast_names_max:
            secret = frozenset(r[::-1] for r in secret_reversed)
            pattern = self._fast_patterns.get(secret)
            if pattern is None and (
                max(map(len, secret)) <= _FAST_NAME_LEN_MAX and len(found) >= self._fast_min_settings_per_name * len(secret)
            ):
                pattern = self._named_settings_re(secret)
        if pattern is not None:
            _redact_settings(t, counts, pattern)
        else:
            every_name = len(secret_reversed) == len(reversed_names)
            self._key_value_marked(t, counts, secret_reversed, pieces, every_name=every_name)

    def _secret_among(self, reversed_names: set[str]) -> set[str]:
        """The secret ones among setting names (reversed, as the backward scan reads them).

        Set operations in C against the names judged before. New names are judged one by one when they are few
        (most hold no secret root, which ``in`` tells fastest), else all at once by one ``findall`` over them
        joined by newlines (one C call however many). They are remembered; a full memory starts afresh."""
        judged, secret_before = self._judged_reversed, self._secret_reversed
        new = reversed_names - judged
        if not new:
            return reversed_names & secret_before
        if len(new) <= _NEW_NAMES_ONE_BY_ONE:
            secret_new = {name for name in new if _holds_root_reversed(name) and _run_is_secret(name[::-1])}
        else:
            # Joined then reversed: the names forwards, one a line (in the opposite order, which does not matter).
            lines = ("\n".join(new))[::-1] + "\n"
            secret_new = {name[::-1] for name in _SECRET_RUN_LINES_RE.findall(lines) if name}
        # The answer before the memory changes: a full memory is emptied, names judged before with it.
        secret = (reversed_names & secret_before) | secret_new
        if len(judged) + len(new) > self._name_cache_max:
            judged.clear()
            secret_before.clear()
        if len(new) <= self._name_cache_max:
            judged.update(new)
            secret_before.update(secret_new)
        return secret

    def _key_value_marked(
        self,
        t: _Text,
        counts: dict[str, int],
        secret_reversed: set[str],
        pieces: list[str] | None = None,
        every_name: bool = False,
    ) -> None:
        """Redact the settings of these names (reversed) by marking where each starts, then one split.
        ``every_name``: the text has no other setting names (all are marked).

        The marks are put in the reversed text, right after each secret name as the backward scan reads it (one
        split, then a list assignment in C from a per-name table), so forwards each such setting starts with the
        mark: the split pattern then starts with a literal the regex engine skips to. The mark is a character the
        text does not hold, and is removed after; inside a value it is a value character, as the ``:`` or ``=``
        after it is, so values end where they did."""
        text = t.text
        mark = next((m for m in self._marks if m not in text), None)
        if mark is None:
            _redact_settings(t, counts, _SECRET_SETTING_RE)  # every mark in the text: the slower, mark-free pattern
            return
        if pieces is None:
            pieces = _reversed_split(text)
        names = pieces[2::4]
        if every_name:
            pieces[3::4] = [mark] * len(names)  # every setting is secret: no table to look each name up in
        else:
            mark_of = dict.fromkeys(names, "")
            mark_of.update(dict.fromkeys(secret_reversed, mark))
            pieces[3::4] = map(mark_of.__getitem__, names)
        marked = "".join(pieces)[::-1]
        before = counts.get("key_value", 0)
        m = _Text(marked)
        pattern = self._marked_patterns.get(mark)
        if pattern is None:
            pattern = self._marked_patterns[mark] = _marked_settings_re(mark)
        _redact_settings(m, counts, pattern)
        if counts.get("key_value", 0) != before:
            t.set(m.text.replace(mark, ""))

    def _named_settings_re(self, names: frozenset[str]) -> re.Pattern[str]:
        """The settings of exactly these (secret) names, in ``_SECRET_SETTING_RE``'s groups. Each name is checked
        to be a whole run by a look-behind placed after it, so the pattern still starts with literals."""
        pattern = self._fast_patterns.get(names)
        if pattern is None:
            alternatives = "|".join(
                f"{re.escape(n)}(?<!{_NAME_CHAR}{re.escape(n)})" for n in sorted(names, key=len, reverse=True)
            )
            pattern = re.compile(rf"((?:{alternatives}){_SEPARATOR}){_VALUE}")
            if len(self._fast_patterns) >= self._fast_patterns_max:
                self._fast_patterns.clear()
            self._fast_patterns[names] = pattern
        return pattern

    # ----------------------------------------------------------------------- flags (--name value)

    def _flag_value(self, t: _Text, counts: dict[str, int]) -> None:
        # [text, flag, sep, value, text, ...]: one split in C, then one remembered decision per flag.
        pieces = _FLAG_RE.split(t.text)
        if len(pieces) == 1:
            return
        n = 0
        cache_get = self._secret_name_cache.get
        for i in range(1, len(pieces), 4):
            flag = pieces[i]
            secret = cache_get(flag)
            if secret is None:
                secret = self.is_secret_name(flag)
            if secret and not pieces[i + 2].startswith(REDACTED):
                pieces[i + 2] = REDACTED
                n += 1
        if n:
            counts["flag_value"] = counts.get("flag_value", 0) + n
            t.set("".join(pieces))

    # ----------------------------------------------------------------------- argv

    def redact_argv_counts(self, argv: Sequence[str]) -> tuple[str, dict[str, int]]:
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
        # Only the hot arguments (the indices of those holding a present literal) are looked at one by one: a
        # list of booleans per present literal is built in C-speed comprehensions, not a generator per argument.
        lows = [a.lower() for a in args]
        first, *others = present
        hot = [first in low for low in lows]
        for x in others:
            hot = [h or x in low for h, low in zip(hot, lows, strict=True)]
        hot_at = [i for i, h in enumerate(hot) if h]
        last = len(args) - 1
        redact_next: set[int] = set()
        for i in hot_at:
            if i >= last:
                break
            arg = args[i]
            lowered = lows[i]
            nxt = args[i + 1]
            if arg.startswith("-") and "=" not in arg and len(arg) > 1 and self.is_secret_name(arg):
                # "--api-key VALUE"; a following flag means this one takes no value.
                if nxt and not nxt.startswith("-"):
                    redact_next.add(i + 1)
            elif lowered.rstrip(":") in ("authorization", "proxy-authorization"):
                # curl -H split by a shell: "Authorization:" "Bearer" "X" or "Authorization:" "X".
                if nxt.lower() in _AUTH_SCHEMES and i + 2 < len(args):
                    redact_next.add(i + 2)
                elif nxt.lower() not in _AUTH_SCHEMES:
                    redact_next.add(i + 1)
            elif lowered == "bearer":
                redact_next.add(i + 1)
        out = list(args)
        for i in sorted(redact_next.union(hot_at)):
            arg = args[i]
            if i in redact_next and arg != REDACTED:
                out[i] = REDACTED
                rule = "bearer" if i > 0 and lows[i - 1] in _AUTH_SCHEMES else "flag_value"
                counts[rule] = counts.get(rule, 0) + 1
                continue
            if not hot[i]:
                continue
            redacted, arg_counts = self.redact_text(arg)
            for rule, n in arg_counts.items():
                counts[rule] = counts.get(rule, 0) + n
            out[i] = redacted
        return " ".join(out), counts

    def redact_argv(self, argv: Sequence[str]) -> str:
        """Join argv for display (space-separated, like ps) with secret argument values replaced by ``<redacted>``."""
        return self.redact_argv_counts(argv)[0]


# --------------------------------------------------------------------------- the default engine

_default = RedactionEngine()


def redact_text(text: str) -> tuple[str, dict[str, int]]:
    """Apply every rule to free text; return the redacted text and how often each rule fired (default engine)."""
    return _default.redact_text(text)


def redact_argv_counts(argv: Sequence[str]) -> tuple[str, dict[str, int]]:
    """``redact_argv`` plus the per-rule counts (for bundles' redaction reports; default engine)."""
    return _default.redact_argv_counts(argv)


def redact_argv(argv: Sequence[str]) -> str:
    """Join argv for display (space-separated, like ps) with secret argument values replaced by ``<redacted>``."""
    return _default.redact_argv_counts(argv)[0]
