"""The multi-worker launcher: N uvicorn worker processes on one port, under uvicorn's own supervisor.

Why uvicorn's supervisor (``uvicorn.supervisors.Multiprocess``) rather than our own fork +
SO_REUSEPORT: it *spawns* workers (fresh interpreters), so no worker inherits numpy/OpenBLAS thread
state from a parent that already ran numpy -- the fork-after-threads deadlock (reproduced with
numpy/OpenBLAS: a forked child waits forever on a lock a BLAS thread held) cannot happen; the parent
binds the socket once and passes it to every worker, so the kernel spreads accepted connections over
them; it restarts a worker that dies (an OOM kill shows up as a restart, as in production); and it
is what users already run (``uvicorn --workers N``), so the demo's process tree looks like theirs.
It is used for one worker too, so the tree is always supervisor + workers and
``PROMETHEUS_MULTIPROC_DIR`` is always in force before any worker imports prometheus_client.

Order of start-up, and why:
1. BLAS/OpenMP thread counts go into the environment (inherited by spawned workers before they
   import numpy): N workers x all-cores BLAS pools would oversubscribe the CPUs.
2. The checkpoint is generated here, once, before any worker exists (workers never race to write it).
3. A fresh temporary ``PROMETHEUS_MULTIPROC_DIR`` is created and exported; it is removed at exit, so
   counters never leak from an earlier run into ``/metrics``.
SIGTERM/SIGINT reach the supervisor, which sends SIGTERM to every worker and waits for them; each
worker drains (``timeout_graceful_shutdown``), stops its batcher and flushes its recorder.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from diag.demo.settings import SETTINGS_ENV, DemoSettings
from diag.demo.weights import ModelConfig, ensure_weights, weights_path

log = logging.getLogger("diag.demo")

APP_FACTORY = "diag.demo.app:create_app_from_env"
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _params(callable_: Callable[..., object]) -> Mapping[str, inspect.Parameter]:
    """The keyword arguments ``callable_`` accepts: the demo runs on the range of uvicorn releases that
    pyproject.toml allows (it installs beside a service's own uvicorn), whose signatures differ."""
    return inspect.signature(callable_).parameters


def set_thread_env(threads: int) -> None:
    """Pin BLAS/OpenMP pools for this process's future children (and itself, if numpy is not imported yet)."""
    for name in THREAD_ENV:
        os.environ[name] = str(max(1, int(threads)))


def prepare_weights(weights_dir: str | os.PathLike[str], config: ModelConfig) -> Path:
    path = weights_path(weights_dir, config)
    if not path.exists():
        t0 = time.monotonic()
        log.info("generating %.0f MiB demo checkpoint at %s", config.nbytes() / 2**20, path)
        ensure_weights(weights_dir, config)
        log.info("checkpoint ready in %.1f s", time.monotonic() - t0)
    return path


def serve(
    settings: DemoSettings,
    config: ModelConfig,
    *,
    weights_dir: str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int = 1,
    threads: int = 1,
    log_level: str = "info",
    access_log: bool = True,
    graceful_timeout_s: float = 10.0,
) -> int:
    """Run the demo until SIGTERM/SIGINT. Returns a process exit code."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    if workers < 1:
        raise ValueError("workers must be >= 1")
    set_thread_env(threads)
    path = prepare_weights(weights_dir, config)
    settings = dataclasses.replace(settings, weights_path=str(path), workers=workers)
    os.environ[SETTINGS_ENV] = settings.to_json()

    prom_dir = tempfile.mkdtemp(prefix="llmdiag-demo-prom-")
    previous = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = prom_dir
    try:
        uv_config = uvicorn.Config(
            APP_FACTORY,
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_level=log_level,
            access_log=access_log,
            timeout_graceful_shutdown=int(graceful_timeout_s),
            # A worker busy in a long batch must not be declared hung and killed by the supervisor
            # (uvicorn < 0.37 has no such option: its supervisor waits 5 s for a worker's answer).
            **({"timeout_worker_healthcheck": 30} if "timeout_worker_healthcheck" in _params(uvicorn.Config) else {}),
        )
        sock = uv_config.bind_socket()
        try:
            # uvicorn < 0.51's supervisor takes the worker's entry point; later ones build it from the config.
            target = {"target": uvicorn.Server(uv_config).run} if "target" in _params(Multiprocess) else {}
            Multiprocess(uv_config, sockets=[sock], **target).run()
        finally:
            sock.close()
        return 0
    finally:
        shutil.rmtree(prom_dir, ignore_errors=True)
        if previous is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous
