"""The SLO spec loader and ``diag alerts --slo`` on hostile files: a Spec or one clear error, never a crash.

A spec file comes from the outside world (a user's repository, a config map). Whatever it holds (bytes that are
not UTF-8, NUL, an alias bomb, a document nested a thousand deep, a 5 000-digit number, a list where a mapping
goes, two documents, a 2 MB string), ``load_spec`` returns a Spec or raises ``SpecError`` whose message names
the file, and the CLI exits 2 with that one message: no traceback, no hang, nothing written outside --out.

The loader is driven directly for the many generated cases (fast); the real CLI runs in a subprocess for a
handful, to prove what reaches the user.
"""

from __future__ import annotations

import copy
import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alerts.generate import render
from alerts.spec import DEFAULT_SPEC_PATH, MAX_SPEC_BYTES, Spec, SpecError, load_spec
from diag.rules.classes import INCIDENT_CLASSES

REPO = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = yaml.safe_load(DEFAULT_SPEC_PATH.read_text())

# Values a hostile or careless file puts where the spec expects something else.
_hostile_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        ["", "\x00", "a\x00b", "x\n", "30d\n", "1" * 20 + "d", "0m", "-5m", "page\x1b[31m", "é", "\U0001f600",
         "fast", "slow", "page", "ticket", "30d", "5m", "1h", 'job="x"', "{{ $labels.slo }}", "x" * 5000]
    ),
    st.dates().map(datetime.date.isoformat),
    st.binary(max_size=8),
)  # fmt: skip
_hostile = st.recursive(
    _hostile_scalar,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.one_of(st.text(max_size=8), st.integers(0, 9)), c, max_size=4),
    max_leaves=12,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indexes) into the base document, the root included."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


BASE_PATHS = _paths(BASE)
# The shipped specs of the other SLI forms and of an engine: a histogram + threshold_seconds, a raw ratio, engine: vllm.
FORMS: dict[str, Any] = {name: yaml.safe_load((REPO / "alerts" / name).read_text()) for name in ("slo-tgi.yaml", "slo-vllm.yaml")}


@st.composite
def _mutated(draw: st.DrawFn, base: Any = None) -> Any:
    """A shipped spec with a few nodes replaced, removed or added: near-valid documents reach deep checks."""
    base = BASE if base is None else base
    paths = BASE_PATHS if base is BASE else _paths(base)
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if not path:
            if action == "replace":
                doc = draw(_hostile)
            continue
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            if action == "replace":
                parent[path[-1]] = draw(_hostile)
            elif action == "delete":
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[draw(st.text(max_size=10))] = draw(_hostile)
            elif isinstance(parent, list):
                parent.append(draw(_hostile))
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation changed the shape under this path
    return doc


def _dump(doc: Any) -> bytes:
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False).encode()


# Raw text that no dumper would write: YAML features a spec has no use for, and broken bytes.
_FRAGMENTS = [
    "version: 1\n", "slos:\n", "  - name: a\n", "    objective: 99\n", "tiers: ", "&a ", "*a ", "<<: *a\n",
    "a: &a [1, 2]\n", "b: [*a, *a]\n", "---\n", "...\n", "%YAML 1.1\n", "!!python/object:os.system ", "!!binary ",
    "!!set {a, b}\n", "? [a, b]\n: c\n", "[" * 40, "]" * 40, "{" * 40, "- " * 40, '"\\0"', '"\\x00"', "\t",
    "'unclosed", '"unclosed', ": :", "- -", "\x00", "\ufeff", "\x85", "1" * 5000, "1e999", ".nan", "-.inf",
    "0x" + "f" * 40, "~", "null", "yes", "no", "2024-01-01", "12:30:00",
]  # fmt: skip
_raw = st.one_of(
    st.lists(st.sampled_from(_FRAGMENTS) | st.text(max_size=10), max_size=25).map(lambda x: "".join(x).encode()),
    st.binary(max_size=200),
    st.lists(st.sampled_from(_FRAGMENTS), max_size=10).map(lambda x: b"\xff\xfe" + "".join(x).encode()),
)


def _load(tmp: Path, data: bytes) -> Spec | None:
    """load_spec on a file holding ``data``: the Spec, or None after checking the error names the file."""
    path = tmp / "spec.yaml"
    path.write_bytes(data)
    try:
        spec = load_spec(path)
    except SpecError as exc:
        message = str(exc)
        assert message.startswith(f"{path}:"), message
        assert "\n" not in message.strip() and len(message) < 2_000, message[:300]
        return None
    assert isinstance(spec, Spec)
    return spec


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_mutated())
def test_near_valid_specs_load_or_fail_clearly(tmp_path: Path, doc: Any) -> None:
    _load_and_render(tmp_path, doc)


def _load_and_render(tmp_path: Path, doc: Any) -> None:
    spec = _load(tmp_path, _dump(doc))
    if spec is not None:  # accepted: what the CLI does next must work too
        files = render(spec, INCIDENT_CLASSES, "spec.yaml").files
        assert files and all(isinstance(text, str) for text in files.values())
        assert all(not Path(rel).is_absolute() and ".." not in Path(rel).parts for rel in files)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.sampled_from(sorted(FORMS)).flatmap(lambda name: _mutated(FORMS[name])))
