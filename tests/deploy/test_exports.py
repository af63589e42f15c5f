"""Every metric the committed rules read is exported by something the shipped files run.

A rule over a metric nobody exports never fires, and nothing says so: ``LLMDiagIncident`` read
``llmdiag_incident``, which only ``diag collect --diagnose-every`` exports, while the unit ran the agent
without it. Here each name a committed rule reads (its expression, and the series its annotations
``query``) is traced through the catalog (``collectors/catalog.py`` names the module that emits it) to
the process that exports it -- the agent as the shipped unit, image and DaemonSet run it (their flags), or
the backend (ours: the tracker; vLLM, TGI) -- and then through the shipped scrape config's ``keep`` filter
of the job that scrapes that process. The agent's command line is also run as shipped, until the live
diagnosis' series are on its /metrics.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from alerts.generate import DEFAULT_OUT, render
from alerts.spec import load_spec
from collectors import backends
from collectors import catalog as cat
from dashboards.promql import metric_names
from diag.rules.classes import INCIDENT_CLASSES
from tests import procs
from tests.deploy.shipped import (
    CONTAINERFILE,
    DAEMONSET,
    DIAG_BIN,
    SCRAPE,
    UNIT,
    containerfile_argv,
    set_flag,
    unit_settings,
)
from tests.paths import REPO

# The collector modules whose families the agent process exports, and the flag that turns each off or on.
AGENT_MODULES = {"collectors.host", "collectors.cgroup", "collectors.processes", "collectors.gpu", "collectors.kmsg",
                 "collectors.agent", "collectors.recorder", "diag.live.diagnosis"}  # fmt: skip
OFF_SWITCH = {"collectors.gpu": "--no-gpu", "collectors.kmsg": "--no-kmsg"}
ON_SWITCH = {"diag.live.diagnosis": "--diagnose-every"}
BACKEND_MODULES = {"collectors.tracking"}  # ours, inside the served process
BACKEND_EXPORTERS = {"vLLM", "TGI", "llama.cpp"}
# collectors.backends names its dialects; the exporters as this test (and catalog.EXTERNAL) name them
_DIALECT_EXPORTER = {"vllm": "vLLM", "tgi": "TGI", "llamacpp": "llama.cpp"}
AGENT_JOBS = ("llm-diag-host", "llm-diag-daemonset")
BACKEND_JOB = "llm-backend"
_QUERY_RE = re.compile(r'printf "([A-Za-z_:][A-Za-z0-9_:]*)\{')


def rule_reads(files: list[Path]) -> set[str]:
    """Names the rules read (expressions and annotation queries), minus the names the same rules record."""
    read: set[str] = set()
    recorded: set[str] = set()
    for path in files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                read |= metric_names(rule["expr"])
                for text in rule.get("annotations", {}).values():
                    read |= set(_QUERY_RE.findall(text))
                if "record" in rule:
                    recorded.add(rule["record"])
    return read - recorded


def family(series: str) -> tuple[str, str]:
    """(family name, who emits it): a catalog module, an upstream exporter, or Prometheus (``up``)."""
    for name in (series, re.sub(r"_(bucket|sum|count)$", "", series)):
        if name in cat.CATALOG:
            return name, cat.CATALOG[name].source
        for fam in cat.EXTERNAL:
            if fam.name == name:
                return name, fam.exporter
        declared = backends.FAMILIES.get(name) or backends.FAMILIES.get(re.sub(r"_total$", "", name))
        if declared is not None and declared.dialect in _DIALECT_EXPORTER:
            return name, _DIALECT_EXPORTER[declared.dialect]
    raise AssertionError(f"{series}: read by a committed rule but declared in neither catalog.py nor backends.py")


def agent_exports(argv: list[str], module: str) -> bool:
    """Whether an agent started with ``argv`` exports the families of ``module``."""
    flags = {a.split("=", 1)[0] for a in argv}
    if "--listen" in flags and _flag(argv, "--listen") == "off":
        return False
    if module in OFF_SWITCH:
        return OFF_SWITCH[module] not in flags
    if module in ON_SWITCH:
        return ON_SWITCH[module] in flags
    return True


def _flag(argv: list[str], flag: str) -> str:
    for i, a in enumerate(argv):
        if a == flag:
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise KeyError(flag)


def _unit_argv() -> list[str]:
    return shlex.split(unit_settings(UNIT.read_text())["[Service]ExecStart"][0])


def _daemonset_argv() -> list[str]:
    docs = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    return ["diag", "collect", *ds["spec"]["template"]["spec"]["containers"][0]["args"]]


AGENT_COMMAND_LINES = {"systemd unit": _unit_argv, "DaemonSet": _daemonset_argv, "Containerfile": containerfile_argv}


def _keeps(job_name: str) -> re.Pattern[str]:
    """The job's ``keep`` filter on __name__ (everything when it has none)."""
    job = next(j for j in yaml.safe_load(SCRAPE.read_text())["scrape_configs"] if j["job_name"] == job_name)
    for step in job.get("metric_relabel_configs", []):
        if step.get("action") == "keep" and step.get("source_labels") == ["__name__"]:
            return re.compile(step["regex"])
    return re.compile(".*")


