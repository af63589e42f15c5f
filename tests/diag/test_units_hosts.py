"""``diag.units.is_loopback``: the one answer to "is this host this machine?" for every command that asks."""

from __future__ import annotations

import pytest

from diag.units import is_loopback


@pytest.mark.parametrize("host", ["localhost", "LocalHost", "127.0.0.1", "127.255.0.9", "::1", "[::1]", " 127.0.0.1 "])
def test_this_machine(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["", "0.0.0.0", "::", "10.0.0.5", "192.168.1.1", "[2001:db8::1]", "example.com", "localhost.example.com",
             "128.0.0.1", "127.0.0.1.nip.io"],
)  # fmt: skip
def test_anywhere_else(host: str) -> None:
    """An unspecified address (a server bound to every address) and a name that only resolves here are not loopback."""
    assert not is_loopback(host)