def test_near_valid_specs_of_every_form_load_or_fail_clearly(tmp_path: Path, doc: Any) -> None:
    """The same on the raw-ratio / histogram spec and the engine spec: their new fields are refused in one line too."""
    _load_and_render(tmp_path, doc)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_raw)
def test_raw_bytes_load_or_fail_clearly(tmp_path: Path, data: bytes) -> None:
    _load(tmp_path, data)


def _bomb(levels: int = 9) -> bytes:
    """'Billion laughs': each level aliases the previous one nine times (9**levels strings once expanded)."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    lines += [f"period: *a{levels - 1}", f"slos: *a{levels - 1}"]
    return "\n".join(lines).encode()


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (_bomb(), "alias *a0 is not allowed"),
        (b"slos: &s [{name: a}]\nx: *s\n", "alias *s is not allowed"),
        (b"[" * 5_000 + b"]" * 5_000, "nested deeper than"),
        (b"slos:\n" + b"".join(b"  " * i + b"- \n" for i in range(1, 40)), "nested deeper than"),
        (b"\xff\xfeversion: 1\n", "not UTF-8"),
        (b"version: 1\x00\n", "not valid YAML"),
        (b"objective: 1" + b"1" * 5_000 + b"\n", "a value cannot be read"),
        (b"- a\n- b\n", "spec: expected a mapping, got list"),
        (b"version: 1\n---\nversion: 1\n", "not valid YAML"),
        (b"", "empty"),
        (b"period: '" + b"x" * (MAX_SPEC_BYTES + 10) + b"'\n", "larger than"),
        (b'period: "30d\\0"\n', "control character"),
        (b"{1: a, b: 2, null: 3}\n", "unknown field"),
        (b"slos:\n  - name: \"x\\n\"\n", "must be lower case letters"),
        (b"tiers:\n  - {name: f, severity: page, long: 1" + b"1" * 5_000 + b"d, short: 5m, budget_percent: 2}\n",
         "is not a duration"),
        (b"slos: [{name: a, objective: " + str(10**400).encode() + b", availability: {}}]\n", "expected a number"),
    ],
    ids=["alias-bomb", "alias", "deep-flow", "deep-block", "binary", "nul", "huge-int", "list", "two-documents",
         "empty", "huge-file", "escaped-nul", "odd-keys", "newline-in-name", "huge-duration", "int-beyond-float"],
)  # fmt: skip
def test_hostile_files_are_refused_with_one_clear_line(tmp_path: Path, data: bytes, problem: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_bytes(data)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    message = str(err.value)
    assert message.startswith(f"{path}:") and problem in message, message[:300]
    assert len(message) < 2_000


def _cli(tmp_path: Path, data: bytes | None, *extra: str) -> subprocess.CompletedProcess[str]:
    """``diag alerts --slo spec.yaml --out out`` run in ``tmp_path`` (the timeout turns a hang into a failure)."""
    if data is not None:
        (tmp_path / "spec.yaml").write_bytes(data)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "diag.cli", "alerts", "--slo", "spec.yaml", "--out", "out", *extra],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.process
@pytest.mark.parametrize(
    "data",
    [_bomb(), b"[" * 5_000 + b"]" * 5_000, b"\xff\xfe\x00\x01", b"objective: 1" + b"1" * 5_000 + b"\n"],
    ids=["alias-bomb", "deep", "binary", "huge-int"],
)  # fmt: skip
def test_cli_refuses_hostile_specs_without_a_traceback(tmp_path: Path, data: bytes) -> None:
    result = _cli(tmp_path, data)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diag alerts: spec.yaml:"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]  # nothing written anywhere


@pytest.mark.process
def test_cli_writes_only_inside_out(tmp_path: Path) -> None:
    result = _cli(tmp_path, DEFAULT_SPEC_PATH.read_bytes())
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "spec.yaml"]
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert written and all(p.resolve().is_relative_to((tmp_path / "out").resolve()) for p in written)


@pytest.mark.process
def test_cli_unwritable_out_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file where a directory must go\n")
    (tmp_path / "spec.yaml").write_bytes(DEFAULT_SPEC_PATH.read_bytes())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "diag.cli", "alerts", "--slo", "spec.yaml", "--out", "blocker/out"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().startswith("diag alerts: --out blocker/out: cannot write")


def test_a_file_name_with_a_newline_cannot_add_lines_to_the_generated_yaml() -> None:
    spec = load_spec(DEFAULT_SPEC_PATH)
    generated = render(spec, INCIDENT_CLASSES, source="evil\ngroups: []\n#.yaml")
    for text in generated.files.values():
        first = text.splitlines()[0]
        assert first.startswith("# Generated by `diag alerts` from evil?groups: []?#.yaml")
        assert not any(line.startswith("groups: []") for line in text.splitlines())
