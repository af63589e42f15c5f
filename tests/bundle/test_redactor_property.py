"""The bundle's redactor on hostile recorder rows: deep nesting, NULs, huge values, invalid JSON -- a row it cannot
take is left out (None), never an exception that would cost the whole history part of a bundle."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from diag.bundle.redactor import Redactor, parse_many

DEEP = ['{"kind":"host","x":' + "[" * 50_000 + "]" * 50_000 + "}", '{"a":' * 50_000 + "1" + "}" * 50_000]
# Decodable by json (under its own limit) but deeper than a walk can recurse on top of a caller's stack.
WALL = '{"kind":"host","x":' + '{"a":' * 900 + '"sk-' + "A1b2" * 8 + '"' + "}" * 900 + "}"


def test_rows_nested_too_deep_decode_to_none() -> None:
    assert parse_many([*DEEP, '{"kind":"host"}']) == [None, None, {"kind": "host"}]
    red = Redactor()
    for body in DEEP:
        assert red.record_line(body, "timeline/host.jsonl") is None
    got = red.record_line(WALL, "timeline/host.jsonl")
    assert got is None or "sk-A1b2" not in got[0]


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(st.one_of(_values.map(json.dumps), st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_any_row_gives_a_line_that_decodes_to_the_dict_returned_or_none(body: str) -> None:
    got = Redactor().record_line(body, "timeline/x.jsonl")
    if got is not None:
        line, obj = got
        assert isinstance(obj, dict) and json.loads(line) == obj
        assert "\n" not in line
