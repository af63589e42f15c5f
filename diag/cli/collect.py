"""``diag collect``: the host agent (sample, record, serve /metrics), its options all checked before it starts."""

from __future__ import annotations

import logging
import os
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit, urlunsplit

import typer

from collectors.recorder import ENV_RECORDER, default_recorder_path
from collectors.series_cap import DEFAULT_MAX_CGROUPS, DEFAULT_MAX_PROCESSES, SeriesCaps
from collectors.snapshot import SamplerConfig
from diag.cli import options as opts
from diag.cli.errors import fail
from diag.cli.sampling import Cgroups, ModelExt, Pids, ProcRoot, SysRoot, TopN, sampler_config
from diag.live.compaction import start_compaction
from diag.live.diagnosis import MIN_EVERY_S, WINDOW_S, start_live_diagnosis
from diag.units import format_bytes, format_duration, parse_duration

if TYPE_CHECKING:
    from collectors.agent import ListenAddress
    from collectors.discover import AutoTargets
    from collectors.scrape import Scrapers

DEFAULT_LISTEN = "127.0.0.1:9464"

INTERVAL_EXAMPLES = ("500ms", "1s", "5s")
RETENTION_EXAMPLES = ("30m", "2h", "1d")
MAX_SIZE_EXAMPLES = ("64MiB", "256MiB", "1GiB")
LISTEN_EXAMPLES = ("127.0.0.1:9464", "127.0.0.1:0", "off")
SCRAPE_EXAMPLES = ("http://127.0.0.1:8000/metrics", "auto")
SCRAPE_TIMEOUT_EXAMPLES = ("2s", "5s", "10s")
MIN_SCRAPE_INTERVAL_S = 1.0


def scrape_timeout_default(interval_s: float) -> float:
    """The interval, within 2 to 10 s: a busy engine answers /metrics late, but a scrape never waits past 10 s."""
    return min(10.0, max(2.0, interval_s))


def _scrape_targets(values: list[str]) -> tuple[tuple[str, ...], bool]:
    """``--scrape`` values: the URLs (``host:port`` alone is ``http://host:port/metrics``), and whether ``auto`` was
    among them."""
    urls: list[str] = []
    auto = False
    hint = f"; use e.g. {opts.listing(SCRAPE_EXAMPLES)}"
    for value in values:
        text = value.strip()
        if text.lower() == "auto":
            auto = True
            continue
        parts = urlsplit(text if "://" in text else f"http://{text}")  # host:port alone: plain http
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise opts.OptionError(f"--scrape {value!r}: a backend's /metrics URL (http or https) or auto{hint}")
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number or out of range
        except ValueError:
            raise opts.OptionError(f"--scrape {value!r}: the port is not a number from 0 to 65535") from None
        if parts.username is not None or parts.password is not None:
            raise opts.OptionError(
                f"--scrape {parts.scheme}://...@{parts.hostname}: credentials in the URL are not accepted (they would "
                "reach the flight recorder and the agent's /metrics); expose /metrics without them on loopback"
            )
        if parts.path in ("", "/"):
            parts = parts._replace(path="/metrics")
        urls.append(urlunsplit(parts))
    return tuple(dict.fromkeys(urls)), auto


