"""A real PostgreSQL 15 on 127.0.0.1 for tests: ``initdb`` into a temporary folder, a free port, started,
restarted and stopped by PID.

Why a real one: what the PostgreSQL store relies on -- ``ON CONFLICT``, ``FOR UPDATE SKIP LOCKED``, advisory
locks released when a session dies, a server restart under open connections -- is the server's behaviour, and a
fake would only repeat our assumptions. The Debian package ``postgresql-15`` provides the binaries (``make
system-deps``); its own cluster is never started, we run our own. PostgreSQL refuses to run as root, so under
root the server runs as ``nobody`` (the data folder is given to it). Without the binaries the test is skipped
with the reason.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.promserver import free_port

BIN = Path("/usr/lib/postgresql/15/bin")
USER = "diag"  # the database superuser initdb creates; trust authentication on loopback only


def require_postgres() -> Path:
    """The folder of PostgreSQL 15's server binaries, or a skip naming what is missing."""
    for name in ("initdb", "postgres", "pg_isready"):
        if not (BIN / name).exists():
            pytest.skip(f"PostgreSQL 15 not installed ({BIN / name} missing; `make system-deps` installs postgresql-15)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed (`make install`)")
    return BIN


def _run_as() -> dict[str, object]:
    """Popen arguments to drop root (PostgreSQL will not run as root); nothing for an ordinary user."""
    if os.geteuid() != 0:
        return {}
    nobody = pwd.getpwnam("nobody")
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}


@dataclass
class PgServer:
    """One PostgreSQL cluster we own: its folder, port and process."""

    root: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    starts: int = field(default=0)

    @property
    def url(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/triage"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def start(self, timeout_s: float = 30.0) -> PgServer:
        """Start the server and wait, with a deadline, until it accepts connections."""
        cmd = [str(BIN / "postgres"), "-D", str(self.root / "data"), "-k", str(self.root), "-h", "127.0.0.1",
               "-p", str(self.port), "-c", "max_connections=100"]  # fmt: skip
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **_run_as())  # type: ignore[call-overload]
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: {self.log_tail()}")
            ready = subprocess.run(
                [str(BIN / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port), "-d", "triage", "-U", USER],
                check=False,
            )
            if ready.returncode == 0:
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres not ready after {timeout_s} s: {self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """A fast shutdown: SIGINT (open sessions are ended, committed data kept -- SIGTERM would wait for every
        client to leave); after 10 s an immediate one (SIGQUIT), then SIGKILL of the server's own process group
        (so no backend outlives it)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGINT, signal.SIGQUIT):
            os.kill(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
                return
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


def _initdb(root: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(root, "nobody", "nogroup")
    subprocess.run(
        [str(BIN / "initdb"), "-D", str(root / "data"), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync"],
        check=True, capture_output=True, **_run_as(),  # type: ignore[call-overload]
    )  # fmt: skip


@contextlib.contextmanager
def postgres() -> Iterator[PgServer]:
    """A fresh cluster with an empty ``triage`` database; stopped and deleted afterwards."""
    require_postgres()
    root = Path(tempfile.mkdtemp(prefix="llmdiag-pg-"))
    server = PgServer(root, free_port())
    try:
        _initdb(root)
        server.start()
        subprocess.run(
            [str(BIN / "createdb"), "-h", "127.0.0.1", "-p", str(server.port), "-U", USER, "triage"],
            check=True, capture_output=True,
        )  # fmt: skip
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def reset(url: str) -> None:
    """Drop every table of the store (a fresh store for the next test on a shared server)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
