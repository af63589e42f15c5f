"""How fast can ``diag gate``'s load generator send open-loop arrivals on time -- and guidellm, beside it?

The generator alone (``diag.gate.load``, the code ``diag gate`` runs; no host agent) sends Poisson arrivals at
each rate for a few seconds to the stub server of the tests (``tests/gate/stub.py``: its own process, raw
asyncio HTTP/1.1 keep-alive, answering at once), and prints per rate: the rate achieved, the send lag (a
request's start behind its scheduled time) p50 / p99 / max, the errors, and the generator's own CPU per request.
The figure of merit is the highest rate whose send-lag p99 stays <= 1 ms: above it the generator's own
lateness, not the server, would start to shape the latencies it reports (they count from the schedule, so
the lag is charged, not hidden -- but the load is then not quite the one asked for).

The host's floor is how late a process that only sleeps wakes up (Poisson sleeps at 1 000/s). No generator on this
host can send more punctually than that, so a lag figure is read against it: on a shared machine the scheduler, not
the generator, often sets the p99. It is measured once before the rates, and again *beside* each row, in a process
of its own for the row's duration, so each row's lag p99 is printed with the same moment's floor p99 and their ratio.

``--variants`` compares ways of running the generator side by side, each rate in turn (so every variant meets the same
minutes of the host): ``timerfd`` (what ``diag gate`` runs: diag.gate.alarm wakes the loop at each arrival),
``spin`` (asyncio's timer a millisecond early, then yielding to the loop until the time), and ``uvloop`` /
``uvloop-spin`` the same on uvloop's event loop (installed separately: not a dependency of the project). A
``+agent`` suffix runs a thread beside the generator that samples every process's /proc files every 0.2 s, as
``diag gate``'s host agent does from a thread of the same process; ``+agent5ms`` the same with Python's default GIL
switch interval (5 ms) instead of the 0.5 ms diag.gate.load sets while a step runs. ``+nice`` runs the generator,
the stub and that row's floor at nice -10 (root only): what scheduling priority, rather than code, buys on a busy host.

With ``--guidellm PATH`` (its executable) the same rates are also run by guidellm against the same stub, and the
rate it reached (its requests over the span of their starts) and its CPU per request (its process and workers,
less a one-request run's, i.e. without its start-up) are printed beside ours.

    .venv/bin/python bench/gate.py                                  # rates 100 .. 3000, 5 s each, timerfd and spin
    .venv/bin/python bench/gate.py --rates 2000 --variants timerfd,spin,uvloop
    .venv/bin/python bench/gate.py --rates 500,2000 --seconds 10 --guidellm /path/to/bin/guidellm
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diag.gate import load as gate_load
from diag.gate.criteria import quantile
from diag.gate.http_client import HttpClient
from diag.gate.load import StepLoad, make_client, run_step
from diag.gate.spec import parse_spec
from tests.gate.stubproc import stub_server

LAG_TARGET_S = 0.001
PROMPT_TOKENS, OUTPUT_TOKENS = 16, 8


def _cpu_s(who: int = resource.RUSAGE_SELF) -> float:
    ru = resource.getrusage(who)
    return ru.ru_utime + ru.ru_stime


def host_floor(seconds: float = 2.0, rate: float = 1000.0) -> tuple[float, float]:
    """How late a bare ``time.sleep`` wakes (p50, p99 seconds): the host's own scheduling noise."""
    rng = random.Random(0)
    late: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        d = rng.expovariate(rate)
        at = time.perf_counter() + d
        time.sleep(d)
        late.append(time.perf_counter() - at)
    return quantile(late, 0.5), quantile(late, 0.99)


async def _sequential_cpu(url: str, n: int) -> tuple[float, float]:
    """CPU per request of ``n`` POSTs one after another on one keep-alive connection: httpx's and this client's.
    The clients' own cost, apart from any scheduling: what bounds the rate one event loop can send."""
    import httpx

    body = json.dumps({"prompt": "the model token serve", "max_tokens": OUTPUT_TOKENS}).encode()
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
        await client.post("/v1/completions", content=body, headers=headers)
        cpu0 = _cpu_s()
        for _ in range(n):
            (await client.post("/v1/completions", content=body, headers=headers)).json()
        theirs = (_cpu_s() - cpu0) / n
    async with HttpClient(url, max_connections=1) as ours:
        await ours.post("/v1/completions", body)
        cpu0 = _cpu_s()
        for _ in range(n):
            json.loads((await ours.post("/v1/completions", body)).body)
        return theirs, (_cpu_s() - cpu0) / n