def parse_every(value: str | None) -> float | None:
    """Option callback for ``--diagnose-every``: a duration of at least MIN_EVERY_S (``collect`` refuses it with
    ``--once``, with the other options that cannot apply there)."""
    if value is None:
        return None
    try:
        every = parse_duration(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if every < MIN_EVERY_S:
        raise typer.BadParameter(f"{value}: at least {MIN_EVERY_S:g}s (each run analyses the last {WINDOW_S:g}s)")
    return every


DiagnoseEvery = Annotated[
    str | None,
    typer.Option(
        "--diagnose-every",
        callback=parse_every,
        help="Run the rules on the last 5 min of the recorder this often (e.g. 15s) and export "
        "llmdiag_incident{class} for the LLMDiagIncident alert.",
    ),
]


def _listen_address(text: str, parse: type[ListenAddress]) -> ListenAddress:
    """``--listen``'s HOST:PORT, with the reason and accepted forms in one line when it is not one."""
    try:
        return parse.parse(text)
    except ValueError as exc:
        reason = str(exc).replace(f"listen address {text!r}", "").lstrip(": ").split(", e.g.")[0] or "not HOST:PORT"
        raise opts.OptionError(
            f"--listen {text!r}: {reason}; use e.g. {opts.listing(LISTEN_EXAMPLES)} (port 0: any free port)"
        ) from None


@dataclass(frozen=True)
class _CollectPlan:
    """``diag collect``'s options, all checked: what the agent will do, decided before it does anything."""

    interval_s: float
    once: bool
    address: ListenAddress | None
    recorder: Path
    retention_s: float
    max_size_bytes: int
    retention_text: str
    max_size_text: str
    scrape_urls: tuple[str, ...] = ()
    scrape_auto: bool = False
    scrape_timeout_s: float = 5.0
    caps: SeriesCaps = field(default_factory=SeriesCaps)
    compact_every_s: float | None = 3600.0


def _collect_plan(
    interval: str | None, listen: str | None, once: bool, recorder: Path | None, retention: str | None,
    max_size: str | None, samples: int | None, kmsg: bool | None, diagnose_every: float | None = None,
    scrape: list[str] | None = None, scrape_timeout: str | None = None,
    max_processes: int = DEFAULT_MAX_PROCESSES, max_cgroups: int = DEFAULT_MAX_CGROUPS,
    compact_every: str | None = None,
) -> _CollectPlan:  # fmt: skip
    """Validate every collect option (values first, then combinations); exit 2 naming the accepted forms."""
    from collectors.agent import ListenAddress

    try:
        interval_s = opts.duration("--interval", interval or "1s", low=0.01, high=3600, examples=INTERVAL_EXAMPLES)
        # Suggested retentions keep at least two samples of the interval asked for (checked below).
        kept = [e for e in RETENTION_EXAMPLES if parse_duration(e) >= 2 * interval_s] or [format_duration(2 * interval_s)]
        retention_s = opts.duration("--retention", retention or "2h", low=1, high=400 * 86400, examples=kept)
        max_size_bytes = opts.size("--max-size", max_size or "256MiB", low=64 * 1024, examples=MAX_SIZE_EXAMPLES)
        for name, cap in (("--max-processes", max_processes), ("--max-cgroups", max_cgroups)):
            if cap < 1:
                raise opts.OptionError(f'{name} {cap}: at least 1 (the rest are folded into one "other" series)')
        if samples is not None and samples < 1:
            raise opts.OptionError(f"--samples {samples}: at least 1 (leave it out to run until SIGTERM)")
        if retention_s < 2 * interval_s:
            raise opts.OptionError(f"--retention {retention or '2h'} keeps less than two samples of --interval "
                                   f"{interval or '1s'}; use e.g. {opts.listing(kept)}")  # fmt: skip
        address = None
        if listen is not None and listen.lower() != "off":
            address = _listen_address(listen, ListenAddress)
        elif listen is None and not once:
            address = ListenAddress.parse(DEFAULT_LISTEN)
        path = opts.writable_file_path("--recorder", recorder) if recorder is not None else default_recorder_path()
        scrape_urls, scrape_auto = _scrape_targets(scrape or [])
        timeout_s = scrape_timeout_default(interval_s)
        if scrape_timeout is not None:
            if not scrape:
                raise opts.OptionError("--scrape-timeout cannot be used without --scrape (there is nothing to scrape)")
            timeout_s = opts.duration("--scrape-timeout", scrape_timeout, low=0.1, high=60,
                                      examples=SCRAPE_TIMEOUT_EXAMPLES)  # fmt: skip
        compact_every_s: float | None = None
        if (compact_every or "1h").lower() != "off":
            try:
                compact_every_s = opts.duration("--compact-every", compact_every or "1h", low=1, high=86400,
                                                examples=("30m", "1h", "6h"))  # fmt: skip
            except opts.OptionError as exc:
                raise opts.OptionError(f"{exc}, or off") from None
        if once:
            opts.refuse(
                {"--interval": interval is not None, "--listen": listen is not None, "--recorder": recorder is not None,
                 "--retention": retention is not None,
                 "--max-size": max_size is not None, "--samples": samples is not None, "--kmsg": kmsg is True,
                 "--diagnose-every": diagnose_every is not None, "--scrape": bool(scrape),
                 "--scrape-timeout": scrape_timeout is not None, "--compact-every": compact_every is not None},
                "with --once (it prints one exposition and records nothing)",
            )  # fmt: skip
    except opts.OptionError as exc:
        fail(str(exc))
    return _CollectPlan(interval_s, once, address, path, retention_s, max_size_bytes, retention or "2h",
                        max_size or "256MiB", scrape_urls, scrape_auto, timeout_s,
                        SeriesCaps(max_processes, max_cgroups), compact_every_s)  # fmt: skip


def collect(
    interval: Annotated[str | None, typer.Option(help="Sampling interval, e.g. 1s, 500ms, 5s (10ms to 1h). Default: 1s.")] = None,
    listen: Annotated[
        str | None,
        typer.Option(
            help=f"Serve Prometheus /metrics here (HOST:PORT; port 0: a free one). 'off' disables. Default: {DEFAULT_LISTEN}."
        ),
    ] = None,
    once: Annotated[bool, typer.Option("--once", help="Print one exposition to stdout and exit (records nothing).")] = False,
    recorder: Annotated[
        Path | None,
        typer.Option(
            readable=False, help=f"Flight recorder file (SQLite). Default: ${ENV_RECORDER} or the user state directory."
        ),
    ] = None,
    retention: Annotated[str | None, typer.Option(help="Keep this much history, e.g. 2h, 30m, 1d. Default: 2h.")] = None,
    max_size: Annotated[
        str | None, typer.Option("--max-size", help="Cap on the recorder's size on disk, e.g. 256MiB (at least 64KiB).")
    ] = None,
    samples: Annotated[
        int | None, typer.Option(help="Stop after this many samples, at least 1 (default: run until SIGTERM).")
    ] = None,
    proc_root: ProcRoot = Path("/proc"),
    sys_root: SysRoot = Path("/sys"),
    pid: Pids = None,
    cgroup: Cgroups = None,
    top: TopN = 10,
    model_ext: ModelExt = None,
    kmsg: Annotated[
        bool | None, typer.Option("--kmsg/--no-kmsg", help="Watch /dev/kmsg for kernel OOM kills (root). Default: on.")
    ] = None,
    gpu: Annotated[bool, typer.Option("--gpu/--no-gpu", help="Query NVML.")] = True,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each sample to stderr.")] = False,
    diagnose_every: DiagnoseEvery = None,
    scrape: Annotated[
        list[str] | None,
        typer.Option(
            "--scrape",
            metavar="URL|auto",
            help="Also scrape an inference backend's own /metrics (vLLM, TGI, llama.cpp server, the llm-diag tracker) "
            "every interval (at most once a second) into the recorder; repeat for several. 'auto': the listening "
            "sockets of the processes holding a model file, probed on loopback. Only the families the rules read are "
            "kept; nothing is re-exported.",
        ),
    ] = None,
    scrape_timeout: Annotated[
        str | None,
        typer.Option(
            "--scrape-timeout",
            help="Give up on a scrape after this long (counted as a timeout). Default: the interval, within 2s to 10s.",
        ),
    ] = None,
    max_processes: Annotated[
        int,
        typer.Option(
            "--max-processes",
            help="Processes labelled on /metrics (largest by RSS; the rest summed into "
            'pid="other"). The recorder keeps them all.',
        ),
    ] = DEFAULT_MAX_PROCESSES,
    max_cgroups: Annotated[
        int,
        typer.Option(
            "--max-cgroups", help='Cgroups labelled on /metrics (largest by working set; the rest summed into cgroup="other").'
        ),
    ] = DEFAULT_MAX_CGROUPS,
    compact_every: Annotated[
        str | None,
        typer.Option(
            "--compact-every",
            help="Store the recorder's complete hours decoded beside it (diag compact, as a nice-19 child) this often, "
            "so analysing a long history reads columns, not every JSON row; 'off' never. Default: 1h.",
        ),
    ] = None,
) -> None:
    """Run the host agent: sample every INTERVAL, write the flight recorder, serve /metrics.

    The recorder keeps RETENTION of history within MAX_SIZE (oldest trimmed first) and survives kill -9.
    On a full disk it drops its oldest rows to make room and keeps sampling; a recorder file that is not
    a database (or is deleted or replaced while running) is moved aside as <name>.corrupt-<UTC time> and
    a fresh one started. A --pid or --cgroup that does not exist yet is warned about and looked for again
    every sample. Stop it with SIGTERM or Ctrl-C; the current sample is finished and the recorder closed.

    Exit status: 0 stopped (signal or --samples); 2 an option is invalid or cannot apply (e.g. --retention
    with --once), the address cannot be bound, or no recorder can be created at the path.

    Examples:\n
      diag collect                                   # 1 Hz, http://127.0.0.1:9464/metrics\n
      diag collect --once --proc-root /host/proc     # one exposition, e.g. from a container\n
      diag collect --pid 4242 --retention 6h --max-size 1GiB\n
      diag collect --scrape http://127.0.0.1:8000/metrics   # and vLLM's own queue, KV cache, TTFT ...\n
      diag collect --scrape auto                     # whatever serves the model files on this host
    """
    every_s: float | None = diagnose_every  # type: ignore[assignment]  # the option's callback made it seconds
    plan = _collect_plan(interval, listen, once, recorder, retention, max_size, samples, kmsg, every_s, scrape,
                         scrape_timeout, max_processes, max_cgroups, compact_every)  # fmt: skip
    config = sampler_config(proc_root, sys_root, pid, cgroup, top, model_ext, kmsg=kmsg is not False and not once, gpu=gpu)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    if plan.once:
        _collect_once(config, plan.caps)
    else:
        _run_agent(plan, config, samples, verbose, every_s)


def _collect_once(config: SamplerConfig, caps: SeriesCaps) -> None:
    from collectors.exporter import exposition
    from collectors.snapshot import SnapshotTaker

    taker = SnapshotTaker(config)
    try:
        snap = taker.take()
        sys.stdout.write(exposition(snap, caps).decode())
    finally:
        taker.close()
    if snap.scope is not None:
        for line in snap.scope.missing:
            typer.secho(f"diag collect: not found: {line}", err=True, fg=typer.colors.YELLOW)


def _run_agent(
    plan: _CollectPlan, config: SamplerConfig, samples: int | None, verbose: bool, diagnose_every_s: float | None
) -> None:
    from collectors.agent import Agent
    from collectors.recorder import open_for_writing
    from collectors.snapshot import SnapshotTaker

    try:
        flight, moved_aside = open_for_writing(plan.recorder, plan.retention_s, plan.max_size_bytes)
    except (OSError, ValueError, sqlite3.Error) as exc:
        fail(f"cannot open or create the flight recorder {plan.recorder}: {exc}")
    taker = SnapshotTaker(config)

    def progress(snap: object) -> None:
        if verbose:
            logging.info("sample %d written (%s)", agent.samples, format_bytes(flight.size_bytes()))

    scrapers, discovery = _scraping(plan, config)
    agent = Agent(taker, interval_s=plan.interval_s, recorder=flight, on_sample=progress, scrapers=scrapers,
                  discovery=discovery, caps=plan.caps)  # fmt: skip
    if moved_aside is not None:
        agent.count_reset("corrupt")
        typer.echo(f"diag collect: {plan.recorder} was not a readable database: moved it to {moved_aside} "
                   "(kept) and started a fresh recorder", err=True)  # fmt: skip
    agent.install_signal_handlers()
    start_live_diagnosis(agent, plan.recorder, diagnose_every_s)
    start_compaction(agent, plan.recorder, plan.compact_every_s)
    if plan.address is not None:
        try:
            agent.serve(plan.address)
        except OSError as exc:
            agent.close()
            fail(f"cannot listen on {plan.address.host}:{plan.address.port}: {exc}")
    where = f"http://{plan.address.host}:{agent.bound_port}/metrics" if plan.address else "no /metrics"
    if scrapers is not None:
        named = [*plan.scrape_urls, *(["auto"] if plan.scrape_auto else [])]
        where += f"; scraping {', '.join(named)} (timeout {plan.scrape_timeout_s:g}s)"
    if discovery is not None:
        discovery.start()
    typer.echo(
        f"diag collect: sampling every {plan.interval_s:g}s, recorder {plan.recorder} (keep {plan.retention_text}, "
        f"max {plan.max_size_text}), {where}; pid {os.getpid()}",
        err=True,
    )
    try:
        agent.run(max_samples=samples)
    finally:
        agent.close()
    typer.echo(f"diag collect: stopped after {agent.samples} samples", err=True)


def _scraping(plan: _CollectPlan, config: SamplerConfig) -> tuple[Scrapers | None, AutoTargets | None]:
    """The scrape threads of ``--scrape`` (started now for URLs; by the discovery thread for ``auto``)."""
    if not plan.scrape_urls and not plan.scrape_auto:
        return None, None
    from collectors.discover import AutoTargets
    from collectors.exposition import Limits
    from collectors.scrape import Scrapers

    # At most once a second: rendering /metrics costs the backend too (tens of ms for a large vLLM), whatever the
    # agent's own interval.
    scrapers = Scrapers(max(plan.interval_s, MIN_SCRAPE_INTERVAL_S), Limits(timeout_s=plan.scrape_timeout_s))
    if not plan.scrape_auto:
        scrapers.set_targets(plan.scrape_urls)
        return scrapers, None
    return scrapers, AutoTargets(scrapers, config.proc_root, plan.scrape_urls)


def register(app: typer.Typer) -> None:
    """Add ``collect`` to the ``diag`` app."""
    app.command("collect")(collect)
