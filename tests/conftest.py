"""Suite-wide test plumbing.

- Live tests (root, real cgroups, /dev/kmsg) carry ``@pytest.mark.live`` so that
  ``pytest -m "not live"`` is the suite an ordinary user can run. The mark is enforced, not trusted:
  ``tests.livecg.require_live`` (which every cgroup helper calls) fails a test that needs the live
  tier without the mark, so a new unmarked live test fails loudly as root instead of skipping
  silently for everyone else.
- Tests that start a process or a server carry ``@pytest.mark.process``; those over 10 s ``@pytest.mark.slow``.
  ``make check`` runs ``-m "not live and not process and not slow"``. The process mark is enforced too:
  ``tests/tiers.py`` (loaded below as a plugin) refuses and fails an unmarked test that starts one.
- Shared helpers live in helper modules (``tests/livecg.py``, ``tests/promserver.py``,
  ``tests/paths.py``, ``tests/sharedruns.py``, ``tests/diag/*_builders.py``, ``tests/bundle/helpers.py``);
  test modules never import each other (``tests/test_import_cycles.py`` checks it).
- Expensive live runs that several modules check are session fixtures here, made lazily by the first
  test that asks (``leak_scenario``, ``joint_runs``: tests/sharedruns.py says why).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests import livecg
from tests.sharedruns import SharedScenario, joint_views

# Property tests explore new random examples on every local run (make check), so a counterexample turns up at a
# developer's desk; .ci/run sets HYPOTHESIS_PROFILE=ci, where they replay the same derandomised examples, so a
# landing is judged on the code, never on which examples that run happened to draw.
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# tests.tiers enforces the process mark (a plugin, so its hooks wrap every test's protocol);
# pytester runs it in a child pytest to test that enforcement (tests/test_tiers.py).
pytest_plugins = ["tests.tiers", "pytester"]


# Fixtures wider than a function that cost nothing to make again: they do not tie their tests to one worker.
_CHEAP_WIDE_FIXTURES = frozenset({"_private_state_dir", "scenario_weights", "tmp_path_factory", "worker_id", "testrun_uid"})


def xdist_group_of(item: pytest.Item) -> str | None:
    """The xdist group ``make test`` (``-n ... --dist loadgroup``) runs ``item`` in, or None to spread it freely.

    - a test using a session-scoped fixture (a real scenario run several modules check, ``leak_scenario``)
      runs in that fixture's group: made once per worker, it would otherwise be made once per worker;
    - a test using a module- (or class-, package-) scoped fixture runs with the rest of its module, for the
      same reason: such a fixture is a stack (servers, a Prometheus, a demo backend).
    - ``live`` tests share one group, before both: they diagnose *this host* -- its OOM kills (/dev/kmsg is
      host-wide), other cgroups' memory and pressure -- so two at once see each other's faults (measured: run
      side by side, healthy and moe-skew scenarios were judged noisy_neighbour, a queue backlog inconclusive
      after another test's OOM kill). Every live test is in it unless it says otherwise: the safe default.
    - a ``live`` test also marked ``host_quiet(reason)`` leaves that group (then the two rules above place it):
      it needs root or a cgroup only -- it makes no fault the host shows (no OOM kill, no thrash, no pressure,
      no neighbour growing) but inside ``livecg.host_exclusive()``, and judges nothing the host shows (no
      verdict, no host-wide reading), so it neither disturbs nor is disturbed by the faults of the live group.
      CPU load is no such fault: the live group shares the cores with the other workers' process tests anyway,
      and its judged tests are written for that (the service at a raised priority where it matters, a second
      attempt). The reason is the test's own classification, written where the test is; ``host_quiet_reason``
      refuses the mark without one.
    An explicit ``@pytest.mark.xdist_group`` wins over all of them.
    """
    if item.get_closest_marker("xdist_group") is not None:
        return None
    if item.get_closest_marker("live") is not None and host_quiet_reason(item) is None:
        return "live"
    info = getattr(item, "_fixtureinfo", None)
    wide = [
        (name, defs[-1].scope)
        for name, defs in (info.name2fixturedefs.items() if info is not None else ())
        if name not in _CHEAP_WIDE_FIXTURES and defs and defs[-1].scope != "function"
    ]
    for name, scope in wide:
        if scope == "session":
            return name
    return item.nodeid.split("::", 1)[0] if wide else None


def host_quiet_reason(item: pytest.Item) -> str | None:
    """The reason a live test gives for leaving the serial ``live`` group, or None when it stays there.

    The mark is a claim about the host, so it must say why it holds, and it only means something on a live test:
    a ``host_quiet`` mark without a reason, or on a test that is not ``live``, is a usage error at collection.
    """
    mark = item.get_closest_marker("host_quiet")
    if mark is None:
        return None
    reason = mark.kwargs.get("reason", mark.args[0] if mark.args else "")
    if not isinstance(reason, str) or not reason.strip():
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.host_quiet needs its reason (reason=...): why the host cannot tell")
    if item.get_closest_marker("live") is None:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.host_quiet is for live tests only (it takes one out of the live group)"
        )
    return reason


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = xdist_group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def _in_live_group(item: pytest.Item) -> bool:
    mark = item.get_closest_marker("xdist_group")
    return mark is not None and (mark.args[0] if mark.args else mark.kwargs.get("name")) == "live"


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker, where the workers meet: its basetemp is ``<the run's folder>/<worker id>``."""
    if os.environ.get("PYTEST_XDIST_WORKER") and config.option.basetemp:
        livecg.host_lock_dir = Path(config.option.basetemp).parent


def _stack_fixtures(item: pytest.Item) -> set[str]:
    """The fixtures wider than a test (module, class, package scope) that ``item`` uses: its stack."""
    info = getattr(item, "_fixtureinfo", None)
    return {
        name
        for name, defs in (info.name2fixturedefs.items() if info is not None else ())
        if name not in _CHEAP_WIDE_FIXTURES and defs and defs[-1].scope not in ("function", "session")
    }


def _same_live_stack(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """True when ``nextitem`` is a live-group test of ``item``'s module on the same module-scoped stack."""
    return (
        nextitem is not None
        and _in_live_group(nextitem)
        and nextitem.path == item.path
        and bool(_stack_fixtures(item) & _stack_fixtures(nextitem))
    )


_live_hold = contextlib.ExitStack()  # the host lock while a live module's stack lives on over several tests


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test of the ``live`` group holds the host (``livecg.host_exclusive``) from its setup to its teardown --
    and past it, up to the last test of its module, while the next test runs on the same module-scoped stack.

    The group already runs one test at a time on its worker; the lock is for the few tests elsewhere that make a
    fault the host shows only for part of their time and hold it meanwhile (the dashboards' live stack). Why
    the whole module: a stack's agent and Prometheus keep what the host showed between two tests -- an OOM kill
    made beside them in that gap is in /dev/kmsg for the agent and in a 5-minute ``increase()`` for the alert,
    so the next test's own kill would find that alert already firing (measured: the kernel-OOM page of the
    live alert test never came, because another stack's kill between two tests had fired it).
    """
    if _in_live_group(item) and not livecg.holds_host():
        _live_hold.enter_context(livecg.host_exclusive())
    try:
        yield
    finally:
        if not _same_live_stack(item, nextitem):
            _live_hold.close()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tell the live helpers which test is being set up (before any of its fixtures run)."""
    livecg.current_test = item


def pytest_runtest_teardown(item: pytest.Item) -> None:
    livecg.current_test = None


@pytest.fixture(autouse=True, scope="session")
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test reads or writes the real state directories (as root: /var/lib/llm-diag, the units' own).

    A test that wants the default location sets ``LLMDIAG_STATE_DIR`` (or deletes it) itself.
    """
    import os

    os.environ["LLMDIAG_STATE_DIR"] = str(tmp_path_factory.mktemp("llm-diag-state"))


@pytest.fixture(scope="session")
def scenario_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One weights folder for every scenario run of the session (made on the first run, reused after)."""
    return tmp_path_factory.mktemp("scenario-weights")


@pytest.fixture(scope="session")
def leak_scenario(tmp_path_factory: pytest.TempPathFactory, scenario_weights: Path) -> SharedScenario:
    """The ``leak`` scenario's real runs, made once per session (live tests only: they need root and cgroups)."""
    livecg.require_live()
    return SharedScenario("leak", scenario_weights, tmp_path_factory.mktemp("leak-scenario"))


@pytest.fixture(scope="session")
def joint_runs(tmp_path_factory: pytest.TempPathFactory, scenario_weights: Path) -> dict[str, SharedScenario]:
    """The joint runs (the tracker and the engines' dialects at once), one ``SharedScenario`` per scenario that has
    them (``sharedruns.joint_views``), each made when a test first asks for an attempt."""
    from diag.demo.scenarios import SCENARIO_NAMES

    livecg.require_live()
    folder = tmp_path_factory.mktemp("joint-runs")
    return {
        name: SharedScenario(name, scenario_weights, folder / name, views=views)
        for name in SCENARIO_NAMES
        if (views := joint_views(name))
    }
