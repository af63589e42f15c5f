"""The engine scenarios: llama.cpp (llama-cpp-python's own server) in a limited memory group, each incident for real.

Why beside the reference backend's scenarios: the rules must name the same incidents on an engine no one here
wrote -- its model lock, its mmap'd, mlock'd or private weights, its KV cache reserved by ``n_ctx`` -- attached
from outside. Each scenario takes ``attachment``: ``outside`` (nothing in the server; the request rows are the
load generator's, written to the scenario's recorder after the load) or ``wrapped`` (the server under ``diag
wrap``, writing its own rows). The scenarios that never serve a request (a server killed while it loads, copies
that only sit in memory) accept ``outside`` only: wrapping changes nothing they show.

The model is a GGUF written once per size and seed into the weights folder (``diag/demo/engine/model.py``); it
needs the ``engines`` extra, and every scenario says so before it starts anything. Servers run inside the
scenario's groups, so the runner's cleanup kills them by PID with their group; each scenario also stops its own
servers in ``finally``.

Registered into the library's ``SCENARIOS`` when the library is imported (it imports this module).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from collectors.recorder import FlightRecorder
from collectors.records import RequestTiming
from diag.demo.engine.client import completion, drive, drive_until
from diag.demo.engine.copies import limit_for_one_short, start_together
from diag.demo.engine.model import WrittenModel, write_model
from diag.demo.engine.pagecache import anon_bytes, set_limit
from diag.demo.engine.server import EngineServer, EngineSettings, EngineStartError, unavailable_reason
from diag.demo.scenarios.cgroups import MemoryGroup
from diag.demo.scenarios.context import MiB, ScenarioContext, evict_from_page_cache
from diag.demo.scenarios.registry import scenario

ATTACHMENTS = ("outside", "wrapped")
# The attachments each scenario takes: those that serve requests both; those that never serve one (a server killed
# while it loads, copies that only sit in memory) outside only -- wrapping the server changes nothing they show.
ENGINE_ATTACHMENTS: dict[str, tuple[str, ...]] = {
    "engine-healthy": ATTACHMENTS,
    "engine-queue": ATTACHMENTS,
    "engine-thrash": ATTACHMENTS,
    "engine-mlock": ("outside",),
    "engine-copies": ("outside",),
    "engine-fourth-copy": ("outside",),
    "engine-n-ctx": ("outside",),
}
MODEL_SEED = 7
START_INTERVAL_S = 0.25  # the agent's interval for a server that may die while it loads (it lives about a second)


def _model(ctx: ScenarioContext, mib: int) -> WrittenModel:
    """The scenario's GGUF, written once per size into the weights folder (same size and seed, same bytes)."""
    from diag.demo.engine.model import shape_for

    path = ctx.weights_dir / f"random-{mib}mib-seed{MODEL_SEED}.gguf"  # the engine tests' name too
    if path.is_file():
        return WrittenModel(path=path, shape=shape_for(mib * MiB), seed=MODEL_SEED, file_bytes=path.stat().st_size)
    ctx.progress(f"writing a {mib} MiB GGUF model to {path}")
    return write_model(path, mib * MiB, seed=MODEL_SEED)


def refuse(name: str, p: dict[str, Any]) -> None:
    """Refuse (ValueError, one line), before anything starts, an attachment the scenario cannot take or a host
    without the engine: ``Scenario.params`` calls it, so ``diag demo --scenario`` says so as a usage error."""
    attachments = ENGINE_ATTACHMENTS[name]
    if p["attachment"] not in attachments:
        raise ValueError(f"scenario {name}: attachment {p['attachment']!r}: it takes {' or '.join(attachments)}")
    reason = unavailable_reason()
    if reason:
        raise ValueError(f"scenario {name} runs llama.cpp: {reason}")


@contextlib.contextmanager
def _servers(ctx: ScenarioContext) -> Iterator[list[EngineServer]]:
    """The scenario's servers, stopped by PID (with everything in their group) however the scenario ends."""
    servers: list[EngineServer] = []
    try:
        yield servers
    finally:
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()


