"""The application gate: in process against a tiny ASGI server through httpx's ASGI transport (no socket, no
process), and once for real against the reference backend (``diag demo serve``) with ``--unit`` read from a fake
``systemctl`` and a graceful termination at the end.

The in-process server answers the completions endpoint like an OpenAI-compatible server, refuses prompts over its
context with 413 (as the reference backend does), and counts the most requests it ever had in flight at once (so
the concurrency check is seen to send its requests simultaneously, not one after another).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from diag.cli.gate_html import render_html
from diag.gate.app_gate import before_load, graceful_termination, readiness
from diag.gate.report import render
from diag.gate.runner import RunOptions, run_gate
from diag.gate.spec import AppSpec, Probe, Readiness, SpecError, parse_spec
from tests.paths import REPO

STEP = {"prompt_tokens": 4, "output_tokens": 4}


class Server:
    """An ASGI completions server: ``ready_after`` 503s on /health, 413 over ``context`` words, ``delay_s`` per request."""

    def __init__(self, *, ready_after: int = 0, context: int = 10_000, delay_s: float = 0.0) -> None:
        self.ready_after, self.context, self.delay_s = ready_after, context, delay_s
        self.health_calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.prompts: list[int] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] == "/health":
            self.health_calls += 1
            await self._answer(send, 200 if self.health_calls > self.ready_after else 503, {"ok": True})
            return
        if scope["path"] != "/v1/completions":
            await self._answer(send, 404, {"error": "not found"})
            return
        req = json.loads(body)
        words = len(req["prompt"].split())
        self.prompts.append(words)
        if words > self.context:
            await self._answer(send, 413, {"error": f"prompt is {words} tokens"})
            return
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        n = req["max_tokens"]
        await self._answer(send, 200, {"choices": [{"text": "x" * n}], "usage": {"completion_tokens": n}})

    async def _answer(self, send: Any, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})


def _run(app: Server, spec_doc: dict) -> tuple[Any, list[str]]:
    spec = parse_spec({"steps": [{"rate": 2, "duration": 1, **STEP}], **spec_doc})
    lines: list[str] = []

    async def go() -> Any:
        async with httpx.AsyncClient(base_url="http://gate.test", transport=httpx.ASGITransport(app)) as client:
            assert spec.application is not None
            return await before_load(client, spec, spec.application, lines.append)

    return asyncio.run(go()), lines


def test_every_check_passes_on_a_good_server() -> None:
    app = Server(ready_after=2, delay_s=0.2)
    doc = {"application": {"readiness": "/health", "short_request": True, "long_prefill": {"prompt_tokens": 500},
                           "concurrency": {"requests": 3, "within": 10}}}  # fmt: skip
    gate, lines = _run(app, doc)
    assert gate.passed and not gate.stopped, gate.checks
    assert [c.name for c in gate.checks] == ["readiness", "short_request", "long_prefill", "concurrency"]
    assert app.health_calls == 3 and gate.checks[0].value.startswith("/health 200 after ")
    assert app.prompts[:2] == [8, 500]  # the short request's default, then the long prefill's length
    # each request takes 0.2 s: sent one after another, no two would ever be in flight together
    assert app.max_in_flight == 3 and gate.checks[3].value.startswith("3/3 ok")
    assert "application: concurrency PASS" in lines[-1]


def test_a_prefill_over_the_context_and_a_missed_bound_fail() -> None:
    app = Server(context=100, delay_s=0.3)
    doc = {"application": {"long_prefill": {"prompt_tokens": 101, "within": 5},
                           "concurrency": {"requests": 2, "within": 0.1}}}  # fmt: skip
    gate, _ = _run(app, doc)
    prefill, conc = gate.checks
    assert prefill.state == "FAIL" and prefill.value.startswith("0/1 ok") and "HTTP 413" in prefill.detail
    assert conc.state == "FAIL" and "timeout" in conc.detail and not gate.passed and not gate.stopped


def test_readiness_that_never_comes_stops_the_run_before_the_load(tmp_path: Path) -> None:
    app = Server(ready_after=10_000)
    spec = parse_spec({"steps": [{"name": "s1", "rate": 2, "duration": 1, **STEP}],
                       "application": {"readiness": {"path": "/health", "within": 0.6}, "short_request": True}})  # fmt: skip
    opts = RunOptions("http://gate.test", tmp_path / "rec.db", transport=httpx.ASGITransport(app))
    report = run_gate(spec, opts)
    doc = report.to_dict()
    assert report.exit_code == 1 and report.steps == [] and doc["not_run"] == ["s1"]
    ready = doc["gates"]["application"]["checks"]
    assert [c["check"] for c in ready] == ["readiness"] and ready[0]["state"] == "FAIL" and "HTTP 503" in ready[0]["value"]
    assert doc["gates"]["application"]["stopped"].startswith("the target was not ready")
    assert app.prompts == [] and 2 <= app.health_calls <= 4  # polled every 0.25 s for 0.6 s, and no request sent
    assert {"infrastructure", "application"} == set(doc["gates"])
    text = render(report)
    assert "application gate: FAIL" in text and "GATE FAILED: application (readiness), 1 steps not run" in text
    page = render_html(report, None, argv=["diag", "gate"])
    assert '<tr id="check-application-readiness"><td>readiness</td><td class="bad">FAIL</td>' in page
    assert 'id="gate-infrastructure"' in page and "<strong>Stopped here:</strong> the target was not ready" in page
    assert "GATE FAILED: application (readiness), 1 steps not run</section>" in page


def test_both_gates_and_the_steps_pass_to_exit_0(tmp_path: Path) -> None:
    app = Server()
    spec = parse_spec({"steps": [{"name": "s1", "rate": 4, "duration": 1, **STEP, "criteria": {"error_ratio": 0}}],
                       "application": {"readiness": "/health", "short_request": True}})  # fmt: skip
    report = run_gate(spec, RunOptions("http://gate.test", tmp_path / "rec.db", transport=httpx.ASGITransport(app)))
    assert report.gates["infrastructure"].passed and report.gates["application"].passed
    assert report.exit_code == 0, render(report)
    assert "GATE PASSED: 1 steps, every criterion met; infrastructure and application gates passed" in render(report)


def _fake_proc(tmp: Path, pid: int, start: int) -> str:
    d = tmp / "proc" / str(pid)
    d.mkdir(parents=True)
    fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 10
    (d / "stat").write_text(f"{pid} (server) {' '.join(fields)}\n")
    return str(tmp / "proc")


def test_termination_signals_nothing_it_cannot_vouch_for(tmp_path: Path) -> None:
    """A PID whose start time changed (recycled) is never signalled; nor is one with nothing in flight to drain.
    The PID is one no process has (beyond pid_max): a signal sent by mistake would raise, never land."""
    pid = 2**22 + 12345
    proc = _fake_proc(tmp_path, pid, start=777)
    spec = parse_spec({"steps": [{"rate": 1, "duration": 1, **STEP}]})
    probe = Probe(prompt_tokens=4, output_tokens=4, within_s=5, requests=2)

    async def go(started: int) -> Any:
        async with httpx.AsyncClient(base_url="http://gate.test", transport=httpx.ASGITransport(Server())) as client:
            return await graceful_termination(client, spec, probe, pid, started, lambda _l: None, proc_root=proc)

    recycled = asyncio.run(go(started=555))
    assert recycled.state == "FAIL" and "nothing was signalled" in recycled.detail
    too_fast = asyncio.run(go(started=777))  # the server answers at once: nothing is in flight at the signal
    assert too_fast.state == "FAIL" and "finished before the signal" in too_fast.value


def test_readiness_check_alone_and_spec_errors() -> None:
    async def go() -> Any:
        async with httpx.AsyncClient(base_url="http://gate.test", transport=httpx.ASGITransport(Server())) as client:
            return await readiness(client, Readiness("/nope", 0.3))

    check = asyncio.run(go())
    assert check.state == "FAIL" and check.value == "/nope: HTTP 404" and "no 2xx within 0.3 s" in check.detail
    assert AppSpec().names() == []
    for doc, says in [
        ({"long_prefill": True}, "application.long_prefill: give a mapping with prompt_tokens"),
        ({"concurrency": {"within": 3}}, "application.concurrency.requests: missing"),
        ({"readiness": {"path": "http://elsewhere/"}}, "application.readiness.path: got 'http://elsewhere/'"),
        ({"graceful_termination": {"requests": 0}}, "application.graceful_termination.requests: got 0"),
        ({"warmup": True}, "application.warmup: unknown key"),
    ]:
        with pytest.raises(SpecError) as err:
            parse_spec({"steps": [{"rate": 1, "duration": 1, **STEP}], "application": doc})
        assert says in str(err.value)


SHOW_TEMPLATE = """LoadState=loaded
ActiveState=active
ControlGroup={cgroup}
MainPID={pid}
MemoryAccounting=yes
MemoryHigh=infinity
MemoryMax={max}
MemoryLow=0
MemoryMin=0
"""


def _fake_systemctl(folder: Path, show: str) -> Path:
    """A ``systemctl`` that prints ``show`` for ``systemctl show`` and says systemd-oomd is inactive: the interface
    of the real one, which cannot run on this host (systemd is not PID 1 here)."""
    (folder / "show.txt").write_text(show)
    exe = folder / "systemctl"
    exe.write_text(f'#!/bin/sh\ncase "$1" in\n  show) cat "{folder / "show.txt"}" ;;\n'
                   '  is-active) echo inactive; exit 3 ;;\n  *) exit 1 ;;\nesac\n')  # fmt: skip
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return folder


@pytest.mark.process
@pytest.mark.slow
def test_unit_and_graceful_termination_on_the_reference_backend(tmp_path: Path) -> None:
    """``--unit`` (a fake systemctl naming the demo as the unit's MainPID and its cgroup), both gates passing, and
    the graceful termination last: the demo, sent SIGTERM with two requests in flight, completes them and exits."""
    from diag.demo.harness import start_demo
    from diag.demo.scenarios.cgroups import ScenarioCgroups, unavailable_reason

    groups = None if unavailable_reason() else ScenarioCgroups(prefix="llmdiag-gateapp")
    try:
        group = groups.create("service", 1 << 30) if groups is not None else None
        srv = start_demo(["--max-concurrency", "1", "--min-step-ms", "20"], weights_mb=8, weights_dir=tmp_path / "w",
                         log_dir=tmp_path, cgroup=group)  # fmt: skip
        try:
            member = Path(f"/proc/{srv.pid}/cgroup").read_text()
            cgroup = group.path if group is not None else next(
                (ln.split(":", 2)[2] for ln in member.splitlines() if ln.split(":")[1] in ("", "memory")), "/")  # fmt: skip
            show = SHOW_TEMPLATE.format(cgroup=cgroup, pid=srv.pid, max=(1 << 30) if group is not None else "infinity")
            bin_dir = _fake_systemctl(tmp_path, show)
            spec = tmp_path / "gate.yaml"
            spec.write_text(yaml.safe_dump({
                "request_timeout": "30s",
                "infrastructure": {"require_memory_max": group is not None, "require_psi": True},
                "application": {"readiness": "/healthz", "short_request": {"output_tokens": 4, "within": 10},
                                "graceful_termination": {"requests": 2, "output_tokens": 48, "within": 30}},
                "steps": [{"name": "light", "rate": 2, "duration": 2, **STEP, "criteria": {"error_ratio": 0}}],
            }))  # fmt: skip
            env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
            argv = [sys.executable, "-m", "diag.cli", "gate", "--spec", str(spec), "--target", srv.url, "--unit", "llm.service",
                    "--json", str(tmp_path / "gate.json"), "--no-bundle"]  # fmt: skip
            run = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
            print(run.stdout, run.stderr)
            exit_status = srv.proc.wait(10)  # it exited on the gate's SIGTERM: reaped here
        finally:
            if srv.proc.poll() is None:
                os.kill(srv.pid, signal.SIGKILL)
            srv.stop()
    finally:
        if groups is not None:
            groups.close()
            assert not groups.leftovers
    assert "Traceback" not in run.stderr and run.returncode == 0, run.stdout
    doc = json.loads((tmp_path / "gate.json").read_text())
    infra = {c["check"]: c for c in doc["gates"]["infrastructure"]["checks"]}
    assert f"MainPID={srv.pid}" in infra["unit"]["value"] and f"ControlGroup={cgroup}" in infra["unit"]["value"]
    assert infra["systemd_oomd"]["state"] == "NOT AVAILABLE" and infra["systemd_oomd"]["value"] == "inactive"
    if group is not None:
        assert infra["memory_max"]["value"] == "1.0 GiB" and infra["memory_max"]["state"] == "PASS"
        if group.v2_dir is not None:  # its cgroup2 twin: the group's own memory PSI
            assert infra["psi"]["state"] == "PASS" and infra["psi"]["value"].startswith("per-group: "), infra["psi"]
    app = doc["gates"]["application"]["checks"]
    assert [c["check"] for c in app] == ["readiness", "short_request", "graceful_termination"]
    assert all(c["state"] == "PASS" for c in app), app
    assert app[-1]["value"].startswith("2/2 in-flight requests completed; exited ")
    assert doc["passed"] and exit_status == 0 and "SIGTERM to pid" in run.stderr


def test_a_stop_during_the_application_gate_cancels_it() -> None:
    """Ctrl-C sets the run's stop event: a readiness poll with a minute left is cancelled, not waited out."""
    from diag.gate.runner import _unless_stopped

    async def go() -> tuple[Any, float]:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url="http://gate.test", transport=httpx.ASGITransport(Server(ready_after=10**6))) as c:
            loop.call_later(0.3, stop.set)
            t0 = loop.time()
            out = await _unless_stopped(readiness(c, Readiness("/health", 60)), stop)
            return out, loop.time() - t0

    out, took = asyncio.run(go())
    assert out is None and took < 5
