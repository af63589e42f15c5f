"""``diag demo serve``: the command line of the reference backend.

Every flag mirrors a knob from the incident write-ups, and every default is the *safe* setting
(bounded concurrency and queue, timeouts on, prompts capped, token-budget batching, one shared copy
of the weights, no refresh on the request path, a memory guard). Reproducing an incident means
turning one of them to its unsafe value, e.g. ``--workers 4 --preload per-worker`` (four copies),
``--refresh every-request`` (a loader on the request path), ``--batching requests`` (a batch of long
prompts), ``--max-concurrency 1`` (a queue), ``--experts 8 --router-skew 4`` (one hot expert).

``diag demo --scenario NAME`` (``demo_group``) runs one of the incident scenarios of
``diag.demo.scenarios`` for real and prints the analysis of its recorded window.

Wiring: ``register(app)`` adds the ``demo`` group to a Typer app (``diag/cli.py`` does); running
this module directly (``python -m diag.demo.cli serve ...``) works without it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer


def _none_if_zero(value: float | int | None) -> float | int | None:
    return None if value is None or value <= 0 else value


def serve(
    host: Annotated[str, typer.Option(help="Interface to bind. Loopback by default: this is a demo.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (all workers share it).")] = 8000,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes (uvicorn's spawn supervisor).")] = 1,
    max_concurrency: Annotated[
        int, typer.Option(help="Inference slots per worker; 0 = unlimited (unsafe: no back-pressure).")
    ] = 4,
    queue_size: Annotated[
        int, typer.Option(help="Requests that may wait for a slot per worker; one more gets 429. -1 = unbounded (unsafe).")
    ] = 16,
    queue_timeout: Annotated[float, typer.Option(help="Seconds a request may wait for a slot before 503; 0 = forever.")] = 10.0,
    request_timeout: Annotated[float, typer.Option(help="Seconds of inference before 504; 0 = no limit.")] = 30.0,
    preload: Annotated[
        str,
        typer.Option(
            help="per-worker: each worker reads a private copy (RSS = weights per worker); "
            "shared: one read-only mmap, the page cache holds one copy for all workers."
        ),
    ] = "shared",
    refresh: Annotated[
        str,
        typer.Option(
            help="none: load once; every-request: re-read the checkpoint on the request path (blocking); "
            "ttl: cache, revalidated in the background every --refresh-ttl seconds."
        ),
    ] = "none",
    refresh_ttl: Annotated[float, typer.Option(help="Seconds between background revalidations (ttl mode).")] = 300.0,
    batching: Annotated[
        str, typer.Option(help="requests: cap batches by request count; tokens: cap them by prompt-token budget.")
    ] = "tokens",
    max_batch_requests: Annotated[int, typer.Option(min=1, help="Most requests in one batch.")] = 8,
    max_batch_tokens: Annotated[
        int, typer.Option(min=1, help="Prompt-token budget of one batch (tokens mode; a lone bigger prompt runs alone).")
    ] = 4096,
    max_prompt_tokens: Annotated[
        int, typer.Option(help="Longest prompt accepted (tokens = UTF-8 bytes + 1); longer gets 413. 0 = unbounded (unsafe).")
    ] = 2048,
    max_output_tokens: Annotated[int, typer.Option(min=1, help="Largest max_tokens accepted; larger gets 400.")] = 512,
    memory_guard: Annotated[
        float,
        typer.Option(help="Refuse new work with 503 above this fraction of memory in use (own cgroup, else host); 0 = off."),
    ] = 0.9,
    psi_guard: Annotated[
        float, typer.Option(help="Refuse new work while memory PSI some avg10 exceeds this percent; 0 = off.")
    ] = 0.0,
    recorder: Annotated[
        str | None,
        typer.Option(help="Flight recorder (SQLite) path; default $LLMDIAG_RECORDER or the user state dir."),
    ] = None,
    no_recorder: Annotated[bool, typer.Option("--no-recorder", help="Do not write a flight recorder.")] = False,
    weights_dir: Annotated[
        Path | None, typer.Option(help="Where the generated checkpoint is cached (default: user cache dir).")
    ] = None,
    weights_mb: Annotated[float, typer.Option(min=1, help="Checkpoint size in MiB (most of it a hashed n-gram table).")] = 200,
    experts: Annotated[int, typer.Option(min=0, help="MoE experts per layer; 0 = dense FFN.")] = 0,
    top_k: Annotated[int, typer.Option(min=1, help="Experts per token (MoE).")] = 2,
    router_skew: Annotated[float, typer.Option(min=0, help="Logits added to expert 0: 0 = balanced, 4+ = one hot expert.")] = 0.0,
    expert_capacity_factor: Annotated[
        float,
        typer.Option(
            min=0,
            help="MoE: each expert takes at most ceil(factor x tokens x top-k / experts) tokens per pass; the rest "
            "overflow and are dropped from it (GShard/Switch style). 0 = no capacity.",
        ),
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the generated weights.")] = 0,
    leak_kib_per_request: Annotated[
        int,
        typer.Option(
            min=0,
            help="A deliberate bug, for the leak scenario: keep this many KiB of written memory per successful "
            "request, forever (per worker). 0 = off.",
        ),
    ] = 0,
    threads: Annotated[int, typer.Option(min=1, help="BLAS/OpenMP threads per worker.")] = 1,
    log_level: Annotated[str, typer.Option(help="uvicorn log level. Prompts and completions are never logged.")] = "info",
    access_log: Annotated[bool, typer.Option(help="uvicorn's access log (method, path, status; never bodies).")] = True,
) -> None:
    """Serve the reference LLM backend: POST /v1/completions, GET /healthz, GET /metrics."""
    # Imported here, not at module level: `diag collect` (the always-on agent) must not pay for numpy.
    from diag.demo.server import serve as run_server
    from diag.demo.settings import DemoSettings
    from diag.demo.weights import ModelConfig, default_weights_dir

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = DemoSettings(
            preload=preload,
            refresh=refresh,
            refresh_ttl_s=refresh_ttl,
            batching=batching,
            max_batch_requests=max_batch_requests,
            max_batch_tokens=max_batch_tokens,
            router_skew=router_skew,
            expert_capacity_factor=expert_capacity_factor,
            max_concurrency=_none_if_zero(max_concurrency),  # type: ignore[arg-type]
            queue_size=None if queue_size < 0 else queue_size,
            queue_timeout_s=_none_if_zero(queue_timeout),
            request_timeout_s=_none_if_zero(request_timeout),
            max_prompt_tokens=_none_if_zero(max_prompt_tokens),  # type: ignore[arg-type]
            max_output_tokens=max_output_tokens,
            memory_guard=_none_if_zero(memory_guard),
            psi_guard=_none_if_zero(psi_guard),
            recorder=None if no_recorder else (recorder or ""),
            leak_kib_per_request=leak_kib_per_request,
        )
        config = ModelConfig.for_budget(weights_mb, experts=experts, top_k=top_k, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    code = run_server(
        settings,
        config,
        weights_dir=weights_dir or default_weights_dir(),
        host=host,
        port=port,
        workers=workers,
        threads=threads,
        log_level=log_level.lower(),
        access_log=access_log,
    )
    raise typer.Exit(code)


SCENARIO_HELP = (
    "Reproduce an incident for real and analyse it: NAME is one of healthy, leak, pressure, queue, thrash, "
    "duplicate-models, loader-refresh, moe-skew, request-count-batching, oversized-context, noisy-neighbour, host-oom."
)


def demo_group(
    ctx: typer.Context,
    scenario: Annotated[str | None, typer.Option("--scenario", help=SCENARIO_HELP, metavar="NAME")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the Analysis JSON (as `diag analyze --json`) instead of text.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of the load (prompts, arrival times).")] = 0,
    keep_recorder: Annotated[
        Path | None,
        typer.Option(help="Copy the scenario's flight recorder here (analyse it again with `diag analyze --recorder`)."),
    ] = None,
    export: Annotated[
        Path | None, typer.Option(help="Write the scenario's records here as JSON lines, gzip-compressed (a replayable fixture).")
    ] = None,
    param: Annotated[
        list[str] | None, typer.Option("--param", help="Override a scenario parameter, KEY=VALUE (repeatable); see --list.")
    ] = None,
    weights_dir: Annotated[Path | None, typer.Option(help="Checkpoint cache (default: the user cache dir).")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the scenarios, what they inject and their parameters.")] = False,
) -> None:
    """The reference LLM backend (`serve`), and real incident scenarios on it (`--scenario NAME`).

    A scenario starts `diag demo serve` inside a real memory cgroup with a limit, records it with the host agent,
    injects its fault for real (a leak that leaks, page-cache thrash, four model copies, a noisy neighbour, an OOM
    kill, ...), drives bounded load on 127.0.0.1, removes every process and cgroup it made, and prints the analysis
    of the recorded window. Progress goes to stderr. About a minute each.

    Exit codes: 0 the analysis concluded the scenario's class; 1 it concluded something else; 2 bad usage;
    3 the scenario needs memory cgroups this host cannot give (root and a cgroup v1 memory controller); 130 interrupted.

    Examples:\n
      diag demo --scenario leak\n
      diag demo --scenario thrash --json --keep-recorder /tmp/thrash.db\n
      diag demo --scenario queue --param ramp=0.5,1,2 --seed 3
    """
    if ctx.invoked_subcommand is not None:
        if scenario or list_:
            raise typer.BadParameter("--scenario/--list cannot be combined with a subcommand")
        return
    if list_:
        _list_scenarios()
        return
    if scenario is None:
        typer.echo(ctx.get_help())
        return
    raise typer.Exit(_run_scenario(scenario, as_json, seed, keep_recorder, export, param or [], weights_dir))


def _list_scenarios() -> None:
    from diag.demo.scenarios.library import SCENARIOS

    for s in SCENARIOS.values():
        cg = "needs memory cgroups" if s.needs_cgroups else "cgroup if available"
        typer.echo(f"{s.name}  ->  {s.expected}  ({cg})\n    {s.summary}")
        typer.echo("    params: " + ", ".join(f"{k}={v}" for k, v in s.defaults.items()))


def _parse_params(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--param {item!r}: expected KEY=VALUE")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _run_scenario(
    name: str,
    as_json: bool,
    seed: int,
    keep_recorder: Path | None,
    export: Path | None,
    params: list[str],
    weights_dir: Path | None,
) -> int:
    import json
    import sys

    from diag.demo.scenarios import EXIT_NO_CGROUPS
    from diag.demo.scenarios.cgroups import CgroupUnavailable
    from diag.demo.scenarios.library import SCENARIOS
    from diag.demo.scenarios.runner import run_scenario

    if name not in SCENARIOS:
        typer.secho(f"diag: unknown scenario {name!r}; one of: {', '.join(SCENARIOS)}", err=True, fg=typer.colors.RED)
        return 2
    try:
        overrides = _parse_params(params)
        SCENARIOS[name].params(overrides)  # validate before anything starts
    except (ValueError, typer.BadParameter) as exc:
        typer.secho(f"diag: {exc}", err=True, fg=typer.colors.RED)
        return 2
    try:
        result = run_scenario(
            name, seed=seed, params=overrides, weights_dir=weights_dir, keep_recorder=keep_recorder, fixture=export
        )
    except CgroupUnavailable as exc:
        typer.secho(f"diag: {exc}", err=True, fg=typer.colors.RED)
        return EXIT_NO_CGROUPS
    except KeyboardInterrupt:
        typer.secho("diag: interrupted; every process and cgroup of the scenario was removed", err=True)
        return 130
    analysis = result.analysis
    if as_json:
        json.dump(analysis.to_dict(), sys.stdout, indent=2, allow_nan=False, default=str)
        sys.stdout.write("\n")
    else:
        from diag.analysis_view import render_analysis

        render_analysis(analysis)
    match = analysis.primary == result.expected
    typer.echo(
        f"[demo] scenario {name}: expected {result.expected}, analysis says {analysis.primary} "
        f"({'match' if match else 'MISMATCH'}); {result.wall_s:.0f} s",
        err=True,
    )
    return 0 if match else 1


def register(app: typer.Typer) -> None:
    """Add the ``demo`` command group (``demo serve`` and ``demo --scenario NAME``) to ``app``."""
    demo = typer.Typer(invoke_without_command=True)  # help: demo_group's docstring
    demo.callback()(demo_group)
    demo.command("serve")(serve)
    app.add_typer(demo, name="demo")


def main() -> None:
    """``python -m diag.demo.cli serve ...`` without the top-level ``diag`` CLI."""
    app = typer.Typer(add_completion=False, no_args_is_help=True)
    app.command("serve")(serve)

    @app.callback()
    def _group() -> None:
        """The reference LLM backend."""

    app()


if __name__ == "__main__":
    main()
