"""``diag analyze --fleet``'s options are refused before any query, each with one line naming the option.

The Prometheus given is a port nobody listens on: had a check let the command reach the query stage, the
message would be "cannot reach Prometheus" instead of the option's own. In-process (Typer's runner, the real app).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from diag.cli.main import app

NOWHERE = "http://127.0.0.1:9"  # the discard port: refused at once on loopback, if it were ever contacted
FLEET = ("--prometheus", NOWHERE, "--fleet", 'job="llm"')


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--fleet", 'job="llm"'), "--fleet needs --prometheus"),
        ((*FLEET, "--bundle", "."), "--bundle cannot be used with --fleet"),
        ((*FLEET, "--recorder", "x.db"), "--recorder cannot be used with --fleet"),
        ((*FLEET, "--selector", 'instance="a"'), "--selector cannot be used with --fleet"),
        (("--prometheus", NOWHERE, "--fleet", " {} "), "--fleet '': give label matchers"),
        ((*FLEET, "--by", "9lives"), "--by '9lives': not a label name"),
        ((*FLEET, "--by", "__name__"), "--by '__name__': not a label name"),
        ((*FLEET, "--by", 'instance"'), "not a label name"),
        ((*FLEET, "--jobs", "0"), "--jobs 0: from 1 to 256"),
        (("--prometheus", NOWHERE, "--by", "host"), "--by cannot be used without --fleet"),
        (("--prometheus", NOWHERE, "--jobs", "2"), "--jobs cannot be used without --fleet"),
    ],
)
def test_a_bad_fleet_option_is_refused_before_any_query(args: tuple[str, ...], says: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["analyze", *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "cannot reach" not in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_good_fleet_options_reach_the_server() -> None:
    """The same options, valid: the command gets as far as the (absent) server, and says so in one line."""
    result = CliRunner().invoke(app, ["analyze", *FLEET, "--by", "host", "--jobs", "2"])
    assert result.exit_code == 2 and "cannot reach Prometheus at http://127.0.0.1:9" in result.output
