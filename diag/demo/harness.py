"""Start ``diag demo serve`` as a real subprocess on a free loopback port, and stop it by PID.

Why in the package and not in tests/: the demo's own tests, the fault-injection scenarios and the
benches all need the same thing -- a real multi-worker server, ready (every worker has its weights
mapped), whose processes are known by PID so they can be measured and then ended, never looked up
by name. ``cgroup`` lets a scenario start it inside a ``tests.livecg`` memory cgroup (anything with
``spawn(argv, **popen_kwargs)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

SPAWN_MARK = "spawn_main"  # multiprocessing's spawned children; uvicorn's workers are these


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DemoServer:
    """A running demo: the supervisor's PID, its worker PIDs, the base URL, the log and recorder files."""

    proc: subprocess.Popen[bytes]
    port: int
    workers: int
    log_path: Path
    recorder: Path | None
    weights_dir: Path
    worker_pids: list[int] = field(default_factory=list)
    weights_file: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def current_workers(self) -> list[int]:
        """PIDs of the supervisor's spawned workers now (its resource tracker excluded)."""
        try:
            children = psutil.Process(self.pid).children()
        except psutil.Error:
            return []
        pids = []
        for child in children:
            with contextlib.suppress(psutil.Error):
                if any(SPAWN_MARK in part for part in child.cmdline()):
                    pids.append(child.pid)
        return sorted(pids)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the supervisor (it stops its workers); SIGKILL by PID whatever is left after ``timeout``."""
        known = set(self.worker_pids) | set(self.current_workers())
        with contextlib.suppress(psutil.Error):
            known |= {c.pid for c in psutil.Process(self.pid).children(recursive=True)}
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait(5)
        for pid in known:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                p.kill()
                p.wait(5)
        return self.proc.returncode


def mapped_weights(pid: int, weights_dir: str | os.PathLike[str]) -> str | None:
    """The demo checkpoint under ``weights_dir`` that ``pid`` maps (from /proc/<pid>/maps), if any."""
    prefix = str(Path(weights_dir).resolve()) + "/"
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.startswith(prefix) and path.endswith(".safetensors"):
                    return path
    except OSError:
        pass
    return None


def start_demo(
    args: Sequence[str] = (),
    *,
    workers: int = 1,
    weights_mb: float = 16,
    weights_dir: str | os.PathLike[str],
    log_dir: str | os.PathLike[str],
    recorder: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    ready_timeout: float = 60.0,
    cgroup: Any = None,
    nice: int = 0,
) -> DemoServer:
    """Start the server and wait until every worker finished its start-up (weights loaded and touched).

    ``nice`` below 0 (root only) gives the server's processes the scheduler's preference: a test whose
    premise is "inference time does not depend on the load" then holds on a shared 2-core host, where
    another process's CPU burst would otherwise slow the one inference thread and read as inflation.
    """
    port = free_port()
    log_path = Path(log_dir) / f"demo-{port}.log"
    argv = [
        sys.executable, "-m", "diag.cli.demo", "serve",
        "--port", str(port), "--workers", str(workers),
        "--weights-mb", str(weights_mb), "--weights-dir", str(weights_dir),
        "--log-level", "info", "--no-access-log",
    ]  # fmt: skip
    argv += ["--recorder", str(recorder)] if recorder is not None else ["--no-recorder"]
    argv += list(args)
    if nice:
        argv = ["nice", "-n", str(nice), *argv]  # exec'd in place: the PID is the server's
    full_env = {**os.environ, **(env or {})}
    full_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log_fh = open(log_path, "wb")  # noqa: SIM115 - the child owns it for its life
    try:
        popen_kwargs: dict[str, Any] = {"stdout": log_fh, "stderr": subprocess.STDOUT, "env": full_env}
        proc = cgroup.spawn(argv, **popen_kwargs) if cgroup is not None else subprocess.Popen(argv, **popen_kwargs)
    finally:
        log_fh.close()
    server = DemoServer(proc, port, workers, log_path, Path(recorder) if recorder else None, Path(weights_dir))
    try:
        _wait_ready(server, ready_timeout)
    except BaseException:
        server.stop()
        raise
    return server


READY_LINE = "Application startup complete."  # uvicorn logs it once per worker, after the lifespan startup


def _wait_ready(server: DemoServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"demo server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
            if server.log().count(READY_LINE) < server.workers:
                time.sleep(0.1)
                continue
            pids = server.current_workers()
            mapped = {mapped_weights(pid, server.weights_dir) for pid in pids}
            if len(pids) == server.workers and len(mapped) == 1 and None not in mapped:
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(server.url + "/healthz").status_code in (200, 503):
                        server.worker_pids = pids
                        server.weights_file = Path(str(mapped.pop()))
                        return
            time.sleep(0.1)
    raise TimeoutError(f"demo server not ready in {timeout} s:\n{server.log()[-4000:]}")


@contextlib.contextmanager
def demo_server(*args: Any, **kwargs: Any) -> Iterator[DemoServer]:
    """``with demo_server([...flags], workers=2, weights_dir=..., log_dir=...) as srv:`` -- always stopped."""
    server = start_demo(*args, **kwargs)
    try:
        yield server
    finally:
        server.stop()


# --------------------------------------------------------------------------- load and scrape


async def _post_all(url: str, bodies: Sequence[dict[str, Any]], concurrency: int) -> list[httpx.Response]:
    sem = asyncio.Semaphore(concurrency)
    # No keep-alive: every request is a new connection, so the kernel spreads them over the workers.
    limits = httpx.Limits(max_keepalive_connections=0, max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:

        async def one(body: dict[str, Any]) -> httpx.Response:
            async with sem:
                return await client.post("/v1/completions", json=body)

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def post_all(url: str, bodies: Sequence[dict[str, Any]], concurrency: int = 1) -> list[httpx.Response]:
    """POST every body to /v1/completions with at most ``concurrency`` in flight; responses in order."""
    return asyncio.run(_post_all(url, bodies, concurrency))


Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(url: str, path: str = "/metrics") -> Samples:
    """``GET /metrics`` (or another exposition ``path``) as sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + path, timeout=10.0).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def sample_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of one sample name over every series whose labels include ``labels``."""
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))
