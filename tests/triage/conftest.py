"""The triage store's backends for the tests that run on both: a SQLite file, or a real PostgreSQL 15.

One PostgreSQL server per test session (per xdist worker), started on first use; each test gets an emptied
database, so the server's start (~1 s) is paid once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pgserver import PgServer, postgres, reset


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    with postgres() as server:
        yield server


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.process)])
def store_target(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    """Where the store under test lives: ``--db``'s value for the backend of this run."""
    if request.param == "sqlite":
        return tmp_path / "t.db"
    server: PgServer = request.getfixturevalue("pg_server")
    reset(server.url)
    return server.url
