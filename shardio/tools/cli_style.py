"""The one look of both command lines, ``preprocess`` and ``shardio``: typer apps made alike (the same help
layout, ``-h``/``--help``, ``--version``, no shell-completion options, bare command name shows the help)
and errors printed the same way (``error: ...`` on stderr, never wrapped, so a log line stays greppable).

Help reads as the reference pages do: a flag shows no value (typer's ``<bool>`` column invited
``--quiet true``, whose ``true`` then became an INPUT), and the usage line names arguments in capitals
(``INPUTS...``, ``DIRECTORY``; ``[NAME]`` when optional), where typer writes ``{inputs}...``.

Imports typer and rich: only the command lines import this module, never ``import shardio`` (the reader
needs numpy and torch alone; ``tests/project/test_package.py`` checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup
from rich.console import Console
from rich.markup import escape

__all__ = ["new_app", "version_option", "fail", "err_console"]

err_console = Console(stderr=True)


def new_app(help: str) -> typer.Typer:
    """A command line with subcommands in the house style; ``help`` is its one-line description.

    Rich help (typer's default look): a command's first docstring paragraph is one line (the command
    list shows it as written); later paragraphs keep their line breaks, so keep their lines under ~76
    characters to fit an 80-column terminal."""
    return _Typer(
        cls=_Group,
        add_completion=False,
        no_args_is_help=True,
        help=help,
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
    )


def _without_flag_values(params: list[Any]) -> list[Any]:
    """``params`` with every flag's value column empty (a flag takes no value: nothing to show)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


def _usage_pieces(command: Any, ctx: Any) -> list[str]:
    pieces = [command.options_metavar] if command.options_metavar else []
    for param in command.get_params(ctx):
        if isinstance(param, TyperArgument):
            name = (param.metavar or param.name or "").upper() + ("..." if param.nargs != 1 else "")
            pieces.append(name if param.required else f"[{name}]")
        else:
            pieces.extend(param.get_usage_pieces(ctx))
    return pieces


class _Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _without_flag_values(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return _usage_pieces(self, ctx)


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _without_flag_values(super().get_params(ctx))


class _Typer(typer.Typer):
    """Its commands are ``_Command``s (the house help) unless a command asks for another class."""

    def command(self, *args: Any, cls: type[TyperCommand] | None = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or _Command, **kwargs)


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
