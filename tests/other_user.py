"""Running a piece of a test as another user (``nobody``): a forked child switches user, runs ``work``
and sends its JSON answer back through a pipe. Needs root; a fork, not a new interpreter, so the
modules the work needs must already be imported (the interpreter's own files may be private to root)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest

NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


def as_nobody(work: Callable[[], Any]) -> Any:
    """``work()``'s answer (JSON-able), computed as ``nobody``; ``{"error": ...}`` if it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            answer = work()
        except Exception as exc:  # noqa: BLE001 - the answer, whatever it is, goes to the parent
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(answer).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        return json.loads(f.read().decode())