async def _step(url: str, rate: float, seconds: float, precise: bool) -> tuple[StepLoad, float]:
    spec = parse_spec({
        "request_timeout": "10s", "max_in_flight": 4096,
        "steps": [{"name": "b", "rate": rate, "duration": seconds,
                   "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}],
    })  # fmt: skip
    warm = parse_spec({"steps": [{"rate": 200, "duration": 0.5, "prompt_tokens": 4, "output_tokens": 4}]})
    async with make_client(url, spec, connections=512) as client:
        await run_step(client, warm, warm.steps[0], 0, asyncio.Event())  # connections open, code paths warm
        cpu0 = _cpu_s()
        load = await run_step(client, spec, spec.steps[0], 0, asyncio.Event(), precise=precise)
        return load, _cpu_s() - cpu0


@dataclass
class Figures:
    achieved: float
    sent: int
    errors: int
    lag_p50: float
    lag_p99: float
    lag_max: float
    cpu_per_req: float
    floor_p99: float = float("nan")
    load_avg: float = float("nan")


# The generator's variants: how an arrival's time is waited for (diag.gate.alarm) and which event loop runs it.
VARIANTS = {"timerfd": (True, False), "spin": (False, False), "uvloop": (True, True), "uvloop-spin": (False, True)}
# A variant may add "+agent": a thread doing an agent's sampling beside it, or "+agent5ms": that, with Python's
# default 5 ms GIL switch interval instead of the one diag.gate.load sets for a step.
# "+nice": the generator, the stub and the floor's process all at nice NICE (root): what priority, not code, buys.
EXTRAS = ("", "agent", "agent5ms", "nice")
NICE = -10


def _busy_sampler(stop: threading.Event) -> None:
    """A stand-in for `diag gate`'s host agent, which samples in a thread of the generator's process: every 0.2 s,
    read and split every process's stat and status (pure Python, holding the GIL between the reads)."""
    while not stop.wait(0.2):
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                with contextlib.suppress(OSError):
                    Path(f"/proc/{pid}/stat").read_text().split()
                    dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)


@contextlib.contextmanager
def agent_thread(on: bool) -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(target=_busy_sampler, args=(stop,), daemon=True)
    if on:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if on:
            thread.join()


def _run_loop(coro: object, use_uvloop: bool) -> object:
    if not use_uvloop:
        return asyncio.run(coro)  # type: ignore[arg-type]
    import uvloop  # only for this comparison: not a dependency of the project

    return uvloop.run(coro)  # type: ignore[arg-type]


@contextlib.contextmanager
def floor_beside(seconds: float, nice: int = 0) -> Iterator[list[float]]:
    """The host floor measured in a process of its own *while* the block runs: the same moment's scheduling noise,
    not a figure from before it. Yields a list that holds [p50, p99] once the block has ended."""
    proc = subprocess.Popen([sys.executable, __file__, "--floor-only", str(seconds)], stdout=subprocess.PIPE, text=True)
    if nice:
        os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
    out: list[float] = []
    try:
        yield out
    finally:
        try:
            text, _ = proc.communicate(timeout=seconds + 30)
            out.extend(json.loads(text))
        except (subprocess.TimeoutExpired, ValueError):
            proc.kill()
            proc.wait()
            out.extend([float("nan"), float("nan")])


@contextlib.contextmanager
def reniced(pids: tuple[int, ...], nice: int) -> Iterator[None]:
    """``pids`` (0: this process) at scheduling priority ``nice`` for the block (root may go below 0), then back."""
    before = [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids]
    for pid in pids:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    try:
        yield
    finally:
        for pid, value in zip(pids, before, strict=True):
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, pid, value)