def _serve(
    ctx: ScenarioContext, servers: list[EngineServer], settings: EngineSettings, group: MemoryGroup, attachment: str,
    *, on_spawn: Callable[[int], object] | None = None,
) -> EngineServer:  # fmt: skip
    n = len(servers)
    wrap = ctx.recorder if attachment == "wrapped" else None
    server = EngineServer(settings, ctx.workdir / f"engine-{n}.log", group=group, wrap_recorder=wrap)
    servers.append(server)
    ctx.progress(f"starting llama_cpp.server ({attachment}) in {group.path}: n_ctx {settings.n_ctx}, "
                 f"use_mmap {settings.use_mmap}, use_mlock {settings.use_mlock}")  # fmt: skip
    server.start(on_spawn=on_spawn)
    ctx.extra_pids.add(server.pid)
    ctx.progress(f"server pid {server.pid} ready at {server.url}")
    return server


def _write_rows(ctx: ScenarioContext, rows: list[RequestTiming], attachment: str) -> None:
    """Outside: the load generator's rows are the request rows, written to the scenario's recorder (wrapped: the
    server wrote its own)."""
    ctx.notes["requests"] = len(rows)
    if attachment == "outside" and rows:
        with FlightRecorder(ctx.recorder) as recorder:
            recorder.write(rows)


def _settle(ctx: ScenarioContext, samples: int = 2, timeout_s: float = 15.0) -> None:
    """Wait until the agent has sampled ``samples`` more times: its samples cover the end of the run (and a wrapped
    server has flushed its last rows)."""
    agent = ctx.agent
    if agent is None:
        return
    seen, deadline = agent.samples, time.monotonic() + timeout_s
    while agent.samples < seen + samples and time.monotonic() < deadline:
        time.sleep(0.1)


def _watch_from_spawn(ctx: ScenarioContext) -> Callable[[int], None]:
    """An ``on_spawn`` hook: the agent (re)started watching the new PID too before the server's own code runs, at a
    quarter-second interval, so a server killed while it loads is seen."""

    def watch(pid: int) -> None:
        ctx.extra_pids.add(pid)
        if ctx.agent is not None:  # the agent's PIDs are fixed at its start: a new one watches the new server too
            ctx.agent.stop()
            ctx.agent = None
        agent = ctx.record(interval_s=START_INTERVAL_S)
        deadline = time.monotonic() + 15.0
        while agent.samples < 2 and time.monotonic() < deadline:
            time.sleep(0.05)

    return watch


def _start_and_die(ctx: ScenarioContext, servers: list[EngineServer], settings: EngineSettings, group: MemoryGroup) -> None:
    """Start a server expected to be killed while it loads; record whatever happens, and a second after it."""
    try:
        _serve(ctx, servers, settings, group, "outside", on_spawn=_watch_from_spawn(ctx))
        ctx.notes["started"] = True
    except EngineStartError as exc:
        ctx.notes["started"] = False
        ctx.progress(f"the server did not start: {str(exc).splitlines()[0][:200]}")
    _settle(ctx, samples=4)  # a second more: the kernel's OOM lines are read
    ctx.notes["oom_kills"] = group.oom_kills()


ENGINE: dict[str, Any] = {"model_mib": 64, "attachment": "outside", "check": refuse}


# --------------------------------------------------------------------------- serving: healthy, queue, thrashing


