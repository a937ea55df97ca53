"""``shardio``: the console script's entry point (the commands are ``shardio.tools.commands``).

A module of its own so that it imports on a reader-only install (numpy and torch, no typer): the
commands need the ``cli`` extra, and without it ``shardio`` prints the one line that says what to install
and exits 2, where a console script whose module failed to import printed two tracebacks first.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from shardio.errors import EXIT_OK, EXIT_USAGE, MissingExtra

try:  # the `cli` extra (typer, rich); a training image installs numpy and torch only
    from shardio.tools.commands import app
except MissingExtra as missing:
    app = None
    _missing: MissingExtra | None = missing
else:
    _missing = None

__all__ = ["app", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardio`` console script; returns (and, as a script, exits with) the code.
    ``argv`` (default: the command line) lets a program or a test run it in-process."""
    if app is None:
        print(f"error: {_missing}", file=sys.stderr)
        return EXIT_USAGE
    try:
        app(args=list(argv) if argv is not None else None, prog_name="shardio")
    except SystemExit as e:  # typer exits with the command's code (2 for a usage error, 0 for --help)
        return e.code if isinstance(e.code, int) else EXIT_OK
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