def ours(url: str, rate: float, seconds: float, variant: str = "timerfd", stub_pid: int = 0) -> Figures:
    base, _, extra = variant.partition("+")
    precise, use_uvloop = VARIANTS[base]
    switch = gate_load.SWITCH_INTERVAL_S
    if extra == "agent5ms":  # the agent's thread beside it, and Python's default GIL switch interval
        gate_load.SWITCH_INTERVAL_S = 0.005
    nice = NICE if extra == "nice" else 0
    try:
        with (
            reniced((0, stub_pid) if nice else (), nice),
            floor_beside(seconds + 1.0, nice) as floor,
            agent_thread(extra in ("agent", "agent5ms")),
        ):
            load, cpu = _run_loop(_step(url, rate, seconds, precise), use_uvloop)  # type: ignore[misc]
    finally:
        gate_load.SWITCH_INTERVAL_S = switch
    load_avg = os.getloadavg()[0]
    lags = [r.lag_s for r in load.results]
    n = len(load.results)
    errors = sum(1 for r in load.results if not r.ok) + load.dropped
    p50, p99 = quantile(lags, 0.5), quantile(lags, 0.99)
    kinds = collections.Counter(r.error or f"HTTP {r.status}" for r in load.results if not r.ok)
    if load.dropped:
        kinds["dropped at max_in_flight"] = load.dropped
    if kinds:
        print(f"{'':>16} {rate:>6.0f} {variant} errors: " + ", ".join(f"{k} x{v}" for k, v in kinds.most_common()), flush=True)
    return Figures(n / (load.load_end - load.t0), n, errors, p50, p99, max(lags), cpu / max(1, n), floor[1], load_avg)


def _guidellm_run(exe: str, url: str, rate: float, seconds: float, work: Path) -> tuple[dict, float]:
    """One guidellm run (non-streamed, as ours; no health check: the stub has no /health); its report and its CPU
    (the child's and its workers' user + system)."""
    prompts = work / f"prompts-{rate:g}.jsonl"
    rng = random.Random(0)
    with prompts.open("w") as f:  # enough for the whole run: guidellm stops when its data runs out
        for _ in range(max(50, int(rate * seconds * 1.5))):
            row = {"prompt": gate_load.prompt_text(PROMPT_TOKENS, rng), "output_tokens_count": OUTPUT_TOKENS}
            f.write(json.dumps(row) + "\n")
    out = work / f"guidellm-{rate:g}.json"
    if seconds > 0:
        profile, limit = f"kind=poisson,rate={rate:g}", f"kind=max_duration,seconds={seconds:g}"
    else:
        profile, limit = "kind=synchronous", "kind=max_requests,count=1"
    backend = f"kind=openai_http,target={url},validate_backend=false,model=stub,stream=false"
    cmd = [exe, "run", f"--backend={backend}", f"--profile={profile}", f"--constraint={limit}",
           f"--data=kind=json_file,path={prompts}", f"--output=kind=json,path={out}", "--disable-console"]  # fmt: skip
    cpu0 = _cpu_s(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "*"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300 + 3 * seconds, check=False)
    cpu = _cpu_s(resource.RUSAGE_CHILDREN) - cpu0
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-400:]}")
    return json.loads(out.read_text()), cpu


def theirs(exe: str, url: str, rate: float, seconds: float, work: Path, startup_cpu: float) -> Figures:
    """guidellm's figures. Its send lag is not printed: its report's per-request target times (a start time plus a
    relative offset, per worker process) do not order its own sends consistently, so no lag can be derived."""
    report, cpu = _guidellm_run(exe, url, rate, seconds, work)
    reqs = report["benchmarks"][0]["requests"]
    done = [r for kind in ("successful", "errored", "incomplete") for r in (reqs.get(kind) or [])]
    starts = sorted(r["info"]["timings"]["request_start"] for r in done if r["info"]["timings"].get("request_start"))
    span = (starts[-1] - starts[0]) if len(starts) > 1 else seconds
    n = len(done)
    nan = float("nan")
    errors = len(reqs.get("errored") or []) + len(reqs.get("incomplete") or [])
    cpu_per_req = max(0.0, cpu - startup_cpu) / max(1, n)
    return Figures(n / span if span else nan, n, errors, nan, nan, nan, cpu_per_req, load_avg=os.getloadavg()[0])