def _rule_files(tmp: Path) -> dict[str, list[Path]]:
    """The committed rules, and the rules the shipped vLLM spec generates (its SLIs are vLLM's families)."""
    out = {"committed": sorted(DEFAULT_OUT.glob("*.rules.yaml"))}
    generated = render(load_spec(REPO / "alerts" / "slo-vllm.yaml"), INCIDENT_CLASSES, "slo-vllm.yaml")
    vllm = []
    for rel, text in generated.files.items():
        if rel.endswith(".rules.yaml") and rel.startswith("slo-"):
            (tmp / rel).write_text(text)
            vllm.append(tmp / rel)
    out["vLLM spec"] = vllm
    return out


@pytest.mark.parametrize("command_line", sorted(AGENT_COMMAND_LINES))
def test_every_name_the_rules_read_is_exported_and_kept(command_line: str, tmp_path: Path) -> None:
    argv = AGENT_COMMAND_LINES[command_line]()
    missing = []
    for source, files in _rule_files(tmp_path).items():
        assert files, source
        for series in sorted(rule_reads(files)):
            _, emitter = family(series)
            if emitter == "Prometheus":  # up: written by Prometheus for every target, never filtered
                continue
            if emitter in AGENT_MODULES:
                if not agent_exports(argv, emitter):
                    missing.append(f"{source}: {series} ({emitter}) is not exported by the agent as the {command_line} runs it")
                jobs = AGENT_JOBS
            elif emitter in BACKEND_MODULES or emitter in BACKEND_EXPORTERS:
                jobs = (BACKEND_JOB,)
            else:
                missing.append(f"{source}: {series} comes from {emitter}, which no shipped file runs or scrapes")
                continue
            for job in jobs:
                if not _keeps(job).fullmatch(series):
                    missing.append(f"{source}: {series} is dropped by the {job} job's keep filter in {SCRAPE.name}")
    assert missing == []


def test_the_check_catches_an_agent_without_the_live_diagnosis(tmp_path: Path) -> None:
    """The unit's flags as they were: the rules' llmdiag_incident then has no exporter."""
    argv = [a for a in _unit_argv() if a not in ("--diagnose-every", "15s")]
    reads = rule_reads(sorted(DEFAULT_OUT.glob("*.rules.yaml")))
    assert "llmdiag_incident" in reads and "llmdiag_incident_info" in reads  # expression and annotation query
    assert not agent_exports(argv, family("llmdiag_incident")[1])
    assert agent_exports(_unit_argv(), family("llmdiag_incident")[1])
    assert not agent_exports([*argv, "--no-gpu"], family("llmdiag_gpu_memory_used_bytes")[1])


@pytest.mark.slow
@pytest.mark.process
def test_the_units_command_line_exports_the_live_diagnosis(tmp_path: Path) -> None:
    """ExecStart as shipped (binary and recorder mapped to this checkout and a temp dir, a free port): after one
    diagnosis interval the incident series the LLMDiagIncident alert reads are on /metrics, one per class."""
    argv = [str(DIAG_BIN), *_unit_argv()[1:]]
    argv = set_flag(set_flag(argv, "--listen", "127.0.0.1:0"), "--recorder", str(tmp_path / "recorder.db"))
    every = float(_flag(argv, "--diagnose-every").removesuffix("s"))
    log = tmp_path / "agent.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([*argv, "--no-gpu"], stdout=subprocess.DEVNULL, stderr=fh)
    try:
        port = procs.agent_port(log, proc, 30)
        deadline = time.monotonic() + every + 45
        text = ""
        while time.monotonic() < deadline and 'llmdiag_incident{class="' not in text:
            time.sleep(1.0)
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, trust_env=False).text
        classes = set(re.findall(r'^llmdiag_incident\{class="([a-z_]+)"\} ', text, re.M))
        assert classes == set(INCIDENT_CLASSES), log.read_text(errors="replace")[-2000:]
    finally:
        procs.stop(proc)


def test_the_command_lines_share_the_flags_that_matter() -> None:
    """The image and the DaemonSet run the agent as the unit does: same diagnosis interval, same history."""
    unit = _unit_argv()
    for name in ("DaemonSet", "Containerfile"):
        other = AGENT_COMMAND_LINES[name]()
        for flag in ("--diagnose-every", "--interval", "--retention", "--max-size"):
            assert _flag(other, flag) == _flag(unit, flag), (name, flag)
    assert "--diagnose-every" in CONTAINERFILE.read_text()
