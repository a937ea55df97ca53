"""All file access of shardio and preprocess goes through here.

Everything else calls these few functions with path strings, so that object storage (``s3://``) is one
module's change. Today only local paths are supported; a URL scheme is refused with a clear message.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

__all__ = [
    "check_local",
    "join",
    "open_read",
    "create_temp",
    "atomic_writer",
    "write_atomic",
    "file_size",
    "stat_fingerprint",
    "exists",
    "is_file",
    "remove",
    "list_dir",
    "makedirs",
    "sync_dir",
    "is_disk_full",
    "TEMP_PREFIX",
]

# Files being written carry this prefix until their atomic rename; a run that finds any left over
# (from a killed run) deletes them before it starts.
TEMP_PREFIX = ".tmp-"


def check_local(path: str) -> str:
    """Return ``path`` if it is local; refuse URLs until an object-store backend exists."""
    if "://" in path and not path.startswith("file://"):
        scheme = path.split("://", 1)[0]
        raise NotImplementedError(
            f"{path}: {scheme}:// paths are not supported yet; copy the data locally or mount the bucket"
        )
    return path[len("file://") :] if path.startswith("file://") else path


def join(*parts: str) -> str:
    return os.path.join(*parts)


def open_read(path: str) -> BinaryIO:
    return open(check_local(path), "rb")


def file_size(path: str) -> int:
    return os.stat(check_local(path)).st_size


def stat_fingerprint(path: str) -> tuple[int, int]:
    """(size, mtime in ns): how an input is recognised between runs without reading it."""
    st = os.stat(check_local(path))
    return st.st_size, st.st_mtime_ns


def exists(path: str) -> bool:
    return os.path.exists(check_local(path))


def is_file(path: str) -> bool:
    return os.path.isfile(check_local(path))


def remove(path: str) -> None:
    try:
        os.remove(check_local(path))
    except FileNotFoundError:
        pass


def list_dir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(check_local(path)))
    except FileNotFoundError:
        return []


def makedirs(path: str) -> None:
    os.makedirs(check_local(path), exist_ok=True)


def sync_dir(path: str) -> None:
    """fsync a directory, so the renames into it survive a power cut (a SIGKILL needs no fsync: the page
    cache outlives the process; a preempted VM's disk does not)."""
    fd = os.open(check_local(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_fsync_dir = sync_dir

# ENOSPC: the filesystem is full; EDQUOT: the user's quota is. Either way no retry can succeed.
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: BaseException | str) -> bool:
    """Whether an exception (or a worker's error message, which carries the strerror) means "out of space"."""
    if isinstance(error, OSError):
        return error.errno in _DISK_FULL_ERRNOS
    return any(os.strerror(code) in str(error) for code in _DISK_FULL_ERRNOS)


# New files get 0o666 less the umask (0644 under umask 022), as ``open()`` gives: a trainer running as
# another user must read what a job running as ``data`` wrote. (``tempfile.mkstemp`` forces 0600.)
_FILE_MODE = 0o666


def create_temp(final_path: str) -> tuple[int, str]:
    """Create a new, empty temp file beside ``final_path`` (``.tmp-NAME.RANDOM``, mode 0o666 less the
    umask); returns (writable fd, temp path)."""
    final_path = check_local(final_path)
    directory, name = os.path.split(final_path)
    while True:
        tmp = os.path.join(directory or ".", f"{TEMP_PREFIX}{name}.{secrets.token_hex(4)}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), _FILE_MODE), tmp
        except FileExistsError:
            continue  # 1 in 4 billion per existing temp file: draw another name


@contextmanager
def atomic_writer(path: str) -> Iterator[BinaryIO]:
    """Write ``path`` so that readers see either the old file or the whole new one, never a part.

    Temp file in the same directory, fsync, rename, fsync the directory: a crash at any instant leaves
    at most a ``.tmp-*`` file, which the next run removes.
    """
    path = check_local(path)
    directory, name = os.path.split(path)
    directory = directory or "."
    fd, tmp = create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(directory)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise


def write_atomic(path: str, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)
