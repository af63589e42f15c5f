"""The ``process`` mark is enforced, not trusted: a test that starts a process or a server without it fails.

Why: ``make check`` (``-m "not live and not process and not slow"``) is the quick loop an ordinary user
runs before each commit; it promises to start no process and serve nothing. An unmarked test that does
would break that promise silently -- and would be the one to slow the loop down or to collide with a
parallel worker on a port. So the mark is checked where the process or the server is made:

- a CPython audit hook (``sys.addaudithook``) sees every ``subprocess.Popen``, ``os.fork``/``forkpty``,
  ``os.posix_spawn``, ``os.exec*``, ``os.spawn*``, ``os.system`` and ``socket.bind`` (every server,
  thread-served HTTP ones included, binds). An audit hook cannot be removed once added, and
  monkeypatching ``subprocess``/``os`` does not route around it: the events are raised in C.
- ``_posixsubprocess.fork_exec`` -- what multiprocessing's spawn/forkserver start methods call
  directly, without an audit event in every Python this project supports -- is wrapped as well.

A ``live`` test may start processes too: live means real cgroups with real processes in them, and the
quick tier leaves it out as well (the live mark is enforced by tests/livecg.py).

An unmarked test's attempt is refused (the audit hook raises, so nothing is started) *and* recorded;
the test's report is then turned into a failure whatever the test did with the exception, so catching
it cannot hide the violation. ``tests/test_tiers.py`` tests this enforcement itself.

Import-time spawns of test modules (during collection) are refused the same way: collection of the
quick tier must not start processes either.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

# The events that start a process or open a server socket.
_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.exec",
        "os.spawn",
        "os.system",
        "socket.bind",
        "pty.spawn",
    }
)

_current: pytest.Item | None = None
_collecting = False
_violations: dict[str, list[str]] = {}
# The fixtures being set up right now, innermost last: a refusal names the one that tried (every test using it needs the mark).
_fixtures: list[str] = []
_installed = False


class UnmarkedProcessError(PermissionError):
    """Raised where an unmarked test tries to start a process or a server."""


def _describe(event: str, args: tuple[Any, ...]) -> str:
    if event == "subprocess.Popen":
        executable, argv = args[0], args[1]
        shown = argv if isinstance(argv, (str, bytes)) else " ".join(map(str, list(argv or [])[:4]))
        return f"subprocess.Popen({shown or executable!s})"
    if event == "socket.bind":
        return f"socket.bind({args[1]!r})"
    if event in ("os.exec", "os.posix_spawn", "os.spawn"):
        return f"{event}({args[0]!r})"
    return event


def _unmarked_owner() -> str | None:
    """The node id to blame when a process starts now, or None when starting one is allowed."""
    item = _current
    if item is not None:
        allowed = item.get_closest_marker("process") is not None or item.get_closest_marker("live") is not None
        return None if allowed else item.nodeid
    return "collection" if _collecting else None


def _refuse(what: str) -> None:
    owner = _unmarked_owner()
    if owner is None:
        return
    where = f" in fixture {_fixtures[-1]!r}" if _fixtures else ""
    message = f"{owner} starts a process or a server ({what}){where} but is not marked @pytest.mark.process"
    _violations.setdefault(owner, []).append(message)
    raise UnmarkedProcessError(message)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _EVENTS:
        _refuse(_describe(event, args))


def _wrap_fork_exec() -> None:
    import _posixsubprocess

    original = _posixsubprocess.fork_exec
    if getattr(original, "_llmdiag_tiers", False):
        return

    def fork_exec(*args: Any, **kwargs: Any) -> Any:
        _refuse(f"_posixsubprocess.fork_exec({args[0]!r})")
        return original(*args, **kwargs)

    fork_exec._llmdiag_tiers = True  # type: ignore[attr-defined]
    _posixsubprocess.fork_exec = fork_exec  # type: ignore[assignment]


def install() -> None:
    """Add the audit hook (once per interpreter: audit hooks cannot be removed)."""
    global _installed
    if _installed:
        return
    sys.addaudithook(_audit)
    _wrap_fork_exec()
    _installed = True


def pytest_configure(config: pytest.Config) -> None:
    """Add the audit hook before collection, so import-time spawns of test modules are refused too."""
    config.addinivalue_line("markers", "process: starts a process or a server (enforced by tests/tiers.py)")
    install()


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    global _collecting
    _collecting = True
    try:
        yield
    finally:
        _collecting = False


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _current
    _current = item
    try:
        yield
    finally:
        _current = None


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Iterator[None]:
    _fixtures.append(fixturedef.argname)
    try:
        yield
    finally:
        _fixtures.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    found = _violations.pop(item.nodeid, None)
    if not found:
        return
    # The phase (setup, call or teardown) in which the attempt was made fails, whatever the test did with
    # the exception: caught, the refusal would otherwise leave a passing test that never ran its process.
    report: pytest.TestReport = outcome.get_result()
    report.outcome = "failed"
    report.longrepr = "\n".join(dict.fromkeys(found))
