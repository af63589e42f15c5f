"""``--header``/``--tenant`` are checked before any query, and a refusal never repeats a header's value.

In-process (Typer's runner, the real app), against the discard port: had a check let the command reach the
query stage, the message would be "cannot reach Prometheus" instead of the option's own. The values carry
bearer tokens, so no message may contain one (the checks name a header by its position and name only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from diag.cli.main import app
from diag.sources.prometheus import TENANT_HEADER, request_headers

NOWHERE = "http://127.0.0.1:9"
TOKEN = "s3cr3t-7d1f0c9a-token"
COMMANDS = (
    ["analyze", "--prometheus", NOWHERE, "--fleet", 'job="llm"'],
    ["analyze", "--prometheus", NOWHERE],
    ["dashboards", "preview", "--prometheus", NOWHERE, "--out", "/nonexistent/p.html"],
    ["triage", "serve", "--prometheus", NOWHERE],  # refused while its options are checked, before it listens
)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--header", f"Authorization Bearer {TOKEN}"], "--header (1st): expected 'Name: value'"),
        (["--header", f"Bad Name: {TOKEN}"], "--header (1st): the name before ':' is not an HTTP header name"),
        (["--header", "X-A: 1", "--header", f"Authorization: Bearer {TOKEN}\r\nX-Evil: 1"], "--header (2nd, Authorization)"),
        (["--header", f"Authorization: Bearer {TOKEN}é"], "control or non-ASCII"),
        (["--header", f"Authorization: Bearer {TOKEN}", "--header", f"authorization: {TOKEN}"], "given twice"),
        (["--header", "Authorization:"], "--header (1st, Authorization): empty value"),
        (["--header", f"Host: {TOKEN}"], "set by the HTTP client itself"),
        (["--tenant", "team a"], "--tenant: 1-150 letters"),
        (["--tenant", "team-a", "--header", f"X-Scope-OrgID: {TOKEN}"], "the same header twice"),
    ],
)
def test_a_malformed_header_is_refused_before_any_query_without_showing_it(args: list[str], says: str) -> None:
    for command in COMMANDS:
        result = CliRunner().invoke(app, [*command, *args])
        assert result.exit_code == 2, (command, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "cannot reach" not in lines[0], (command, result.output)
        assert TOKEN not in result.output


def test_good_headers_reach_the_server() -> None:
    """Valid, the same options get the command as far as the (absent) server."""
    for command in COMMANDS[:2]:
        result = CliRunner().invoke(app, [*command, "--header", f"Authorization: Bearer {TOKEN}", "--header",
                                          "X-Api-Key: k", "--tenant", "team-a|team-b"])  # fmt: skip
        assert result.exit_code == 2 and "cannot reach Prometheus at http://127.0.0.1:9" in result.output, result.output
        assert TOKEN not in result.output


def test_the_options_need_prometheus(tmp_path: Path) -> None:
    for command in (["analyze", "--recorder", str(tmp_path / "x.db")],
                    ["triage", "serve", "--no-diagnosis", "--db", str(tmp_path / "t.db")]):  # fmt: skip
        result = CliRunner().invoke(app, [*command, "--tenant", "team-a", "--header", f"Authorization: Bearer {TOKEN}"])
        assert result.exit_code == 2 and "--prometheus" in result.output and TOKEN not in result.output, result.output


def test_the_headers_as_sent() -> None:
    """Names as given, values trimmed, the tenant under its header; several tenants joined with | pass."""
    got = request_headers([f"Authorization:  Bearer {TOKEN} ", "X-Api-Key:k"], "a|b")
    assert got == {"Authorization": f"Bearer {TOKEN}", "X-Api-Key": "k", TENANT_HEADER: "a|b"}
    assert request_headers() == {}
