"""``diag demo serve``: the command line of the reference backend.

Every flag mirrors a knob from the incident write-ups, and every default is the *safe* setting
(bounded concurrency and queue, timeouts on, prompts capped, token-budget batching, one shared copy
of the weights, no refresh on the request path, a memory guard). Reproducing an incident means
turning one of them to its unsafe value, e.g. ``--workers 4 --preload per-worker`` (four copies),
``--refresh every-request`` (a loader on the request path), ``--batching requests`` (a batch of long
prompts), ``--max-concurrency 1`` (a queue), ``--experts 8 --router-skew 4`` (one hot expert).

``diag demo --scenario NAME`` (``demo_group``) runs one of the incident scenarios of
``diag.demo.scenarios`` for real and prints the analysis of its recorded window.

Wiring: ``register(app)`` adds the ``demo`` group to a Typer app (``diag/cli/main.py`` does); running
this module directly (``python -m diag.cli.demo serve ...``) works without it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer


def _none_if_zero(value: float | int | None) -> float | int | None:
    return None if value is None or value <= 0 else value


# uvicorn's levels that Python's logging also knows (uvicorn's extra "trace" is not one of them).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _fail(message: str) -> typer.Exit:
    typer.secho(f"diag: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(2)


def _checked_serve_options(o: dict[str, Any]) -> dict[str, Any]:
    """Every ``serve`` option checked before anything starts, each message naming the option, its value and
    what it accepts; returns the normalised choices. The paths are checked last."""
    from diag.cli import options as opts
    from diag.demo.batcher import BATCHING_MODES
    from diag.demo.dialects import DIALECTS
    from diag.demo.weights import PRELOAD_MODES, REFRESH_MODES

    out = {
        "preload": opts.choice("--preload", o["preload"], PRELOAD_MODES),
        "refresh": opts.choice("--refresh", o["refresh"], REFRESH_MODES),
        "batching": opts.choice("--batching", o["batching"], BATCHING_MODES),
        "log_level": opts.choice("--log-level", o["log_level"], LOG_LEVELS),
        "host": opts.host("--host", o["host"]),
    }
    out["metrics_dialect"], *also = _dialects(o["metrics_dialect"], DIALECTS)
    out["also_metrics_dialects"] = tuple(also)
    if (out["metrics_dialect"] != "llmdiag" or also) and o["workers"] != 1:
        raise opts.OptionError(f"--metrics-dialect {o['metrics_dialect']}: needs --workers 1 (an engine's /metrics is "
                               "one process's state); use --workers 1")  # fmt: skip
    opts.number("--kv-cache-tokens", o["kv_cache_tokens"], low=0, meaning="tokens; 0 = none enforced",
                examples=("4096", "16384"))  # fmt: skip
    longest = o["max_prompt_tokens"] + o["max_output_tokens"] + 16
    if o["kv_cache_tokens"] and (o["max_prompt_tokens"] == 0 or o["kv_cache_tokens"] < longest):
        raise opts.OptionError(f"--kv-cache-tokens {o['kv_cache_tokens']}: must hold one request of a bounded "
                               f"--max-prompt-tokens + --max-output-tokens + a block; use at least {longest}")  # fmt: skip
    opts.number("--max-concurrency", o["max_concurrency"], low=0, meaning="slots per worker; 0 = unlimited",
                examples=("4", "1"))  # fmt: skip
    opts.number("--queue-size", o["queue_size"], low=-1, meaning="waiting requests per worker; -1 = unbounded",
                examples=("16", "64"))  # fmt: skip
    for name in ("queue_timeout", "request_timeout"):
        opts.number(f"--{name.replace('_', '-')}", o[name], low=0, meaning="seconds; 0 = no limit", examples=("10", "30"))
    if o["refresh_ttl"] <= 0:
        raise opts.OptionError(f"--refresh-ttl {o['refresh_ttl']:g}: seconds, more than 0; use e.g. 60 or 300")
    opts.number("--max-prompt-tokens", o["max_prompt_tokens"], low=0, meaning="tokens; 0 = unbounded",
                examples=("2048", "8192"))  # fmt: skip
    opts.number("--memory-guard", o["memory_guard"], low=0, high=1, meaning="a fraction of memory in use; 0 = off",
                examples=("0.9", "0.8"))  # fmt: skip
    opts.number("--psi-guard", o["psi_guard"], low=0, high=100, meaning="percent of memory PSI some avg10; 0 = off",
                examples=("10", "25"))  # fmt: skip
    if o["experts"] and o["top_k"] > o["experts"]:
        fitting = [str(k) for k in (1, 2) if k <= o["experts"]]
        raise opts.OptionError(f"--top-k {o['top_k']}: at most --experts ({o['experts']}); use e.g. {opts.listing(fitting)}")
    opts.port("--port", o["port"])
    if o["no_recorder"] and o["recorder"] is not None:
        raise opts.OptionError("--recorder cannot be used with --no-recorder")
    if o["recorder"] is not None:
        opts.writable_file_path("--recorder", Path(o["recorder"]))
    if o["weights_dir"] is not None:
        opts.folder_path("--weights-dir", o["weights_dir"])
    return out


def _dialects(value: str, known: tuple[str, ...]) -> list[str]:
    """``--metrics-dialect``: one dialect, or several separated by commas (each once): engines' dialects, after the
    tracker's (``llmdiag``) or not."""
    from diag.cli import options as opts

    names = []
    for part in value.split(","):
        try:
            names.append(opts.choice("--metrics-dialect", part.strip(), known))
        except opts.OptionError:
            raise opts.OptionError(f"--metrics-dialect {value!r}: use one of {opts.listing(known)} (or engines' "
                                   "dialects comma-separated: vllm,tgi,llamacpp)") from None  # fmt: skip
    if "llmdiag" in names[1:]:
        raise opts.OptionError(f"--metrics-dialect {value!r}: llmdiag (the tracker) can only come first -- it keeps "
                               "/metrics, the engines' dialects go to /metrics/<dialect>; use e.g. llmdiag,vllm")  # fmt: skip
    if len(set(names)) != len(names):
        raise opts.OptionError(f"--metrics-dialect {value!r}: a dialect named twice; use e.g. vllm,tgi or vllm")
    return names


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
    metrics_dialect: Annotated[
        str,
        typer.Option(
            help="The /metrics the server speaks: llmdiag (the tracker's families and flight recorder), or vllm, tgi, "
            "llamacpp: that engine's families from the server's live state, uninstrumented (no tracker families, no "
            "recorder). Engines' dialects need --workers 1. Several, comma-separated (vllm,tgi,llamacpp): the first at "
            "/metrics, each engine's at /metrics/<dialect>, all from the same state; llmdiag first (llmdiag,vllm): the "
            "tracker's /metrics and recorder, and each engine's families beside them."
        ),
    ] = "llmdiag",
    kv_cache_tokens: Annotated[
        int,
        typer.Option(
            help="KV-cache budget in tokens (16-token blocks): a request is admitted when its prompt's blocks are free; "
            "a running sequence that cannot grow is preempted and recomputed later (vLLM's policy). 0 = none enforced "
            "(usage reported against room for a full batch)."
        ),
    ] = 0,
    min_step_ms: Annotated[
        float,
        typer.Option(
            min=0,
            help="A floor on each model step's milliseconds (prefill or decode), as an accelerator paces a real "
            "engine: a step faster than this sleeps out the rest, so the service rate no longer follows the host's "
            "CPU load. 0 = the CPU's speed alone.",
        ),
    ] = 0.0,
    log_level: Annotated[
        str, typer.Option(help=f"uvicorn log level: {', '.join(LOG_LEVELS)}. Prompts and completions are never logged.")
    ] = "info",
    access_log: Annotated[bool, typer.Option(help="uvicorn's access log (method, path, status; never bodies).")] = True,
) -> None:
    """Serve the reference LLM backend: POST /v1/completions, GET /healthz, GET /metrics."""
    from diag.cli import options as opts

    try:
        checked = _checked_serve_options(dict(locals()))
    except opts.OptionError as exc:
        raise _fail(str(exc)) from None
    preload, refresh, batching, log_level, host = (checked[k] for k in ("preload", "refresh", "batching", "log_level", "host"))
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
            metrics_dialect=checked["metrics_dialect"],
            also_metrics_dialects=checked["also_metrics_dialects"],
            kv_cache_tokens=kv_cache_tokens,
            min_step_s=min_step_ms / 1000.0,
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
    "duplicate-models, loader-refresh, moe-skew, request-count-batching, oversized-context, noisy-neighbour, host-oom, "
    "kv-saturation."
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
    dialect: Annotated[
        str | None,
        typer.Option(
            help="Serve an engine's /metrics (vllm, tgi, llamacpp) uninstrumented and record them with the agent's "
            "scrape, or llmdiag (the tracker). Default: the scenario's own (llmdiag, vllm for kv-saturation)."
        ),
    ] = None,
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
    from diag.cli import options as opts

    given = {name: _given(ctx, key) for name, key in _SCENARIO_OPTIONS.items()}
    try:
        if ctx.invoked_subcommand is not None:
            opts.refuse({"--scenario": scenario is not None, "--list": list_, **given}, "before a subcommand")
            return
        if list_:
            opts.refuse({"--scenario": scenario is not None, **given}, "with --list (it only lists the scenarios)")
            _list_scenarios()
            return
        if scenario is None:
            opts.refuse(given, "without --scenario")
            typer.echo(ctx.get_help())
            return
    except opts.OptionError as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(_run_scenario(scenario, as_json, seed, keep_recorder, export, param or [], weights_dir, dialect))


