"""One run per output directory at a time (a cron overlap must not interleave two runs' commits).

An ``flock`` on ``DIR/.lock``: the kernel drops it when the holder dies, even by SIGKILL, so a dead run
never leaves the dataset stuck. (flock is per host: on a shared filesystem seen by several hosts,
schedule the job from one host.)
"""

from __future__ import annotations

import fcntl
import os
import time

from shardio import storage
from shardio.errors import ShardioError

__all__ = ["OutputLocked", "OutputUnusable", "OutputLock", "ensure_output_dir"]

LOCK_NAME = ".lock"


class OutputLocked(ShardioError):
    """Another live run holds the output directory."""


class OutputUnusable(ShardioError):
    """``--output`` is a file, or a directory this user cannot create or write: a usage error (exit 2)."""


def ensure_output_dir(directory: str) -> None:
    """Create the output directory if needed; ``OutputUnusable`` (not a traceback) if it cannot be used."""
    if storage.exists(directory) and not os.path.isdir(directory):
        raise OutputUnusable(f"{directory}: --output is an existing file, not a directory; give a dataset "
                             "directory (created if missing)")
    try:
        storage.makedirs(directory)
    except OSError as e:
        raise OutputUnusable(f"{directory}: --output cannot be created ({e.strerror}); check the path and "
                             "that this user may write its parent") from e


class OutputLock:
    def __init__(self, directory: str, wait: bool = False, poll_s: float = 0.5) -> None:
        self.path = storage.join(directory, LOCK_NAME)
        self.wait = wait
        self.poll_s = poll_s
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # EACCES, EROFS, ...: the directory is not ours to write
            directory = os.path.dirname(self.path)
            raise OutputUnusable(f"{directory}: --output is not writable by this user ({e.strerror} creating "
                                 f"{self.path}); run as the dataset's owner, or fix its permissions") from e
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not self.wait:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise OutputLocked(
                        f"{self.path}: another run is writing this output ({holder}); "
                        "it will be picked up by the next run, or pass --wait to queue behind it"
                    ) from None
                time.sleep(self.poll_s)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        except OSError:
            pass  # the holder note is for the message only (a full disk must not stop the run here)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
