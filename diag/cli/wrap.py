"""``diag wrap -- COMMAND``: run a Python ASGI server someone else wrote with llm-diag's request tracking applied.

Why a command and not a code change: the servers people run (llama-cpp-python's, a team's FastAPI service)
build their app themselves. ``diag wrap`` puts a start-up hook first on the command's ``PYTHONPATH``
(``collectors/tracking/boot/sitecustomize.py``) and passes the settings in ``$LLMDIAG_WRAP``; the hook
makes the first Starlette app the process serves answer through ``collectors.tracking.wrapped``. Then it
*replaces* itself with the command (exec): the server keeps this process's PID, its signals and its exit
status, exactly as if it had been started alone.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Annotated

import typer

from diag.cli import options as opts
from diag.cli.errors import fail

METRICS_PATH_EXAMPLES = ("/metrics", "/llmdiag/metrics", "off")


def _metrics_path(text: str) -> str | None:
    if text.lower() == "off":
        return None
    if not text.startswith("/") or any(c.isspace() for c in text) or "?" in text:
        raise opts.OptionError(
            f"--metrics-path {text!r}: a path starting with /, or off; use e.g. {opts.listing(METRICS_PATH_EXAMPLES)}"
        )
    return text


def _boot_dir() -> str:
    from collectors.tracking import boot

    return str(Path(boot.__file__).resolve().parent)


def wrap(
    command: Annotated[list[str], typer.Argument(help="The server command and its arguments, after --.", show_default=False)],
    recorder: Annotated[
        Path | None,
        typer.Option(
            "--recorder",
            help="Flight recorder the request rows go to (the agent's, by default: $LLMDIAG_RECORDER "
            "or recorder.db in llm-diag's state folder).",
            show_default=False,
        ),
    ] = None,
    no_recorder: Annotated[bool, typer.Option("--no-recorder", help="Keep no request rows; serve the metrics only.")] = False,
    model: Annotated[str, typer.Option("--model", help="The model label on the metrics and the rows.")] = "wrapped",
    span_sample_ratio: Annotated[
        float, typer.Option("--span-sample-ratio", help="Share of requests traced with OpenTelemetry spans (0 to 1).")
    ] = 0.1,
    metrics_path: Annotated[
        str,
        typer.Option(
            "--metrics-path",
            help="Path on the server's own port that answers with llm-diag's /metrics (no route is added to the app), or off.",
        ),
    ] = "/metrics",
) -> None:
    """Run COMMAND (a Python ASGI server: uvicorn, or `python -m llama_cpp.server`) with request tracking applied.

    Every HTTP request becomes a row (arrival, start of inference, finish, outcome from the status; time to
    first token on streamed responses) in the flight recorder, and the llmdiag_ request metrics are served at
    --metrics-path. The start of inference is known where an engine adapter marks it (llama-cpp-python's
    model lock); elsewhere the rows carry no start and the queue wait is said to be unknown, not guessed.
    No request or response body is read or kept, and responses are passed through unchanged.

    The command replaces this process: same PID, signals and exit status. It must run a Python interpreter
    that can import llm-diag (the same environment); otherwise it stops at start-up, exit status 2, saying so.

    Examples:\n
      diag wrap -- python -m llama_cpp.server --model /models/m.gguf --port 8000\n
      diag wrap --model my-svc -- uvicorn my_service:app --port 8000\n
      curl -s 127.0.0.1:8000/metrics | grep llmdiag_request
    """
    try:
        if not command:
            raise opts.OptionError(
                "give the server command after --, e.g. diag wrap -- python -m llama_cpp.server --model m.gguf"
            )
        if recorder is not None and no_recorder:
            raise opts.OptionError("--recorder cannot be used with --no-recorder")
        opts.number("--span-sample-ratio", span_sample_ratio, low=0.0, high=1.0, meaning="a share of requests",
                    examples=("0", "0.1", "1"))  # fmt: skip
        path = _metrics_path(metrics_path.strip())
        if not model.strip():
            raise opts.OptionError("--model: give a name, e.g. --model llama-3-8b")
        recorder_path: str | None = None
        if not no_recorder:
            from collectors.recorder import default_recorder_path

            target = opts.writable_file_path("--recorder", recorder) if recorder is not None else default_recorder_path()
            recorder_path = str(target.expanduser().resolve())
    except opts.OptionError as exc:
        fail(str(exc))
    executable = shutil.which(command[0])
    if executable is None:
        fail(f"{command[0]!r}: no such command (not a file, not on PATH)")

    from collectors.tracking.wrapped import ENV_CONFIG, WrapConfig

    config = WrapConfig(model=model.strip(), recorder=recorder_path, span_sample_ratio=span_sample_ratio, metrics_path=path)
    env = dict(os.environ)
    env[ENV_CONFIG] = config.to_env()
    env["PYTHONPATH"] = os.pathsep.join([_boot_dir(), *filter(None, [env.get("PYTHONPATH")])])
    try:
        os.execve(executable, command, env)
    except OSError as exc:
        fail(f"cannot run {command[0]!r}: {exc.strerror or exc}")


def register(app: typer.Typer) -> None:
    """Add ``wrap`` to the ``diag`` app."""
    app.command("wrap", context_settings={"allow_interspersed_args": False})(wrap)
