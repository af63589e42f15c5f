"""Every bad option value of ``diag snapshot``, ``collect``, ``analyze``, ``bundle`` and ``demo`` gets one line that
names the option and shows the value, exit status 2, no traceback -- and every value the line suggests is accepted.

The suggestions are read back from the message (``use e.g. a, b or c`` / ``use one of a, b or c``) and fed to the
same command. "Accepted" is shown without doing the command's work: each run also carries a *sentinel*, a bad
value of an option the command checks after the one under test, so an accepted suggestion ends in the sentinel's
error instead (the command stops there, before sampling, serving or collecting). Where nothing is checked later
the run must simply not complain about the option. The commands run in-process (Typer's runner, the real app);
``demo`` runs with tripwires on the server and scenario runner, so a check that let a bad value through fails
the test instead of starting a backend.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diag.cli.main import app
from tests.paths import EXTERNAL

PROC_FIXTURE = EXTERNAL / "node_exporter" / "proc"
SUGGESTIONS_RE = re.compile(r"use (?:e\.g\.|one of) ([^;(]+)")


@dataclass(frozen=True)
class Case:
    """``diag ARGS OPTION BAD``: the message names OPTION, shows BAD, and suggests only accepted values."""

    args: tuple[str, ...]
    option: str
    bad: str
    suggests: bool  # the message must suggest values (durations, sizes, addresses, choices)
    sentinel: tuple[str, ...] = ()  # a bad value checked after OPTION; its error proves OPTION was accepted
    sentinel_says: str = ""

    @property
    def id(self) -> str:
        command = " ".join(a for a in self.args[:2] if not a.startswith("-"))
        return f"{command} {self.option} {Path(self.bad).name if '/' in self.bad else self.bad}"


def _cases(tmp: Path) -> list[Case]:
    a_file = tmp / "a-file"
    a_dir = tmp / "a-dir"
    snap = ("snapshot", "--no-gpu", "--proc-root", str(PROC_FIXTURE), "--sys-root", str(a_dir))
    snap_sentinel = ("--model-ext", "a/b")
    recorded = ("collect", "--no-gpu", "--no-kmsg", "--samples", "1")
    collect = ("collect", "--no-gpu", "--no-kmsg", "--samples", "1", "--recorder", str(tmp / "rec.db"))
    collect_sentinel = ("--model-ext", "a/b")
    analyze_sentinel = ("--recorder", str(tmp / "missing.db"))
    bundle = ("bundle", "--no-gpu", "-q")
    bundle_sentinel = ("--out", str(a_file))
    demo_sentinel = ("--param", "not-a-pair")
    serve = ("demo", "serve")
    serve_sentinel = ("--weights-dir", str(a_file))
    return [
        # snapshot: paths and numbers
        Case(
            ("snapshot", "--no-gpu"), "--proc-root", str(tmp / "not-proc"), False, ("--sys-root", str(tmp / "none")), "--sys-root"
        ),
        Case(("snapshot", "--no-gpu", "--proc-root", str(PROC_FIXTURE)), "--sys-root", str(tmp / "none"), False),
        Case(snap, "--cgroup", "system.slice/../x", True, snap_sentinel, "--model-ext"),
        Case(snap, "--model-ext", "a/b", True),
        Case(snap, "--top", "many", False, snap_sentinel, "--model-ext"),
        Case(snap, "--pid", "abc", False, snap_sentinel, "--model-ext"),
        # collect: durations, a size, an address, paths
        Case(collect, "--interval", "1d", True, collect_sentinel, "--model-ext"),
        Case(collect, "--interval", "soon", True, collect_sentinel, "--model-ext"),
        Case(collect, "--interval", "0", True, collect_sentinel, "--model-ext"),
        Case(collect, "--retention", "500d", True, collect_sentinel, "--model-ext"),
        Case(collect, "--retention", "abc", True, collect_sentinel, "--model-ext"),
        Case((*collect, "--interval", "1h"), "--retention", "1m", True, collect_sentinel, "--model-ext"),
        Case(collect, "--max-size", "1k", True, collect_sentinel, "--model-ext"),
        Case(collect, "--max-size", "lots", True, collect_sentinel, "--model-ext"),
        Case(collect, "--listen", "localhost", True, collect_sentinel, "--model-ext"),
        Case(collect, "--listen", "127.0.0.1:http", True, collect_sentinel, "--model-ext"),
        Case(collect, "--listen", "127.0.0.1:99999", True, collect_sentinel, "--model-ext"),
        Case(collect, "--diagnose-every", "often", True, collect_sentinel, "--model-ext"),
        Case(recorded, "--recorder", str(a_dir), True, collect_sentinel, "--model-ext"),
        Case(recorded, "--recorder", str(a_file / "r.db"), False),
        Case(collect, "--samples", "0", False, collect_sentinel, "--model-ext"),
        # analyze: a duration, an address, paths
        Case(("analyze",), "--since", "forever", True, analyze_sentinel, "--recorder"),
        Case(("analyze",), "--since", "0", True, analyze_sentinel, "--recorder"),
        Case(("analyze",), "--since", "500d", True, analyze_sentinel, "--recorder"),
        Case(("analyze",), "--prometheus", "ftp://x", True),
        Case(("analyze",), "--prometheus", "http://127.0.0.1:99999", False),
        Case(("analyze",), "--bundle", str(a_file), False),
        Case(("analyze",), "--recorder", str(tmp / "missing.db"), False),
        Case(("analyze",), "--recorder", str(a_dir), False),
        # bundle: durations, paths, a unit name
        Case(bundle, "--since", "yesterday", True, bundle_sentinel, "--out"),
        Case(bundle, "--since", "500d", True, bundle_sentinel, "--out"),
        Case(bundle, "--deadline", "1s", True, bundle_sentinel, "--out"),
        Case(bundle, "--deadline", "2h", True, bundle_sentinel, "--out"),
        Case(bundle, "--deadline", "x", True, bundle_sentinel, "--out"),
        Case(bundle, "--include", str(tmp / "nope.conf"), False, bundle_sentinel, "--out"),
        Case(bundle, "--include", str(a_dir), False, bundle_sentinel, "--out"),
        Case(bundle, "--unit", "vllm service; rm", True, bundle_sentinel, "--out"),
        Case(bundle, "--recorder", str(a_dir), False, bundle_sentinel, "--out"),
        Case(bundle, "--out", str(a_file), False),
        Case(bundle, "--pid", "-3", False, bundle_sentinel, "--out"),
        # demo --scenario: an enum, paths, parameters
        Case(("demo",), "--scenario", "nope", True, demo_sentinel, "--param"),
        Case(("demo", "--scenario", "leak"), "--keep-recorder", str(a_dir), True, demo_sentinel, "--param"),
        Case(("demo", "--scenario", "leak"), "--export", str(a_file / "x.jsonl.gz"), False, demo_sentinel, "--param"),
        Case(("demo", "--scenario", "leak"), "--weights-dir", str(a_file), False, demo_sentinel, "--param"),
        Case(("demo", "--scenario", "queue"), "--param", "ramp=fast", True, demo_sentinel, "not-a-pair"),
        Case(("demo", "--scenario", "leak"), "--param", "rate=fast", True, demo_sentinel, "not-a-pair"),
        # demo serve: enums, an address, numbers in a range, paths
        Case(serve, "--preload", "everywhere", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--refresh", "sometimes", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--batching", "bytes", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--log-level", "loud", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--host", "999.1.1.1", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--port", "70000", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--memory-guard", "2", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--psi-guard", "200", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--queue-size", "-5", True, serve_sentinel, "--weights-dir"),
        Case((*serve, "--experts", "1"), "--top-k", "8", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--workers", "0", False, serve_sentinel, "--weights-dir"),
        Case(serve, "--metrics-dialect", "vllm,sglang", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--metrics-dialect", "vllm,llmdiag", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--metrics-dialect", "tgi,tgi", True, serve_sentinel, "--weights-dir"),
        Case(serve, "--recorder", str(a_dir), True, serve_sentinel, "--weights-dir"),
        Case(serve, "--weights-dir", str(a_file), False),
    ]


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The files the cases point at, and tripwires: nothing may start a backend or a scenario here."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    import diag.demo.scenarios.runner as scenario_runner
    import diag.demo.server as demo_server

    def tripwire(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a refused command started its work")

    monkeypatch.setattr(demo_server, "serve", tripwire)
    monkeypatch.setattr(scenario_runner, "run_scenario", tripwire)
    return tmp_path


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stderr


def suggestions(message: str) -> list[str]:
    """The values a message suggests: every ``use e.g. …`` / ``use one of …`` list, split on ", " and " or "."""
    out: list[str] = []
    for listed in SUGGESTIONS_RE.findall(message):
        out += [v.strip() for v in re.split(r", | or ", listed.strip()) if v.strip()]
    return out


def test_suggestions_are_read_from_the_message() -> None:
    assert suggestions("diag: --x 'y': at most 1h; use e.g. 500ms, 1s or 5s") == ["500ms", "1s", "5s"]
    assert suggestions("diag: --x 'y': use one of a-b or c (c: cheap)") == ["a-b", "c"]
    assert suggestions("diag: --x 'y': nothing to suggest") == []


CASE_IDS = [c.id for c in _cases(Path("/tmp/ids"))]


@pytest.mark.parametrize("index", range(len(CASE_IDS)), ids=CASE_IDS)
def test_a_bad_value_gets_one_line_naming_option_and_value(world: Path, index: int) -> None:
    case = _cases(world)[index]
    code, err = _run(*case.args, case.option, case.bad, *case.sentinel)
    assert code == 2, (case.id, code, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    line = err.strip()
    assert line.startswith("diag: ") and case.option in line, line
    assert case.bad in line, f"the bad value is not shown: {line}"
    if case.suggests:
        assert suggestions(line), f"no accepted values suggested: {line}"
    else:
        assert "e.g." not in line or suggestions(line), line  # any example given is in the readable form


@pytest.mark.parametrize("index", range(len(CASE_IDS)), ids=CASE_IDS)
def test_every_suggested_value_is_accepted(world: Path, index: int) -> None:
    case = _cases(world)[index]
    _, err = _run(*case.args, case.option, case.bad, *case.sentinel)
    for value in suggestions(err):
        code, said = _run(*case.args, case.option, value, *case.sentinel)
        if case.sentinel:
            assert code == 2 and case.sentinel_says in said, f"{case.option} {value} (suggested) was refused: {said}"
            assert f"{case.option} {value}" not in said and f"{case.option} {value!r}" not in said, said
        else:
            assert f"{case.option} {value!r}" not in said and f"{case.option} {value}:" not in said, said
            assert "Traceback" not in said


def test_every_scenario_name_the_message_lists_is_one(world: Path) -> None:
    from diag.demo.scenarios.library import SCENARIOS

    _, err = _run("demo", "--scenario", "nope")
    assert sorted(suggestions(err)) == sorted(SCENARIOS)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["snapshot", "--nope"], "No such option: --nope"),
        (["collect", "--interval"], "'--interval' requires an argument"),
        (["tickets", "show", "x"], "'x': not a whole number"),
        (["demo", "serve", "--workers", "0"], "--workers 0: at least 1"),
    ],
)
def test_typers_own_usage_errors_are_one_line(args: list[str], says: str) -> None:
    code, err = _run(*args)
    assert code == 2 and err.strip().startswith("diag: ") and says in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_help_and_a_bare_command_still_show_the_help() -> None:
    result = CliRunner().invoke(app, ["collect", "--help"])
    assert result.exit_code == 0 and "--interval" in result.stdout
    bare = CliRunner().invoke(app, [])
    assert bare.exit_code == 2 and "snapshot" in bare.output and "collect" in bare.output