@scenario(
    "engine-healthy",
    "healthy",
    "llama.cpp with room for its model, one client at a time (closed loop): busy without a queue, nothing should fire",
    needs_cgroups=True,
    speaks_dialects=False,
    load_s=32.0,  # the leak rule judges no less than 30 s of memory samples
    tokens=16,
    **ENGINE,
)
def engine_healthy(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: one request at a time, no queue wait, memory flat, PSI ~0, no OOM kill."""
    model = _model(ctx, p["model_mib"])
    group = ctx.group("service", 1024 * MiB)
    assert group is not None
    with _servers(ctx) as servers:
        server = _serve(ctx, servers, EngineSettings(model=model.path, n_ctx=256), group, p["attachment"])
        ctx.record()
        ctx.pause(2, "baseline")
        rows = drive_until(server.url, p["load_s"], concurrency=1, max_tokens=p["tokens"], pid=server.pid)
        _settle(ctx)
        _write_rows(ctx, rows, p["attachment"])
        ctx.notes["oom_kills"] = group.oom_kills()


@scenario(
    "engine-queue",
    "queue_backlog",
    "one client at a time, then more concurrent requests than llama.cpp decodes: they wait behind its model lock",
    needs_cgroups=True,
    speaks_dialects=False,
    calm_s=8.0,
    requests=48,
    concurrency=8,
    tokens=24,
    **ENGINE,
)
def engine_queue(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: no wait while one client sends, then queue wait growing to many times the inference time,
    inference flat, memory flat, PSI ~0.

    Why a calm phase first: an incident starts from a service that kept up, and the backlog is judged against it
    (wait rising with load while inference holds). Straight into the overload, the window's only calm is the
    server's start-up: under ``diag wrap`` its readiness poll is a request row too, and the queue was empty
    between it and the load -- measured, that left the wrapped run with no calm to compare with and a queue that
    had emptied, so no backlog was named."""
    model = _model(ctx, p["model_mib"])
    group = ctx.group("service", 1024 * MiB)
    assert group is not None
    with _servers(ctx) as servers:
        server = _serve(ctx, servers, EngineSettings(model=model.path, n_ctx=256), group, p["attachment"])
        ctx.record()
        ctx.pause(2, "baseline")
        rows = drive_until(server.url, p["calm_s"], concurrency=1, max_tokens=p["tokens"], pid=server.pid)
        prompts = [f"request {i}: why is the service slow?" for i in range(p["requests"])]
        rows += drive(server.url, prompts, concurrency=p["concurrency"], max_tokens=p["tokens"], pid=server.pid)
        _settle(ctx)
        _write_rows(ctx, rows, p["attachment"])


@scenario(
    "engine-thrash",
    "thrashing",
    "llama.cpp's mmap'd weights in a group with room for half of them: every token faults the model back in",
    needs_cgroups=True,
    speaks_dialects=False,
    load_s=20.0,
    concurrency=2,
    tokens=8,
    room=0.5,  # the share of the model the limit leaves beside what the server holds otherwise
    **ENGINE,
)
def engine_thrash(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: major faults and refaults climbing, memory PSI in the group, slow tokens; no OOM kill (file pages
    can always be dropped)."""
    model = _model(ctx, p["model_mib"])
    evict_from_page_cache(model.path)  # its pages must be charged to the engine's group, not to their writer's
    group = ctx.group("service", 1024 * MiB)
    assert group is not None
    with _servers(ctx) as servers:
        settings = EngineSettings(model=model.path, n_ctx=256, use_mmap=True, use_mlock=False)
        server = _serve(ctx, servers, settings, group, p["attachment"])
        with httpx.Client() as client:
            completion(client, server.url, "warm up", max_tokens=2)  # llama.cpp's buffers are all allocated now
        limit = anon_bytes(group) + int(model.file_bytes * p["room"])
        set_limit(group, limit)
        ctx.notes["limit_mib"] = round(limit / MiB, 1)
        ctx.progress(f"limit set to {limit / MiB:.0f} MiB: the server's anonymous memory + {p['room']:g} of the model")
        ctx.record()
        rows = drive_until(server.url, p["load_s"], concurrency=p["concurrency"], max_tokens=p["tokens"], pid=server.pid)
        _settle(ctx)
        _write_rows(ctx, rows, p["attachment"])
        ctx.notes["oom_kills"] = group.oom_kills()


# --------------------------------------------------------------------------- memory: mlock, private copies, n_ctx


@scenario(
    "engine-mlock",
    "host_oom",
    "use_mlock=true in a group with room for half the model: the kernel OOM-kills the server while it locks the weights",
    needs_cgroups=True,
    speaks_dialects=False,
    room=0.5,
    **ENGINE,
)
def engine_mlock(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: a memcg OOM kill while the server loads, the group's unevictable memory at the kill, the server's
    own ``--use_mlock true``; it never serves."""
    model = _model(ctx, p["model_mib"])
    probe = ctx.group("probe", 1024 * MiB)
    assert probe is not None
    with _servers(ctx) as servers:  # what a server holds besides the model, measured on an unlocked one
        server = _serve(ctx, servers, EngineSettings(model=model.path, n_ctx=256), probe, "outside")
        with httpx.Client() as client:
            completion(client, server.url, "warm up", max_tokens=2)
        room = anon_bytes(probe)
    ctx.extra_pids.discard(server.pid)  # the probe is not the incident
    evict_from_page_cache(model.path)  # the locked pages must be charged to the locked server's group
    group = ctx.group("service", room + int(model.file_bytes * p["room"]))
    assert group is not None
    with _servers(ctx) as servers:
        _start_and_die(ctx, servers, EngineSettings(model=model.path, n_ctx=256, use_mlock=True), group)


@scenario(
    "engine-copies",
    "duplicate_model_processes",
    "three llama.cpp servers with use_mmap=false in one group: three private copies of one model",
    needs_cgroups=True,
    speaks_dialects=False,
    servers=3,
    samples=8,
    **ENGINE,
)
def engine_copies(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: the servers' USS each about the model's size, the group's anonymous memory about that many copies."""
    model = _model(ctx, p["model_mib"])
    group = ctx.group("service", 1024 * MiB)
    assert group is not None
    settings = EngineSettings(model=model.path, n_ctx=256, use_mmap=False)
    with _servers(ctx) as servers:
        logs = [ctx.workdir / f"copy-{i}.log" for i in range(p["servers"])]
        started = start_together(settings, group, logs, on_started=servers.append)
        ctx.extra_pids.update(s.pid for s in started)
        ctx.notes["copies"] = [s.pid for s in started]
        ctx.progress(f"{len(started)} servers with private copies: pids {ctx.notes['copies']}")
        ctx.record()
        _settle(ctx, samples=p["samples"], timeout_s=60.0)


@scenario(
    "engine-fourth-copy",
    "host_oom",
    "three llama.cpp servers with use_mmap=false fill a group sized for three; a fourth copy runs it into a memcg OOM",
    needs_cgroups=True,
    speaks_dialects=False,
    servers=3,
    samples=6,
    **ENGINE,
)
def engine_fourth_copy(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: the running servers' USS each about the model's size; the fourth server's start charges its copy to
    the group and the kernel OOM-kills one of the copies (the largest process); the group's oom_kill count rises."""
    model = _model(ctx, p["model_mib"])
    group = ctx.group("service", 2048 * MiB)
    assert group is not None
    settings = EngineSettings(model=model.path, n_ctx=256, use_mmap=False)
    with _servers(ctx) as servers:
        logs = [ctx.workdir / f"copy-{i}.log" for i in range(p["servers"])]
        started = start_together(settings, group, logs, on_started=servers.append)
        ctx.extra_pids.update(s.pid for s in started)
        ctx.notes["copies"] = [s.pid for s in started]
        limit = limit_for_one_short(anon_bytes(group), len(started), model.file_bytes)
        set_limit(group, limit)
        ctx.notes["limit_mib"] = round(limit / MiB, 1)
        ctx.progress(f"{len(started)} private copies (pids {ctx.notes['copies']}); limit set to {limit / MiB:.0f} MiB: "
                     "room for them and half of one more")  # fmt: skip
        ctx.record()
        _settle(ctx, samples=p["samples"], timeout_s=60.0)
        _start_and_die(ctx, servers, settings, group)
        ctx.notes["fourth"] = servers[-1].proc.pid if servers[-1].proc is not None else None


@scenario(
    "engine-n-ctx",
    "unsafe_config",
    "n_ctx 32768 on a model trained for 4096, in a group of five times the weights: the KV reservation is killed",
    needs_cgroups=True,
    speaks_dialects=False,
    n_ctx=32768,
    group_in_models=5,
    **ENGINE,
)
def engine_n_ctx(ctx: ScenarioContext, p: dict[str, Any]) -> None:
    """Signals: the server's ``--n_ctx`` on its command line and the model's dimensions in the GGUF header (the
    agent's config record), a memcg OOM kill while the server reserves the KV cache; it never serves."""
    model = _model(ctx, p["model_mib"])
    group = ctx.group("service", p["group_in_models"] * model.file_bytes)
    assert group is not None
    with _servers(ctx) as servers:
        _start_and_die(ctx, servers, EngineSettings(model=model.path, n_ctx=p["n_ctx"]), group)