# The scenario options (flag -> parameter): refused where they cannot apply, not ignored.
_SCENARIO_OPTIONS = {
    "--dialect": "dialect",
    "--json": "as_json",
    "--seed": "seed",
    "--keep-recorder": "keep_recorder",
    "--export": "export",
    "--param": "param",
    "--weights-dir": "weights_dir",
}


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the option was typed on the command line (not its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _list_scenarios() -> None:
    from diag.demo.scenarios.library import SCENARIOS

    for s in SCENARIOS.values():
        cg = "needs memory cgroups" if s.needs_cgroups else "cgroup if available"
        typer.echo(f"{s.name}  ->  {s.expected}  ({cg})\n    {s.summary}")
        typer.echo("    params: " + ", ".join(f"{k}={v}" for k, v in s.defaults.items()))


def _parse_params(items: list[str], defaults: dict[str, Any]) -> dict[str, str]:
    """``KEY=VALUE`` overrides, each checked against the scenario's parameter of that name: known, and of its
    type (a number, or a comma-separated list of numbers where the default is one)."""
    from diag.cli import options as opts

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if not sep or not key:
            example = next(iter(defaults.items()), None)
            hint = f"; use e.g. {example[0]}={example[1]}" if example else ""
            raise opts.OptionError(f"--param {item!r}: expected KEY=VALUE{hint}")
        if key not in defaults:
            known = ", ".join(sorted(defaults)) or "none"
            raise opts.OptionError(f"--param {item!r}: this scenario has no parameter {key!r} (known: {known})")
        default = defaults[key]
        if not _same_kind(value, default):
            raise opts.OptionError(f"--param {item!r}: {_kind(default)}; use e.g. {key}={default}")
        out[key] = value
    return out


def _kind(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "a whole number"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, str) and _numbers(default):
        return "numbers separated by commas"
    return "a value"


def _numbers(text: str) -> bool:
    try:
        return all(float(x) == float(x) for x in text.split(","))  # NaN is not a setting
    except ValueError:
        return False


def _same_kind(value: str, default: Any) -> bool:
    """Whether ``value`` converts the way the scenario will convert it (``type(default)(value)``)."""
    if isinstance(default, bool) or default is None:
        return True
    if isinstance(default, (int, float)):
        try:
            type(default)(value)
        except ValueError:
            return False
        return True
    if isinstance(default, str) and _numbers(default):
        return _numbers(value)
    return True


def _run_scenario(
    name: str,
    as_json: bool,
    seed: int,
    keep_recorder: Path | None,
    export: Path | None,
    params: list[str],
    weights_dir: Path | None,
    dialect: str | None = None,
) -> int:
    import json
    import sys

    from diag.cli import options as opts
    from diag.demo.scenarios import EXIT_NO_CGROUPS
    from diag.demo.scenarios.cgroups import CgroupUnavailable
    from diag.demo.scenarios.library import SCENARIOS
    from diag.demo.scenarios.runner import run_scenario

    try:  # everything checked before anything starts; --param last
        name = opts.choice("--scenario", name, tuple(SCENARIOS))
        for option, path, example in (("--keep-recorder", keep_recorder, "recorder.db"),
                                      ("--export", export, f"{name}.jsonl.gz")):  # fmt: skip
            if path is not None:
                opts.writable_file_path(option, path, example)
        if weights_dir is not None:
            opts.folder_path("--weights-dir", weights_dir)
        if dialect is not None:
            from diag.demo.dialects import DIALECTS

            dialect = opts.choice("--dialect", dialect, DIALECTS)
            SCENARIOS[name].check_dialect(dialect)
        overrides = _parse_params(params, SCENARIOS[name].defaults)
        SCENARIOS[name].params(overrides)
    except ValueError as exc:  # OptionError, or a parameter the scenario refuses
        typer.secho(f"diag: {exc}", err=True, fg=typer.colors.RED)
        return 2
    try:
        result = run_scenario(
            name,
            seed=seed,
            params=overrides,
            weights_dir=weights_dir,
            keep_recorder=keep_recorder,
            fixture=export,
            dialect=dialect,
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
        from diag.views.analysis import render_analysis

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
    """``python -m diag.cli.demo serve ...`` without the top-level ``diag`` CLI."""
    app = typer.Typer(add_completion=False, no_args_is_help=True)
    app.command("serve")(serve)

    @app.callback()
    def _group() -> None:
        """The reference LLM backend."""

    app()


if __name__ == "__main__":
    main()
