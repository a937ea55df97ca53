"""What a Ray instance this run starts prints, routed to the job's event hook instead of the terminal.

``preprocess run -q`` must print nothing and ``--log-format json`` must make every stderr line JSON, but
``ray.init`` prints on its own (the "Token authentication is enabled" warning on every run, C++ log lines).
``RayOutput`` hands each such line to ``on_line`` (the CLI's display drops it under ``-q``, the JSON log
wraps it as ``{"event": "ray", "line": ...}``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["RayOutput"]


class RayOutput:
    """Routes what a Ray instance this run starts prints, to ``on_line`` (the job's event hook: the
    progress display drops it under ``-q``, the JSON log wraps it as ``{"event": "ray", "line": ...}``).

    Two channels: Python logging of the ``ray`` logger (the "Token authentication is enabled" warning), and
    raw writes to fd 2 by Ray's C++ core in this process and by the processes ``ray.init`` starts (they
    inherit fd 2). fd 2 points into a pipe while Ray starts and stops; a reader thread delivers its lines
    as they come, except while fd 2 is redirected (its own writes would loop back): those wait in a
    buffer until fd 2 is restored.
    """

    def __init__(self, on_line: Callable[[str], None]) -> None:
        self.on_line = on_line
        self.lock = threading.Lock()
        self.redirected = False
        self.pending: list[str] = []
        self.closed = False  # after the session: the run's log may be closed, late lines are dropped
        self.pipe_w: int | None = None
        self.handler = _LineHandler(self.deliver)
        self.saved_handlers: list[logging.Handler] = []
        self.saved_propagate = True

    def deliver(self, line: str) -> None:
        if not line.strip():
            return
        with self.lock:
            if self.closed:
                return
            if self.redirected:
                self.pending.append(line)
                return
            self.on_line(line)

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as stream:
            for raw in stream:
                self.deliver(raw.decode("utf-8", "replace").rstrip("\n"))

    @contextmanager
    def fd2(self) -> Iterator[None]:
        if self.pipe_w is None:
            read_end, self.pipe_w = os.pipe()
            threading.Thread(target=self._read, args=(read_end,), name="ray-output", daemon=True).start()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            saved = os.dup(2)
        except OSError:  # no fd 2 at all (a daemon): nothing to route
            yield
            return
        with self.lock:
            os.dup2(self.pipe_w, 2)
            self.redirected = True
        try:
            yield
        finally:
            sys.stderr.flush()
            with self.lock:
                os.dup2(saved, 2)
                os.close(saved)
                self.redirected = False
                pending, self.pending = self.pending, []
            for line in pending:
                self.deliver(line)

    def take_python_logging(self) -> None:
        """From now on the ``ray`` logger's records go to ``on_line`` (``ray.init`` set up its own)."""
        ray_logger = logging.getLogger("ray")
        self.saved_handlers, self.saved_propagate = list(ray_logger.handlers), ray_logger.propagate
        for handler in self.saved_handlers:
            ray_logger.removeHandler(handler)
        ray_logger.addHandler(self.handler)
        ray_logger.propagate = False

    def release(self) -> None:
        with self.lock:
            self.closed = True
        ray_logger = logging.getLogger("ray")
        ray_logger.removeHandler(self.handler)
        for handler in self.saved_handlers:
            ray_logger.addHandler(handler)
        ray_logger.propagate = self.saved_propagate
        if self.pipe_w is not None:
            os.close(self.pipe_w)  # the reader sees EOF once the processes Ray started have exited too
            self.pipe_w = None


class _LineHandler(logging.Handler):
    def __init__(self, deliver: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self.deliver = deliver
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s -- %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.deliver(self.format(record))
