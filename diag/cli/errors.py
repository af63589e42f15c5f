"""Usage errors that Typer finds before a command runs, as one line naming the option and the value.

Why: the commands check their own options and fail with one line (``diag: --interval 1d: at most 1h; ...``),
but what Typer itself refuses -- a number that is not a number, a value below an option's ``min``, a choice
not in its list, an unknown option -- came out as a framed box of several lines that named the option but
not the value (``Input should be a valid integer``). Every usage error of ``diag`` now reads the same way:
``diag: --top 'x': not a whole number``, exit status 2, nothing else. ``--help`` and a bare ``diag`` (which
shows the help) are unchanged.

A command's own checks (``diag.cli.options``) end the same way through ``fail``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

# Click's exception classes, whichever Click this Typer uses (a vendored copy in recent releases, the click
# package before): found from the one Typer re-exports, not imported by a private path.
_CLICK_EXCEPTION: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

# Typer validates option values with pydantic; its wording is made to read as the rest of diag's messages.
_REWORDED: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^Value error, "), ""),
    (re.compile(r"^Input should be a valid integer.*$", re.DOTALL), "not a whole number"),
    (re.compile(r"^Input should be a valid number.*$", re.DOTALL), "not a number"),
    (re.compile(r"^Input should be a valid boolean.*$", re.DOTALL), "not true or false"),
    (re.compile(r"^Input should be greater than or equal to (.+)$"), r"at least \1"),
    (re.compile(r"^Input should be less than or equal to (.+)$"), r"at most \1"),
    (re.compile(r"^Input should be greater than (.+)$"), r"more than \1"),
    (re.compile(r"^Input should be less than (.+)$"), r"less than \1"),
)


_NUMBER_RE = re.compile(r"^-?\d+(?:\.\d+)?$")


def _reworded(message: str) -> str:
    for pattern, replacement in _REWORDED:
        message = pattern.sub(replacement, message)
    return " ".join(message.split())


def _option_name(exc: typer.BadParameter) -> str | None:
    """The option as typed on the command line: its long name when it has one."""
    hint = exc.param_hint
    if isinstance(hint, str):
        return hint
    names: Sequence[str] = hint or (exc.param.opts if exc.param is not None else ())
    if not names:
        return None
    return max(names, key=lambda n: (n.startswith("--"), len(n)))


def _bad_value(exc: typer.BadParameter) -> Any:
    """The value that failed, when the validator kept it (pydantic's error carries its input)."""
    cause = exc.__cause__
    errors = getattr(cause, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
        except (IndexError, TypeError):
            return None
        return first.get("input")
    return None


def one_line(exc: Any) -> str:
    """The error in one line: ``--option 'value': what is wrong`` for a bad value, Click's words otherwise."""
    if isinstance(exc, typer.BadParameter) and type(exc).__name__ != "MissingParameter":
        message = _reworded(exc.message)
        option = _option_name(exc)
        if option is None:
            return message
        value = _bad_value(exc)
        if value is None or str(value) in message:
            return f"{option}: {message}"
        shown = repr(value) if isinstance(value, str) and not _NUMBER_RE.match(value) else str(value)
        return f"{option} {shown}: {message}"
    return " ".join(exc.format_message().split())


class OneLineUsageErrors(TyperGroup):
    """The ``diag`` group: Typer's usage errors printed by ``one_line``; everything else as Typer does it.

    Runs the command in Click's non-standalone mode so the error reaches us unprinted; exit statuses are kept
    (``typer.Exit(n)`` -> n, usage errors -> 2, a finished command -> 0)."""

    def invoke(self, ctx: Any) -> None:
        super().invoke(ctx)  # the command's return value is not an exit status (Click ignores it too)

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            typer.echo("diag: aborted", err=True)
            sys.exit(1)
        except _CLICK_EXCEPTION as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # a bare command shows its help, as before
                exc.show()
            else:
                typer.secho(f"diag: {one_line(exc)}", err=True, fg=typer.colors.RED)
            sys.exit(exc.exit_code)
        sys.exit(code if isinstance(code, int) else 0)


def fail(message: str) -> NoReturn:
    """A command's own check refused its input: ``diag: <message>`` on stderr, exit status 2 (the form of every
    usage error)."""
    typer.secho(f"diag: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)
