"""Which xdist group a live test runs in (tests/conftest.py::xdist_group_of), and the host lock the group holds.

Why: ``make test``'s wall time is the serial ``live`` group's, so a live test may leave it -- but only by saying
why (``host_quiet(reason)``), and a new live test that says nothing must stay in it. A test that leaves it and
still makes a fault for part of its time holds ``livecg.host_exclusive`` meanwhile; that lock must exclude
across processes (xdist workers) and must not let the group's worker, which takes it again after every test,
starve a waiter.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import livecg
from tests.conftest import host_quiet_reason, xdist_group_of
from tests.paths import REPO

CASES = """
import pytest

@pytest.fixture(scope="module")
def stack():
    return 1

@pytest.mark.live
def test_live_by_default():
    pass

@pytest.mark.live
@pytest.mark.host_quiet(reason="reads a limit")
def test_quiet_spread_freely():
    pass

@pytest.mark.live
@pytest.mark.host_quiet(reason="queries its own stack")
def test_quiet_with_its_module(stack):
    pass

@pytest.mark.live
@pytest.mark.xdist_group("own")
def test_explicit_group_wins():
    pass

def test_not_live():
    pass

@pytest.mark.live
@pytest.mark.host_quiet
def test_quiet_without_reason():
    pass

@pytest.mark.host_quiet(reason="not live")
def test_quiet_but_not_live():
    pass
"""


def test_live_tests_stay_in_the_serial_group_unless_they_say_why(pytester: pytest.Pytester) -> None:
    items = {item.name: item for item in pytester.getitems(CASES)}
    assert xdist_group_of(items["test_live_by_default"]) == "live"
    assert xdist_group_of(items["test_quiet_spread_freely"]) is None
    assert xdist_group_of(items["test_quiet_with_its_module"]) == items["test_quiet_with_its_module"].nodeid.split("::")[0]
    assert xdist_group_of(items["test_explicit_group_wins"]) is None  # its own mark is kept as it is
    assert xdist_group_of(items["test_not_live"]) is None
    assert host_quiet_reason(items["test_quiet_spread_freely"]) == "reads a limit"
    with pytest.raises(pytest.UsageError, match="needs its reason"):
        xdist_group_of(items["test_quiet_without_reason"])
    with pytest.raises(pytest.UsageError, match="for live tests only"):
        host_quiet_reason(items["test_quiet_but_not_live"])


def test_host_exclusive_is_a_no_op_without_workers_and_reentrant_with_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(livecg, "host_lock_dir", None)
    with livecg.host_exclusive(), livecg.host_exclusive():
        assert not list(tmp_path.iterdir())
    monkeypatch.setattr(livecg, "host_lock_dir", tmp_path)
    with livecg.host_exclusive(), livecg.host_exclusive():  # a live-group test whose fixture holds it too: no deadlock
        fd = os.open(tmp_path / "live-host.lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, as another process sees it
        finally:
            os.close(fd)


WAITER = """
import sys, time
from pathlib import Path
from tests import livecg
livecg.host_lock_dir = Path(sys.argv[1])
print("waiting", flush=True)
with livecg.host_exclusive():
    Path(sys.argv[2]).write_text(repr(time.monotonic()))
    time.sleep(0.5)
"""


def _held_by_another(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken here
    return False


@pytest.mark.process
def test_a_waiting_worker_gets_the_host_before_the_holder_takes_it_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The live group's worker releases the host after a test and asks again at once: the waiter goes first."""
    monkeypatch.setattr(livecg, "host_lock_dir", tmp_path)
    got = tmp_path / "waiter-had-it"
    with livecg.host_exclusive():
        waiter = subprocess.Popen([sys.executable, "-c", WAITER, str(tmp_path), str(got)], cwd=REPO, stdout=subprocess.PIPE,
                                  text=True)  # fmt: skip
        try:
            assert waiter.stdout is not None and waiter.stdout.readline() == "waiting\n"
            deadline = time.monotonic() + 30
            while not _held_by_another(tmp_path / "live-turnstile.lock") and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _held_by_another(tmp_path / "live-turnstile.lock"), "the waiter never queued"
            time.sleep(0.2)
            assert not got.exists(), "the waiter had the host while this process held it"
        except BaseException:
            waiter.kill()
            waiter.wait()
            raise
    with livecg.host_exclusive():  # taken again at once, as between two tests of the live group
        assert got.exists(), "the holder took the host again before the waiting worker had its turn"
        entered = time.monotonic()
    assert waiter.wait(timeout=30) == 0
    assert float(got.read_text()) < entered


STACK_MODULE = """
import fcntl, os, subprocess, sys, time
from pathlib import Path
import pytest
from tests import livecg

livecg.host_lock_dir = Path(os.environ["LOCK_DIR"])
GOT = livecg.host_lock_dir / "waiter-had-it"

def _turnstile_taken():
    fd = os.open(livecg.host_lock_dir / "live-turnstile.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False

@pytest.fixture(scope="module")
def stack():
    yield "agent"

@pytest.mark.live
def test_first(stack):
    assert livecg.holds_host()
    # another worker asks for the host now (the dashboards' stack, about to OOM-kill)
    waiter = subprocess.Popen([sys.executable, "-c", os.environ["WAITER"], str(livecg.host_lock_dir), str(GOT)],
                              stdout=subprocess.PIPE, text=True)
    assert waiter.stdout.readline() == "waiting\\n"
    deadline = time.monotonic() + 30
    while not _turnstile_taken() and time.monotonic() < deadline:
        time.sleep(0.01)
    pytest.waiter = waiter

@pytest.mark.live
def test_second_on_the_same_stack(stack):
    assert not GOT.exists(), "the host was free between two tests of one stack"

def test_not_live():
    assert pytest.waiter.wait(timeout=30) == 0
    assert GOT.exists()
"""


@pytest.mark.process
def test_the_live_group_holds_the_host_across_the_tests_of_one_stack(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Between two live tests on one module-scoped stack the host stays held: a fault made in that gap would stay in the
    stack's agent and alert windows and be judged by the next test. After the module's last one it is released."""
    pytester.makepyfile(test_stack=STACK_MODULE)
    pytester.makeini("[pytest]\nmarkers =\n    live: x\n    host_quiet: x\n    process: x\n")
    for key, value in {"LOCK_DIR": str(tmp_path), "PYTHONPATH": str(REPO), "WAITER": WAITER}.items():
        pytester._monkeypatch.setenv(key, value)
    result = pytester.runpytest_subprocess("-p", "tests.conftest", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=3)
