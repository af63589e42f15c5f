"""The process mark is enforced (tests/tiers.py): an unmarked test that starts a process or a server fails.

Why: ``make check`` deselects ``process`` tests and promises to start nothing. Each way below of starting
a process or serving a socket is tried in a child pytest (pytester, so the child's refusals cannot
disturb this session) by an unmarked test -- one of them catching the refusal, one reaching for a lower
level API -- and must fail there, with the process never started; marked tests doing the same pass.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.process

CHILD_TESTS = """
import multiprocessing
import os
import socket
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

TOUCHED = {touched!r}


def test_unmarked_subprocess_that_swallows_the_refusal():
    try:
        subprocess.run(["sh", "-c", "touch " + TOUCHED + "/subprocess"], check=True)
    except Exception:
        pass


def test_unmarked_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_unmarked_posix_spawn():
    os.posix_spawn("/bin/sh", ["sh", "-c", "touch " + TOUCHED + "/posix_spawn"], dict(os.environ))


def test_unmarked_os_system():
    os.system("touch " + TOUCHED + "/system")


def test_unmarked_multiprocessing_spawn():
    process = multiprocessing.get_context("spawn").Process(target=print)
    process.start()
    process.join()


def test_unmarked_thread_served_http_server():
    HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler).server_close()


@pytest.fixture
def listening():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock
    sock.close()


def test_unmarked_server_from_a_fixture(listening):
    pass


@pytest.mark.process
def test_marked_subprocess():
    out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True)
    assert out.stdout == "42\\n"


@pytest.mark.process
def test_marked_server(listening):
    assert listening.getsockname()[1] > 0


def test_unmarked_pure():
    assert sum(range(10)) == 45
"""


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str) -> pytest.RunResult:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(test_child=source)
    return pytester.runpytest_subprocess("-p", "tests.tiers", "-p", "no:cacheprovider", "-rfE")


def test_unmarked_tests_that_start_processes_or_servers_fail(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    touched = tmp_path / "touched"
    touched.mkdir()
    result = _run(pytester, monkeypatch, CHILD_TESTS.format(touched=str(touched)))
    result.assert_outcomes(passed=3, failed=6, errors=1)
    out = result.stdout.str()
    for name, what in [
        ("test_unmarked_subprocess_that_swallows_the_refusal", r"subprocess\.Popen\(sh -c touch"),
        ("test_unmarked_fork", r"os\.fork"),
        ("test_unmarked_posix_spawn", r"os\.posix_spawn\('/bin/sh'\)"),
        ("test_unmarked_os_system", r"os\.system"),
        ("test_unmarked_multiprocessing_spawn", r"_posixsubprocess\.fork_exec"),
        ("test_unmarked_thread_served_http_server", r"socket\.bind\(\('127\.0\.0\.1', 0\)\)"),
        ("test_unmarked_server_from_a_fixture", r"socket\.bind\(.*\) in fixture 'listening'"),
    ]:
        pattern = rf"test_child\.py::{name} starts a process or a server \({what}.*not marked @pytest\.mark\.process"
        assert re.search(pattern, out), (name, out)
    # Refused means never started: none of the unmarked commands ran.
    assert sorted(p.name for p in touched.iterdir()) == []


def test_a_spawn_at_import_time_fails_the_collection(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    source = textwrap.dedent(
        """
        import subprocess

        VERSION = subprocess.run(["true"]).returncode


        def test_never_collected():
            pass
        """
    )
    result = _run(pytester, monkeypatch, source)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*collection starts a process or a server (subprocess.Popen(true)*not marked*"])
