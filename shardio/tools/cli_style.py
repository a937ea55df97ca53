"""The one look of both command lines, ``preprocess`` and ``shardio``: typer apps made alike (the same help
layout, ``-h``/``--help``, ``--version``, no shell-completion options, bare command name shows the help)
and errors printed the same way (``error: ...`` on stderr, never wrapped, so a log line stays greppable).

Imports typer and rich: only the command lines import this module, never ``import shardio`` (the reader
needs numpy and torch alone; ``tests/test_package.py`` checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["new_app", "version_option", "fail", "err_console"]

err_console = Console(stderr=True)


def new_app(help: str) -> typer.Typer:
    """A command line with subcommands in the house style; ``help`` is its one-line description.

    Rich help (typer's default look): a command's first docstring paragraph is one line (the command
    list shows it as written); later paragraphs keep their line breaks, so keep their lines under ~76
    characters to fit an 80-column terminal."""
    return typer.Typer(
        add_completion=False,
        no_args_is_help=True,
        help=help,
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
    )


def version_option(describe: Callable[[], str]) -> typer.models.OptionInfo:
    """``--version``: print ``describe()`` and exit 0, before any command runs."""
    def show(value: bool) -> None:
        if value:
            typer.echo(describe())
            raise typer.Exit()

    return typer.Option("--version", callback=show, is_eager=True, help="Show versions and exit.")


def fail(message: object, code: int) -> NoReturn:
    """End the command: ``error: message`` on stderr (text as it is, no markup), exit status ``code``."""
    err_console.print(f"[red]error:[/red] {escape(str(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code) from None
