"""The files llm-diag ships for a deployment, read verbatim and rewritten only where a test must.

Why: every part passes its own tests, yet what a user assembles from the shipped files had never run --
the generated Alertmanager routes posted to paths the receiver did not serve, and every alert was lost.
The end-to-end test builds its stack from these files exactly as the README says to use them. The only
changes are the ones a test host forces, each done here in one place and nowhere else:

- **paths**: ``/opt/llm-diag/bin/`` (where the README installs the venv) becomes this venv's ``bin/``,
  and systemd's ``%S`` (``/var/lib`` for system units) becomes a temporary state root;
- **hosts and ports**: every ``HOST:PORT`` -- in a unit's ``--listen``, a scrape target, a webhook URL --
  becomes ``127.0.0.1:<free port>``, through one table from the shipped port to the test's port. A
  DNS service-discovery block becomes static targets at those addresses (a DNS query would leave the
  machine). An address whose port the table does not know fails the test: a new shipped address must be
  wired on purpose, not silently dropped.
"""

from __future__ import annotations

import copy
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from tests.deploy.shipped import SCRAPE, TRIAGE_UNIT, UNIT, exec_start  # noqa: F401 (re-exported for the e2e test)
from tests.paths import REPO

AGENT_UNIT = UNIT
SCRAPE_CONFIG = SCRAPE
GENERATED_ALERTS = REPO / "alerts" / "generated"
GENERATED_DASHBOARDS = REPO / "dashboards" / "generated"
INSTALL_BIN = "/opt/llm-diag/bin/"
ADDRESS = re.compile(r"^(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


@dataclass
class Rewrite:
    """Shipped paths and addresses -> this test host's (see the module docstring)."""

    state_root: Path
    ports: dict[int, int] = field(default_factory=dict)  # shipped port -> local port
    bin_dir: Path = field(default_factory=lambda: Path(sys.executable).parent)

    def address(self, text: str) -> str:
        m = ADDRESS.match(text)
        if m is None:
            raise ValueError(f"not a HOST:PORT address: {text!r}")
        port = int(m["port"])
        if port not in self.ports:
            raise KeyError(f"shipped address {text} uses port {port}, which the test does not map: wire it in the test")
        return f"127.0.0.1:{self.ports[port]}"

    def url(self, text: str) -> str:
        parts = urlsplit(text)
        return urlunsplit(parts._replace(netloc=self.address(parts.netloc)))

    def word(self, word: str) -> str:
        """One command-line word: the install path, ``%S`` and any HOST:PORT value (``--opt=HOST:PORT`` too)."""
        if word.startswith(INSTALL_BIN):
            word = str(self.bin_dir / word[len(INSTALL_BIN) :])
        word = word.replace("%S", str(self.state_root))
        prefix, eq, value = word.rpartition("=") if word.startswith("--") and "=" in word else ("", "", word)
        if ADDRESS.match(value):
            value = self.address(value)
        elif re.match(r"^https?://", value):
            value = self.url(value)
        return prefix + eq + value

    def argv(self, argv: list[str]) -> list[str]:
        return [self.word(w) for w in argv]


def scrape_config(rw: Rewrite) -> dict[str, Any]:
    """``prometheus-scrape.yaml`` with every target rewritten (DNS discovery becomes the same targets, static)."""
    doc = yaml.safe_load(SCRAPE_CONFIG.read_text())
    for job in doc.get("scrape_configs") or []:
        statics = job.get("static_configs") or []
        for block in statics:
            block["targets"] = [rw.address(t) for t in block.get("targets") or []]
        for dns in job.pop("dns_sd_configs", []) or []:
            statics.append({"targets": [rw.address(f"{name}:{dns['port']}") for name in dns["names"]]})
        job["static_configs"] = statics
    return doc


def alertmanager_config(rw: Rewrite, base: dict[str, Any]) -> dict[str, Any]:
    """A user's Alertmanager configuration with the generated file merged in as the README says.

    The README: merge ``route.routes``, ``receivers`` and ``inhibit_rules`` of ``alerts/generated/alertmanager.yaml``
    into your configuration. The webhook URLs are rewritten to the test's receiver, nothing else.
    """
    generated = yaml.safe_load((GENERATED_ALERTS / "alertmanager.yaml").read_text())
    doc = copy.deepcopy(base)
    doc.setdefault("route", {}).setdefault("routes", []).extend(generated["route"]["routes"])
    receivers = copy.deepcopy(generated["receivers"])
    for receiver in receivers:
        for hook in receiver.get("webhook_configs") or []:
            hook["url"] = rw.url(hook["url"])
    doc.setdefault("receivers", []).extend(receivers)
    doc.setdefault("inhibit_rules", []).extend(generated.get("inhibit_rules") or [])
    return doc


def webhook_urls(config: dict[str, Any]) -> list[str]:
    return [h["url"] for r in config.get("receivers") or [] for h in r.get("webhook_configs") or []]


def rule_files() -> list[Path]:
    return sorted(GENERATED_ALERTS.glob("*.rules.yaml"))
