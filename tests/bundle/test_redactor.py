"""The bundle's redactor: the fast path (a record written as it came) must decide exactly as the full walk.

Why this matters: an hour of history is ~70 000 records, so records no rule touches are written
verbatim; if the check that allows this ever disagreed with the walk, a secret would ship. Hypothesis
throws records mixing secrets, prompt fields, escapes and line breaks at both and compares.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.redact import REDACTED
from diag.bundle.redactor import Redactor

SECRETS = [
    "Bearer abcdefghijklmnop123",
    "sk-" + "a1B2" * 8,
    "hf_" + "x" * 24,
    "https://alice:s3cret@db.internal/x",
    "--api-key=topsecretvalue",
    "password=hunter22",
    "token: abc.def",
    'he said "api_key=zzz"',
    "line one\nBearer multilineTOKEN99",
    "caf\u00e9 AKIAABCDEFGHIJKLMNOP",
]
PLAIN = ["python3", "/models/llama.safetensors", "ok", "", "/system.slice/llm.service", "--max-tokens 512", "caf\u00e9"]
KEYS = ["ts", "kind", "cmdline", "comm", "reason", "api_key", "password", "auth_type", "prompt", "messages", "text",
        "max_tokens", "TOKENIZERS_PARALLELISM", "model_files", "missing"]  # fmt: skip

scalars = st.one_of(
    st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False), st.none(), st.booleans(),
    st.sampled_from(SECRETS + PLAIN), st.text(max_size=30),
)  # fmt: skip
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4), max_leaves=12
)
records = st.dictionaries(st.sampled_from(KEYS), values, max_size=8)


@settings(max_examples=400, deadline=None)
@given(records, st.booleans())
def test_fast_path_decides_exactly_as_the_full_walk(record: dict, pretty: bool) -> None:
    body = json.dumps(record, indent=1 if pretty else None, ensure_ascii=bool(len(record) % 2))
    fast = Redactor()
    got = fast.record_line(body, "timeline/x.jsonl")
    assert got is not None
    line, obj = got
    expected = Redactor().value(json.loads(body), "timeline/x.jsonl")
    assert "\n" not in line  # one JSONL line, whatever the input looked like
    assert json.loads(line) == obj == expected
    if line is body:  # written verbatim: only allowed when the walk would have changed nothing
        assert expected == json.loads(body)


@settings(max_examples=400, deadline=None)
@given(st.lists(records, min_size=1, max_size=6), st.booleans())
def test_a_batch_judged_clean_from_its_strings_is_one_the_walk_leaves_alone(batch: list[dict], ascii_only: bool) -> None:
    """The history writes a batch of rows as stored when ``json_text_is_clean`` says so: then the walk of every
    row must change nothing and count nothing (a secret in any key or value, a prompt field, an escaped quote or
    a line break must all make it say no)."""
    bodies = [json.dumps(r, ensure_ascii=ascii_only) for r in batch]
    joined = "[" + ",".join(bodies) + "]"
    if not Redactor().json_text_is_clean(joined):
        return
    walker = Redactor()
    for body in bodies:
        assert walker.value(json.loads(body), "timeline/x.jsonl") == json.loads(body)
        assert walker.record_line(body, "timeline/x.jsonl") == (body, json.loads(body))
    assert walker.report()["total"] == 0


def test_a_batch_with_a_secret_anywhere_is_not_clean() -> None:
    r = Redactor()
    plain = {"kind": "process", "ts": 1.0, "comm": "python3", "cmdline": "python3 -m server --port 8000"}
    assert r.json_text_is_clean(json.dumps([plain] * 3))
    for bad in ({"api_key": "plainvalue"}, {"cmdline": "srv --token abc123"}, {"prompt": "hi"},
                {"note": 'say \"Bearer abcdefghijklmnop\"'}, {"x": "caf\u00e9 AKIAABCDEFGHIJKLMNOP"}):  # fmt: skip
        assert not r.json_text_is_clean(json.dumps([plain, {**plain, **bad}, plain])), bad
    assert not r.json_text_is_clean(json.dumps([plain], indent=1))  # a line break between tokens: re-encode


def test_prompt_fields_are_dropped_not_masked_and_counted() -> None:
    r = Redactor()
    rec = {"kind": "request", "ts": 1.0, "prompt_tokens": 12, "prompt": "tell me a secret story",
           "messages": [{"role": "user", "content": "hello there"}], "output": 7}  # fmt: skip
    line, obj = r.record_line(json.dumps(rec), "timeline/request.jsonl")
    assert obj == {"kind": "request", "ts": 1.0, "prompt_tokens": 12, "output": 7}  # a count under a prompt name stays
    assert "secret story" not in line and "hello there" not in line
    report = r.report()
    assert report["rules"]["prompt_field"] == 2
    dropped = {f["field"]: f for f in report["dropped"]["fields"]}
    assert dropped["prompt"]["chars_dropped"] == len("tell me a secret story")
    assert dropped["messages"]["values_dropped"] == 1


def test_secret_named_keys_and_text_rules_are_masked_and_counted_per_file() -> None:
    r = Redactor()
    doc = {"settings": {"api_key": "plainvalue", "hf_token_path": "/run/token"}, "cmdline": "srv --token abc123",
           "url": "postgres://u:pw@db/x"}  # fmt: skip
    out = r.value(doc, "findings.json")
    assert out["settings"] == {"api_key": REDACTED, "hf_token_path": "/run/token"}  # a path *about* a secret stays
    assert "abc123" not in out["cmdline"] and "pw@" not in out["url"]
    text = r.text("Authorization: Bearer zzzzzzzz\nok", "raw/journal.txt")
    assert "zzzzzzzz" not in text and text.endswith("\nok")
    report = r.report()
    assert report["per_file"]["findings.json"]["secret_key"] == 1
    assert report["per_file"]["raw/journal.txt"]
    assert report["total"] == sum(report["rules"].values())
