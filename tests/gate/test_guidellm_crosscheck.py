"""``diag gate``'s load generator against guidellm, a load tool no one here wrote, on the same server at the same rate:
they must agree on what they measured -- the throughput and the median time to the first token -- within 5 %.

Why a cross-check: every other gate test checks the generator against the stub's own clock or against itself; a
generator that mis-framed a stream, read the first token late, or sent less than the rate it reported would still
pass them. Two tools built independently agreeing on the same server's figures is the check that does not share
our assumptions.

guidellm lives in a venv of its own, ``.venv/guidellm`` (``make install-guidellm``, part of ``make test``): it needs
torch for its data loader, which nothing else here does, and the package index's torch is the CUDA build with ~3 GB
of NVIDIA wheels, so that venv pins the CPU build (the Makefile says how). This test finds guidellm there, or wherever
``GUIDELLM`` names its executable. ``make test`` sets ``GUIDELLM``, so there a missing guidellm fails the test; an
ordinary ``pytest`` without that venv skips it, saying so.

The rate is 50 requests/s, streamed, for 30 s a tool. guidellm's side is fixed, not Poisson (its ``constant``
profile); ours is the spec's seeded Poisson draw, so its count is fixed too -- 1 490 arrivals in 30 s, 0.7 % below the
rate -- and the test checks it stays within 2 % of the rate, so the 5 % compares the tools and not the draw. 30 s
(60 s before) still gives each tool ~1 500 first tokens for its median. Not a ``live`` test: it needs no cgroup and
no root (as root it raises its priority, below), makes no fault and reads nothing of the host, so it runs beside the
serial live group instead of adding its length to it. At 100 requests/s on this
2-core host shared with other jobs guidellm fell behind (83 requests/s, its median first token 1.1 s: its own workers
late, the stub's first token comes at 0.2 s), which is guidellm's limit here rather than a disagreement on the server.
The stub sends the first token after 0.2 s, so 5 % of the TTFT is 10 ms: far above the milliseconds either tool's
own overhead adds, far below a first token read at the end of the stream (7 x 20 ms later).

The stub and each tool in turn run at nice -10 (as root, as the suite runs; otherwise as they are): the test compares
the tools, and on this host shared with other jobs (load averages of 20-40 on 2 cores) a tool starved of the CPU
mid-run reads the stub's first token late -- guidellm once measured a TTFT p50 of 397 ms at load average ~35 while
`diag gate`, right after it, measured 206 ms. Both get the same priority, so neither is favoured. With the kernel's
autogroups (on here) a nice value weighs only within its session: it shields the tools from the rest of `make test`
(the same session), not from another session's jobs, which share the CPU per session."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
from pathlib import Path

import pytest

from diag.gate.load import StepLoad, make_client, prompt_text, run_step
from diag.gate.spec import parse_spec
from tests.gate.stubproc import stub_server
from tests.paths import REPO

pytestmark = [pytest.mark.process, pytest.mark.slow]

RATE, SECONDS, PROMPT, OUTPUT = 50, 30, 16, 8
TTFT_S, ITL_S = 0.2, 0.02
NICE = -10
VENV_GUIDELLM = REPO / ".venv" / "guidellm" / "bin" / "guidellm"


def _guidellm() -> str:
    """``GUIDELLM`` if set (it must then exist: asked for by name, never skipped), else the project's own venv."""
    named = os.environ.get("GUIDELLM")
    if named:
        if not os.access(named, os.X_OK):
            pytest.fail(f"GUIDELLM={named} is not an executable (make install-guidellm installs it there)")
        return named
    if not os.access(VENV_GUIDELLM, os.X_OK):
        pytest.skip(f"guidellm is not installed: {VENV_GUIDELLM.relative_to(REPO)} is missing (make install-guidellm, "
                    "or set GUIDELLM to its executable)")  # fmt: skip
    return str(VENV_GUIDELLM)


def _theirs(exe: str, url: str, work: Path) -> tuple[float, float, int]:
    """guidellm's throughput (requests/s), TTFT p50 (s) and failures at a constant RATE, streamed."""
    rng = random.Random(1)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": prompt_text(PROMPT, rng), "output_tokens_count": OUTPUT}) + "\n"
                               for _ in range(int(RATE * SECONDS * 1.5))))  # fmt: skip
    out = work / "guidellm.json"
    cmd = [exe, "run", f"--backend=kind=openai_http,target={url},validate_backend=false,model=stub,stream=true",
           f"--profile=kind=constant,rate={RATE}", f"--constraint=kind=max_duration,seconds={SECONDS}",
           f"--data=kind=json_file,path={prompts}", f"--output=kind=json,path={out}", "--disable-console"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "*"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False,
                          preexec_fn=_raise_priority)  # fmt: skip  # its worker processes inherit it
    assert proc.returncode == 0 and out.exists(), (proc.stderr or proc.stdout)[-2000:]
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    rps = metrics["requests_per_second"]
    failed = sum(int(rps[kind]["count"] or 0) for kind in ("errored", "incomplete"))
    ttft_ms = metrics["time_to_first_token_ms"]["successful"]["median"]
    return rps["successful"]["mean"], ttft_ms / 1e3, failed


def _ours(url: str) -> tuple[float, float, int]:
    spec = parse_spec({"steps": [{"name": "x", "rate": RATE, "duration": SECONDS, "prompt_tokens": PROMPT,
                                  "output_tokens": OUTPUT, "stream": True}]})  # fmt: skip

    async def go() -> StepLoad:
        async with make_client(url, spec) as client:
            return await run_step(client, spec, spec.steps[0], 0, asyncio.Event())

    load = asyncio.run(go())
    ok = [r for r in load.results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    sent = len(load.results) + load.dropped
    assert abs(sent - RATE * SECONDS) <= 0.02 * RATE * SECONDS, sent  # the seeded draw, not the tools, would differ
    return len(ok) / (load.load_end - load.t0), statistics.median(ttft), sent - len(ok)


def _raise_priority(pid: int = 0) -> None:
    """``pid`` (0: the caller) at nice ``NICE`` where the test may (root): see the module's docstring."""
    if os.geteuid() == 0:
        os.setpriority(os.PRIO_PROCESS, pid, NICE)


def test_guidellm_and_diag_gate_agree_on_throughput_and_ttft(tmp_path: Path) -> None:
    exe = _guidellm()
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with stub_server("--ttft", str(TTFT_S), "--itl", str(ITL_S)) as stub:
        _raise_priority(stub.proc.pid)
        their_rps, their_ttft, their_failed = _theirs(exe, stub.url, tmp_path)
        _raise_priority()
        try:
            our_rps, our_ttft, our_failed = _ours(stub.url)
        finally:
            if os.geteuid() == 0:
                os.setpriority(os.PRIO_PROCESS, 0, own)
    figures = {"ours": (our_rps, our_ttft, our_failed), "guidellm": (their_rps, their_ttft, their_failed)}
    print(f"requests/s, TTFT p50 (s), failed: {figures}")  # shown by pytest -rA: the figures a pass rests on
    assert our_failed == 0 and their_failed == 0, figures
    assert abs(our_rps - their_rps) <= 0.05 * their_rps, figures
    assert abs(our_ttft - their_ttft) <= 0.05 * their_ttft, figures
    assert our_ttft >= TTFT_S and their_ttft >= TTFT_S * 0.95, figures  # the stub's first token, not before it
