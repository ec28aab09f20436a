"""The one user-error printer of every command: `zaec-calibrate` (and `tables`), `zaec-extract`, `zaec-sweep`.

A user error ends in one line on stderr (`prog: error: ...`) and exit code 2, never a traceback. The command
modules import this one; neither imports the other for it. It lives on the CPU side (no torch, no `extract`) so
that `extract` may import it while `calibrate` never imports `extract`.
"""

from __future__ import annotations

import sys
from typing import Any, List, NoReturn, Optional

import typer
from rich.console import Console

from schemas.shard import ShardError, error_line

#: what a user can cause (bad shards, bad specs or options, unreadable paths): one line and exit 2, no traceback
USER_ERRORS = (ShardError, ValueError, OSError)


def fail(prog: str, e: BaseException, err: Optional[Console] = None, *, full: bool = False) -> NoReturn:
    """Print `prog: error: <first line of e>` on stderr and exit with status 2.

    Args:
        prog: the command's name, as the user typed it.
        e: the user error.
        err: the stderr console to print on (default: a new one).
        full: print the whole message: for messages whose further lines are part of the answer (the extractor's
            expected folder layouts of a missing dataset), still one error, never a traceback.
    """
    text = (str(e).strip() or type(e).__name__) if full else error_line(e)
    err = err if err is not None else Console(stderr=True, emoji=False)
    err.print(f"{prog}: error: {text}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def plain_flags(command: Any) -> Any:
    """Drop the `<bool>` typer's help shows after flags that take no value (`--force`, `--resume/--no-resume`,
    `--help`), in `command` and its sub-commands; returns `command`."""
    for param in getattr(command, "params", ()):
        if getattr(param, "is_flag", False):
            param.metavar = " "  # typer prints a non-empty metavar as is; a blank one shows nothing
    get_help_option = command.get_help_option

    def help_option(ctx: Any) -> Any:
        opt = get_help_option(ctx)
        if opt is not None:
            opt.metavar = " "
        return opt

    command.get_help_option = help_option
    for sub in getattr(command, "commands", {}).values():
        plain_flags(sub)
    return command


def run_app(app: typer.Typer, args: List[str], prog: str) -> NoReturn:
    """Run a typer app on `args` and exit; typer's usage errors (unknown option, bad value) end in one line too."""
    # typer >= 0.2x vendors click, so find click's exception classes by name on typer's own hierarchy
    click_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    usage_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
    command = plain_flags(typer.main.get_command(app))
    try:
        code = command.main(args=args, prog_name=prog, standalone_mode=False)
    except click_error as e:
        hint = f" (see {prog} --help)" if isinstance(e, usage_error) else ""
        print(f"{prog}: error: {e.format_message()}{hint}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        print(f"{prog}: aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