def _row(label: str, rate: float, f: Figures) -> str:
    if f.lag_p50 != f.lag_p50:  # guidellm's: no lag can be derived from its report (theirs() says why)
        lags = f"{'-':>9} {'-':>9} {'-':>9}"
    else:
        lags = f"{f.lag_p50 * 1e3:>7.3f}ms {f.lag_p99 * 1e3:>7.3f}ms {f.lag_max * 1e3:>7.3f}ms"
    floor = f"{f.floor_p99 * 1e3:>7.3f}ms {f.lag_p99 / f.floor_p99:>6.2f}x" if f.floor_p99 == f.floor_p99 else f"{'':>9} {'':>7}"
    return (f"{label:>16} {rate:>6.0f} {f.achieved:>9.0f} {f.sent:>6} {f.errors:>5} {lags} {floor} "
            f"{f.cpu_per_req * 1e6:>7.0f}us {f.load_avg:>5.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100,500,1000,2000,3000", help="requests/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0, help="each rate's duration")
    parser.add_argument("--variants", default="timerfd,spin", help=f"generator variants, comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--guidellm", metavar="PATH", help="guidellm's executable: run the same rates with it too")
    parser.add_argument("--floor-only", type=float, metavar="SECONDS", help=argparse.SUPPRESS)  # floor_beside's child
    args = parser.parse_args()
    if args.floor_only is not None:
        print(json.dumps(host_floor(args.floor_only)))
        return
    rates = [float(r) for r in args.rates.split(",")]
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v.partition("+")[0] not in VARIANTS or v.partition("+")[2] not in EXTRAS]:
        parser.error(f"unknown variant {unknown[0]!r}: one of {', '.join(VARIANTS)}")
    p50, p99 = host_floor()
    print(f"host floor: a sleeping process wakes {p50 * 1e3:.3f} ms late at p50, {p99 * 1e3:.3f} ms at p99 "
          f"(load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs); each row's floor is measured beside it")  # fmt: skip
    best = dict.fromkeys(variants, 0.0)
    heads = ("tool", "rate", "achieved", "sent", "err", "lag p50", "lag p99", "lag max", "floor p99", "/floor", "cpu/req", "load")
    with stub_server() as stub, tempfile.TemporaryDirectory(prefix="bench-gate-") as tmp:
        httpx_cpu, our_cpu = asyncio.run(_sequential_cpu(stub.url, 1000))
        print(f"client CPU per request, 1000 sequential POSTs on one connection: httpx {httpx_cpu * 1e6:.0f} us, "
              f"diag.gate.http_client {our_cpu * 1e6:.0f} us")  # fmt: skip
        print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (16, 6, 9, 6, 5, 9, 9, 9, 9, 7, 9, 5), strict=True)))
        startup = 0.0
        if args.guidellm:
            _, startup = _guidellm_run(args.guidellm, stub.url, 1, 0, Path(tmp))
        for rate in rates:
            for variant in variants:  # side by side, each rate in turn: the same minute's host for every variant
                f = ours(stub.url, rate, args.seconds, variant, stub.proc.pid)
                if f.lag_p99 <= LAG_TARGET_S and f.errors == 0:
                    best[variant] = max(best[variant], rate)
                print(_row(variant, rate, f), flush=True)
            if args.guidellm:
                try:
                    other = theirs(args.guidellm, stub.url, rate, args.seconds, Path(tmp), startup)
                    print(_row("guidellm", rate, other), flush=True)
                except (RuntimeError, KeyError, IndexError, subprocess.TimeoutExpired) as exc:
                    print(f"{'guidellm':>16} {rate:>6.0f} failed: {exc}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end (other work shares the CPUs)")
    for variant, rate in best.items():
        print(f"{variant}: highest rate with send-lag p99 <= {LAG_TARGET_S * 1e3:g} ms and no errors: {rate:.0f} requests/s")


if __name__ == "__main__":
    main()
