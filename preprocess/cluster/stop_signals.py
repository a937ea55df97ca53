"""Ctrl-C and SIGTERM for ``preprocess run``: the first one stops the run cleanly, a second one at once.

First SIGINT / SIGTERM: the handler only records it; the job notices within ``ray_tasks.WAIT_S`` (0.5 s),
submits nothing more, cancels its running tasks, commits every input that finished, writes the report
(``interrupted``, ``inputs_unfinished``), says so, and the CLI exits 128 + the signal's number (130,
143). Recording instead of raising matters: a KeyboardInterrupt raised inside ``ray.init`` or between a
result and its commit is how runs used to exit silently with finished work uncommitted (100 of 600
samples) or segfault in Ray's start-up.

Second signal: exit at once (``os._exit``), nothing more committed. The dataset is still consistent: the
manifest is only ever replaced by an atomic rename, so the directory holds the last commit, and the
next run removes the unlisted files. Ray processes this run started are cleaned up by
``preprocess.cluster.ray_watchdog``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from types import FrameType

from shardio.errors import signal_exit_code

__all__ = ["StopOnSignal", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnSignal:
    """Install with ``installed()``; ``requested()`` is "" until the first signal, then its name."""

    def __init__(self, json_lines: bool = False) -> None:
        self.json_lines = json_lines  # stderr carries the JSON log: the one line written here is JSON too
        self.signal_name = ""
        # A copy of stderr taken at install: fd 2 itself points into a pipe while Ray starts (ray_cluster).
        self.stderr_fd = 2

    def requested(self) -> str:
        return self.signal_name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name:
            self._say(f"second signal ({name}): exiting now; the dataset stays as of its last commit")
            os._exit(signal_exit_code(signum))
        self.signal_name = name
        self._say(f"{name}: stopping: no new inputs; committing the finished ones "
                  "(send it again to exit at once)")

    def _say(self, message: str) -> None:
        # os.write, not print/logging: a signal handler may run in the middle of another write to stderr.
        if self.json_lines:
            stamp = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
            line = json.dumps({"time": stamp, "event": "signal", "message": message})
        else:
            line = f"preprocess: {message}"
        try:
            os.write(self.stderr_fd, (line + "\n").encode("utf-8", "replace"))
        except OSError:
            pass

    @contextmanager
    def installed(self) -> Iterator[StopOnSignal]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread (embedding callers)
            return
        try:
            self.stderr_fd = os.dup(2)
        except OSError:
            self.stderr_fd = 2
        previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self.stderr_fd != 2:
                os.close(self.stderr_fd)
            self.stderr_fd = 2
