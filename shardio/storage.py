"""All file access of shardio and preprocess goes through here: a small storage interface, local today.

Everything else calls these functions with path strings; the dataset-directory protocol
(``shardio.directory``) asks for a backend with ``for_path(directory)`` and uses only the ``Storage``
interface below, so object storage (``s3://``) is one new class here, not a change to the protocol. A
URL scheme no backend serves is refused (``UnsupportedPath``).

What the protocol needs from storage, and how ``LocalStorage`` provides each:

- **Atomic publish of one object** (``publish``): a reader sees the old object or the whole new one.
  Local: temp file beside it, fsync, ``rename``, fsync the directory. (S3: a PUT is atomic per object.)
- **Conditional create** (``publish_new``): publish only if nothing is there yet, else
  ``FileExistsError``; a generation file is created once, so two writers can never both commit
  generation N. Local: ``link()`` of the fsynced temp file, which fails if the name exists. (S3:
  ``If-None-Match: *`` put-if-absent, as Delta Lake commits its log entries.)
- **Staging under unique names, then promote** (``create_temp`` + ``promote``): a worker writes a shard
  under a ``.tmp-`` name no other writer can pick, and only the promoted name is ever listed. Local:
  ``O_EXCL`` create, ``rename``. (S3: a unique key, then a copy or a multipart upload completed at
  its final key.)
- **Ordering** (``barrier``): objects promoted before it are durable before anything published after
  it, so a manifest never names a missing shard. Local: fsync of the directory. (S3: no-op: a
  completed PUT is durable and strongly consistent.)
- **Listing** (``list_dir``) of one folder's names, sorted; ``stat``-like ``file_size`` /
  ``stat_fingerprint``; ``remove`` (a missing object is not an error).
- **An exclusive writer** (``lock``): one writer per dataset directory, released if the holder dies.
  Local: ``flock`` on ``DIR/.lock`` (the kernel drops it at any exit, SIGKILL included; per host: on a
  filesystem shared by several hosts, schedule runs from one host). (S3: a lease object created with
  put-if-absent, holding an expiry the holder renews, taken over once expired.)
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO, ContextManager, Protocol

from shardio.errors import OutputLocked, OutputUnusable, UnsupportedPath

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
    "promote",
    "publish_new",
    "lock",
    "Storage",
    "LocalStorage",
    "for_path",
    "TEMP_PREFIX",
    "LOCK_NAME",
]

# Files being written carry this prefix until their atomic rename; a run that finds any left over
# (from a killed run) deletes them before it starts.
TEMP_PREFIX = ".tmp-"


def check_local(path: str) -> str:
    """Return ``path`` if it is local; refuse URLs until an object-store backend exists."""
    if "://" in path and not path.startswith("file://"):
        scheme = path.split("://", 1)[0]
        raise UnsupportedPath(
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


def promote(staged_path: str, final_path: str) -> None:
    """Move a staged (fsynced) temp file to its final name in the same folder, replacing what is there."""
    os.replace(check_local(staged_path), check_local(final_path))


def publish_new(path: str, data: bytes) -> None:
    """Publish ``data`` at ``path`` only if nothing is there (``FileExistsError`` otherwise), atomically:
    the fsynced temp file is hard-linked to the name, which fails if the name exists. On a filesystem
    without hard links (some FUSE / SMB mounts: EPERM, ENOTSUP) it is a check, then a rename: not atomic
    against a second writer, which the directory's lock already excludes."""
    path = check_local(path)
    fd, tmp = create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path) from None
            os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path) or ".")
    finally:
        remove(tmp)


LOCK_NAME = ".lock"


@contextmanager
def lock(directory: str, wait: bool = False, poll_s: float = 0.5) -> Iterator[None]:
    """Hold the one-writer lock of ``directory`` (``flock`` on ``DIR/.lock``); ``OutputLocked`` naming
    the holder if another live process has it (or wait for it), ``OutputUnusable`` if the directory is
    not ours to write."""
    path = join(check_local(directory), LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:  # EACCES, EROFS, ...: the directory is not ours to write
        raise OutputUnusable(f"{directory}: --output is not writable by this user ({e.strerror} creating "
                             f"{path}); run as the dataset's owner, or fix its permissions") from e
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if not wait:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputLocked(
                    f"{path}: another run is writing this output ({holder}); "
                    "it will be picked up by the next run, or pass --wait to queue behind it"
                ) from None
            time.sleep(poll_s)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
    except OSError:
        pass  # the holder note is for the message only (a full disk must not stop the run here)
    try:
        yield
    finally:
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class Storage(Protocol):
    """What ``shardio.directory`` needs from a backend (the guarantees are in the module docstring)."""

    def join(self, *parts: str) -> str: ...
    def open_read(self, path: str) -> BinaryIO: ...
    def exists(self, path: str) -> bool: ...
    def is_dir(self, path: str) -> bool: ...
    def file_size(self, path: str) -> int: ...
    def stat_fingerprint(self, path: str) -> tuple[int, int]: ...
    def list_dir(self, path: str) -> list[str]: ...
    def makedirs(self, path: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def create_temp(self, final_path: str) -> tuple[int, str]: ...
    def promote(self, staged_path: str, final_path: str) -> None: ...
    def publish(self, path: str, data: bytes) -> None: ...
    def publish_new(self, path: str, data: bytes) -> None: ...
    def barrier(self, path: str) -> None: ...
    def lock(self, directory: str, wait: bool = False) -> ContextManager[None]: ...


class LocalStorage:
    """``Storage`` on a local (or mounted) filesystem: this module's functions, looked up at each call."""

    def join(self, *parts: str) -> str:
        return join(*parts)

    def open_read(self, path: str) -> BinaryIO:
        return open_read(path)

    def exists(self, path: str) -> bool:
        return exists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(check_local(path))

    def file_size(self, path: str) -> int:
        return file_size(path)

    def stat_fingerprint(self, path: str) -> tuple[int, int]:
        return stat_fingerprint(path)

    def list_dir(self, path: str) -> list[str]:
        return list_dir(path)

    def makedirs(self, path: str) -> None:
        makedirs(path)

    def remove(self, path: str) -> None:
        remove(path)

    def create_temp(self, final_path: str) -> tuple[int, str]:
        return create_temp(final_path)

    def promote(self, staged_path: str, final_path: str) -> None:
        promote(staged_path, final_path)

    def publish(self, path: str, data: bytes) -> None:
        write_atomic(path, data)

    def publish_new(self, path: str, data: bytes) -> None:
        publish_new(path, data)

    def barrier(self, path: str) -> None:
        sync_dir(path)

    def lock(self, directory: str, wait: bool = False) -> ContextManager[None]:
        return lock(directory, wait)


_LOCAL = LocalStorage()


def for_path(path: str) -> Storage:
    """The backend serving ``path`` (``UnsupportedPath`` for a URL scheme none serves)."""
    check_local(path)
    return _LOCAL
