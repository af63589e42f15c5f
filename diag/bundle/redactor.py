"""The bundle's redactor pass: every byte the bundle writes goes through here before it is hashed.

Why a pass of its own on top of ``collectors.redact``: a bundle is handed to people who were not
on the machine (a vendor, another team, a ticket), so it must hold no secret and no prompt even
where a source forgot to redact (a third-party record writer, a journal line, a kernel line). sos
report leaked secrets exactly through the files its per-plugin scrubbing missed and through its
own log and manifest (an upload password in its log and manifest ``cmdline``); here there is one choke point instead.

Three shapes of content, one set of rules (``collectors.redact.redact_text``):

- free text (raw files, journal and kmsg lines, the log, the rendered report): ``text``;
- records and JSON documents (timeline lines, findings, the manifest): ``value`` walks the
  structure, so a secret-looking *key* (``"api_key": "..."``) loses its string value, every
  string value goes through ``redact_text``, and prompt-bearing fields (``prompt``, ``messages``,
  ``completion`` ...) are *dropped*, not masked -- only their number and length survive
  (our own ``RequestTiming`` holds token counts only; this catches anyone else's);
- what is dropped whole (a file we refuse to copy, a field) is listed in ``dropped``.

Counts are per rule (``redact_text``'s names plus ``secret_key`` and ``prompt_field``) and per
bundle file, and end up in ``redaction.json``. ``redact_text`` results are memoised: an hour of
1 Hz process samples repeats the same command lines 3600 times.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from collectors.redact import REDACTED, is_secret_name, redact_text

# Field names whose string content is model input or output. Dropped wherever they appear in a record
# or a JSON document. Numeric values under these names (a count) are kept.
PROMPT_FIELDS = frozenset(
    {
        "prompt",
        "prompts",
        "completion",
        "completions",
        "messages",
        "message_text",
        "input",
        "inputs",
        "input_text",
        "output",
        "outputs",
        "output_text",
        "generated_text",
        "response",
        "response_text",
        "choices",
        "content",
        "text",
        "query",
        "system_prompt",
    }
)

# Said in words that no rule acts on (this text is itself redacted on its way into the bundle).
COVERAGE = (
    "Every file in this bundle passed through the redactor before it was hashed. Free text (copied files, journal "
    "and kernel lines, the log, the reports) went through every rule of collectors.redact: private keys, "
    "credentials in URLs, HTTP authorization header values, well-known API credential shapes, settings with "
    "secret-looking names, and values of secret-looking command-line flags. Records and JSON documents were "
    "redacted field by field: fields with secret-looking names masked, prompt and completion fields dropped "
    "(only how many and how long is kept). Process environments and raw command lines are never read into the "
    "bundle. Redaction is by pattern: a secret with no recognisable name or shape in free text can still pass, "
    "so review the bundle before sharing it widely."
)
NEVER_COLLECTED = (
    "process environments (/proc/<pid>/environ)",
    "raw command lines (/proc/<pid>/cmdline): only the redacted argv of each process sample",
    "prompt and completion text: requests are recorded as token counts only",
    "binary files: a file with NUL bytes is listed here instead of copied",
)
# Rule names, as a reader should see them (a report that printed the bare rule names would trip the rules).
RULE_LABELS = {
    "private_key": "private keys",
    "url_credentials": "credentials in URLs",
    "bearer": "HTTP authorization header values",
    "key_value": "settings with secret-looking names",
    "flag_value": "values of secret-looking command-line flags",
    "secret_key": "record fields with secret-looking names",
    "prompt_field": "prompt or completion fields dropped",
    "request_log_text": "prompts and completions in a server's request log lines",
}


def rule_label(rule: str) -> str:
    if rule.startswith("token_"):
        return f"API credentials ({rule[len('token_') :]} shape)"
    return RULE_LABELS.get(rule, rule.replace("_", " "))


@dataclass(frozen=True)
class Mask:
    """A plugin's own redaction (sos: ``postproc`` / ``do_file_sub``): ``pattern``'s matches in the plugin's
    files become ``replacement``, counted as ``rule`` in redaction.json, before the common rules run."""

    rule: str
    pattern: re.Pattern[str]
    replacement: str


_UNPARSED: Any = object()
_CACHE_MAX_LEN = 4096  # memoise short strings only (command lines, paths, reasons)
_CACHE_MAX_ENTRIES = 50_000


class Redactor:
    """Counts per rule, per file; thread-safe (the history collector redacts in its own thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.per_file: dict[str, Counter[str]] = {}
        self.dropped: list[dict[str, Any]] = []
        self._dropped_fields: dict[tuple[str, str], list[int]] = {}  # (file, field) -> [count, chars]
        self._cache: dict[str, tuple[str, dict[str, int]]] = {}
        self._keys: dict[str, int] = {}

    # ------------------------------------------------------------------ primitives

    def _redact_str(self, text: str) -> tuple[str, dict[str, int]]:
        if len(text) <= _CACHE_MAX_LEN:
            hit = self._cache.get(text)
            if hit is not None:
                return hit
            out = redact_text(text)
            if len(self._cache) < _CACHE_MAX_ENTRIES:
                self._cache[text] = out
            return out
        return redact_text(text)

    def add_counts(self, where: str, counts: dict[str, int]) -> None:
        if not counts:
            return
        with self._lock:
            self.counts.update(counts)
            self.per_file.setdefault(where, Counter()).update(counts)

    # ------------------------------------------------------------------ public

    def text(self, text: str, where: str, masks: Sequence[Mask] = ()) -> str:
        """Free text through a plugin's own ``masks`` (each counted under its rule), then every common rule;
        ``where`` is the bundle path the text is written to."""
        counts: Counter[str] = Counter()
        for mask in masks:
            text, n = mask.pattern.subn(mask.replacement, text)
            if n:
                counts[mask.rule] += n
        out, common = redact_text(text)  # not memoised: long and unique
        counts.update(common)
        self.add_counts(where, counts)
        return out

    def value(self, value: Any, where: str) -> Any:
        """A JSON-able value (a record dict, a document) with secrets masked and prompt fields dropped."""
        counts: Counter[str] = Counter()
        out = self._walk(value, where, counts, "")
        self.add_counts(where, counts)
        return out

    def record_line(self, body: str, where: str, parsed: Any = _UNPARSED) -> tuple[str, dict[str, Any]] | None:
        """One stored record (JSON text) -> (the line to write, the dict it decodes to); None if not a JSON object.

        Fast path: a check-only pass over the decoded record (no copy) asks every rule about every string
        and key; when none would act, the text is written as it came -- re-encoding an hour of records
        costs more than parsing it. Otherwise the record is walked (``value``) and re-encoded. Either way
        the line decodes to the dict returned, which is what ``load_bundle`` will read.
        """
        obj = parsed
        if obj is _UNPARSED:
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError):  # RecursionError: nested thousands deep
                return None
        if not isinstance(obj, dict):
            return None
        try:
            # A raw line break (whitespace between tokens) would split the JSONL line: re-encode those.
            if "\n" not in body and "\r" not in body and self._clean(obj):
                return body, obj
            clean = self.value(obj, where)
            return _DUMPS(clean), clean
        except RecursionError:  # decodable but too deep to walk: left out, like an undecodable row
            return None

    def _key(self, name: str) -> int:
        """0: an ordinary key; 1: a secret-looking name; 2: a prompt-bearing field; 3: a key a text rule changes."""
        kind = self._keys.get(name)
        if kind is None:
            kind = 3 if self._redact_str(name)[1] else 2 if name.lower() in PROMPT_FIELDS else 1 if is_secret_name(name) else 0
            if len(self._keys) < _CACHE_MAX_ENTRIES:
                self._keys[name] = kind
        return kind

    def json_text_is_clean(self, text: str) -> bool:
        """True when every JSON object in ``text`` (valid JSON, e.g. a batch of records joined into an array)
        would be written as it is by ``record_line``: no raw line break, and every string in it -- key or value --
        one that no rule acts on as either (an ordinary key, no text rule's match).

        Decided from the text's distinct strings, so a batch of a thousand records costs a split and a set
        instead of a walk of each (an hour of 1 Hz history: ~0.5 s of CPU against ~1 s). Conservative: a string
        that is harmless as a value but not as a key (``"api_key"`` as a value) makes it False, and so does an
        escaped quote (the split would cut that string); False sends the caller to the record-by-record walk.
        """
        if "\n" in text or "\r" in text or '\\"' in text:
            return False
        for token in set(text.split('"')[1::2]):
            if "\\" in token:  # an escape: judge the string the reader will decode
                try:
                    token = json.loads(f'"{token}"')
                except ValueError:
                    return False
            if self._key(token) != 0:
                return False
        return True

    def _clean(self, obj: dict[str, Any]) -> bool:
        """True when ``value(obj)`` would change nothing (same decisions, no copy, stops at the first hit)."""
        for key, item in obj.items():
            kind = self._key(key) if isinstance(key, str) else 0
            if kind == 3:
                return False
            t = type(item)
            if t is int or t is float or item is None or t is bool:
                continue
            if t is str:
                if kind == 2 or (kind == 1 and item and item != REDACTED) or (item and self._redact_str(item)[1]):
                    return False
            elif t is dict:
                if kind == 2 or not self._clean(item):
                    return False
            elif t is list and (kind == 2 or not self._clean_list(item)):
                return False
        return True

    def _clean_list(self, items: list[Any]) -> bool:
        for item in items:
            t = type(item)
            if t is str:
                if item and self._redact_str(item)[1]:
                    return False
            elif t is dict:
                if not self._clean(item):
                    return False
            elif t is list and not self._clean_list(item):
                return False
        return True

    def drop_file(self, path: str, reason: str) -> None:
        with self._lock:
            self.dropped.append({"what": path, "reason": reason})

    def note_dropped_field(self, where: str, field: str, chars: int) -> None:
        with self._lock:
            entry = self._dropped_fields.setdefault((where, field), [0, 0])
            entry[0] += 1
            entry[1] += chars

    def report(self) -> dict[str, Any]:
        """The ``redaction.json`` document."""
        with self._lock:
            fields = [
                {"file": f, "field": name, "values_dropped": n, "chars_dropped": chars}
                for (f, name), (n, chars) in sorted(self._dropped_fields.items())
            ]
            return {
                "rules": dict(sorted(self.counts.items())),
                "total": sum(self.counts.values()),
                "per_file": {f: dict(sorted(c.items())) for f, c in sorted(self.per_file.items())},
                "dropped": {"files": list(self.dropped), "fields": fields, "never_collected": list(NEVER_COLLECTED)},
                "coverage": COVERAGE,
            }

    # ------------------------------------------------------------------ walking

    def _walk(self, value: Any, where: str, counts: Counter[str], path: str) -> Any:
        if isinstance(value, str):
            out, c = self._redact_str(value)
            if c:
                counts.update(c)
            return out
        if isinstance(value, dict):
            result: dict[Any, Any] = {}
            for key, item in value.items():
                name = key if isinstance(key, str) else str(key)
                if name.lower() in PROMPT_FIELDS and isinstance(item, (str, list, dict)):
                    counts["prompt_field"] += 1
                    self.note_dropped_field(where, f"{path}{name}", _chars(item))
                    continue
                out_key = key
                if isinstance(key, str) and key:
                    out_key, c = self._redact_str(key)  # keys can be data too (a path, a name)
                    if c:
                        counts.update(c)
                if isinstance(item, str) and item and item != REDACTED and is_secret_name(name):
                    counts["secret_key"] += 1
                    result[out_key] = REDACTED
                    continue
                result[out_key] = self._walk(item, where, counts, f"{path}{name}.")
            return result
        if isinstance(value, (list, tuple)):
            return [self._walk(item, where, counts, path) for item in value]
        return value


_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def parse_many(bodies: list[str]) -> list[Any]:
    """Decode many JSON texts at once (one C call for the lot: ~30 % faster than one call each).

    A batch holding an undecodable text (or one nested too deep to decode) is decoded one by one instead, that
    text giving None."""
    try:
        out = json.loads("[" + ",".join(bodies) + "]")
        if isinstance(out, list) and len(out) == len(bodies):
            return out
    except (ValueError, RecursionError):
        pass
    result = []
    for body in bodies:
        try:
            result.append(json.loads(body))
        except (ValueError, RecursionError):
            result.append(None)
    return result


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 0
