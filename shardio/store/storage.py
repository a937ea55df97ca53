"""All file access of shardio and preprocess goes through here: a small storage interface with two
backends, the local filesystem (``LocalStorage``, below) and S3-compatible object storage
(``shardio.store.s3.S3Storage``, for ``s3://`` URLs, imported only when one is used).

Everything else calls these functions with path strings (each dispatches on the path: ``for_path``);
the dataset-directory protocol (``shardio.write.directory``) uses only the ``Storage`` interface below, so
object storage is a second backend, not a change to the protocol. A URL scheme no backend serves is
refused (``UnsupportedPath``); a URL is never turned into a local path.

What the protocol needs from storage, and how ``LocalStorage`` provides each:

- **Atomic publish of one object** (``publish``): a reader sees the old object or the whole new one.
  Local: temp file beside it, fsync, ``rename``, fsync the directory. (S3: a PUT is atomic per object.)
  With ``if_version`` (the version ``read_versioned`` returned) it replaces only that version, else
  ``CommitConflict``: the manifest of a run is published over the one it started from, never over a
  newer one (S3: ``If-Match: ETAG``; local: the flock already excludes a second writer).
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
import json
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, ContextManager, Protocol

from shardio.errors import OutputLocked, OutputUnusable, ShardioError, UnsupportedPath

__all__ = [
    "FileInfo",
    "Storage",
    "LocalStorage",
    "for_path",
    "is_remote",
    "check_local",
    "normalize",
    "join",
    "open_read",
    "read_bytes",
    "file_size",
    "stat_fingerprint",
    "info",
    "exists",
    "is_file",
    "remove",
    "list_dir",
    "list_files",
    "makedirs",
    "create_temp",
    "atomic_writer",
    "write_atomic",
    "sync_dir",
    "is_disk_full",
    "promote",
    "publish_new",
    "lock",
    "writer_holding",
    "pid_alive",
    "TEMP_PREFIX",
    "LOCK_NAME",
]

# Files being written carry this prefix until their atomic rename; a run that finds any left over
# (from a killed run) deletes them before it starts.
TEMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"

# Schemes with a backend; any other "scheme://" is refused by name.
_REMOTE_SCHEMES = ("s3://",)
# Stores obstore serves that shardio does not use yet (issue 22 item 7: no emulator with conditional
# writes was tested here), refused with why.
_NOT_YET = {"gs": "Google Cloud Storage", "gcs": "Google Cloud Storage", "az": "Azure Blob Storage",
            "azure": "Azure Blob Storage", "abfs": "Azure Blob Storage", "abfss": "Azure Blob Storage"}


@dataclass(frozen=True)
class FileInfo:
    """One file or object: ``version`` is the ETag on object storage, "" locally (where size and mtime
    recognise a file)."""

    path: str
    size: int
    mtime_ns: int
    version: str = ""


def is_remote(path: str) -> bool:
    """Whether ``path`` is an object-storage URL (``s3://...``)."""
    return path.startswith(_REMOTE_SCHEMES)


def check_local(path: str) -> str:
    """``path`` as a local path (``file://`` stripped); ``UnsupportedPath`` for any URL: the caller needs
    a real file here (a memory map, an fd)."""
    if "://" in path and not path.startswith("file://"):
        scheme = path.split("://", 1)[0]
        if is_remote(path):
            raise UnsupportedPath(f"{path}: this needs a local path, not an {scheme}:// URL")
        if scheme in _NOT_YET:
            raise UnsupportedPath(
                f"{path}: {_NOT_YET[scheme]} URLs are not supported yet: obstore speaks {_NOT_YET[scheme]}, but the "
                "dataset commit depends on conditional writes (create-if-absent, replace-if-unchanged) and a "
                "lease whose behaviour is so far tested only on S3-compatible servers; copy the data to an "
                "s3:// bucket (AWS, MinIO, R2, SeaweedFS) or to local disk")
        raise UnsupportedPath(
            f"{path}: {scheme}:// paths are not supported (only local paths and s3:// URLs); copy the data "
            "locally or mount it"
        )
    return path[len("file://") :] if path.startswith("file://") else path


def normalize(path: str) -> str:
    """A dataset or input path as the backends take it: a URL unchanged, a local path without
    ``file://``; ``UnsupportedPath`` for a scheme no backend serves."""
    if is_remote(path):
        stripped = path.rstrip("/")  # "s3://b/ds/" and "s3://b/ds" are one dataset
        return stripped if "://" in stripped and stripped.split("://", 1)[1] else path
    return check_local(path)


class Storage(Protocol):
    """What ``shardio.write.directory``, the reader and the job need from a backend (guarantees: module
    docstring)."""

    is_local: bool

    def join(self, *parts: str) -> str: ...
    def info(self, path: str) -> FileInfo: ...
    def open_read(self, path: str) -> BinaryIO: ...
    def read_bytes(self, path: str) -> bytes: ...
    def read_versioned(self, path: str) -> tuple[bytes, str]: ...
    def read_range(self, path: str, start: int, length: int) -> bytes: ...
    def download(self, path: str, local_path: str, algorithm: str) -> str: ...  # checksum of what it wrote
    def exists(self, path: str) -> bool: ...
    def is_file(self, path: str) -> bool: ...
    def is_dir(self, path: str) -> bool: ...
    def file_size(self, path: str) -> int: ...
    def stat_fingerprint(self, path: str) -> tuple[int, int]: ...
    def list_dir(self, path: str) -> list[str]: ...
    def list_files(self, folder: str, recursive: bool = False) -> list[FileInfo]: ...
    def makedirs(self, path: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def upload(self, local_path: str, path: str) -> str: ...
    def create_temp(self, final_path: str) -> tuple[int, str]: ...
    def promote(self, staged_path: str, final_path: str) -> None: ...
    def publish(self, path: str, data: bytes, if_version: str | None = None) -> str: ...
    def publish_new(self, path: str, data: bytes) -> str: ...
    def barrier(self, path: str) -> None: ...
    def checksum(self, path: str, algorithm: str) -> str: ...  # shardio.format.checksum's algorithms
    def lock(self, directory: str, wait: bool = False) -> ContextManager[Any]: ...


# --- local files ----------------------------------------------------------------------------------------

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


def sync_dir(path: str) -> None:
    """fsync a directory, so the renames into it survive a power cut (a SIGKILL needs no fsync: the page
    cache outlives the process; a preempted VM's disk does not)."""
    fd = os.open(check_local(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _local_create_temp(final_path: str) -> tuple[int, str]:
    directory, name = os.path.split(final_path)
    while True:
        tmp = os.path.join(directory or ".", f"{TEMP_PREFIX}{name}.{secrets.token_hex(4)}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), _FILE_MODE), tmp
        except FileExistsError:
            continue  # 1 in 4 billion per existing temp file: draw another name


@contextmanager
def atomic_writer(path: str) -> Iterator[BinaryIO]:
    """Write local ``path`` so that readers see either the old file or the whole new one, never a part.

    Temp file in the same directory, fsync, rename, fsync the directory: a crash at any instant leaves
    at most a ``.tmp-*`` file, which the next run removes.
    """
    path = check_local(path)
    directory = os.path.dirname(path) or "."
    fd, tmp = _local_create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        sync_dir(directory)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise


def write_atomic(path: str, data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically (any backend)."""
    for_path(path).publish(path, data)


class _LocalLockHandle:
    def check(self) -> None:
        """The flock cannot be lost while the process lives."""


class LocalStorage:
    """``Storage`` on a local (or mounted) filesystem."""

    is_local = True

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def info(self, path: str) -> FileInfo:
        st = os.stat(check_local(path))
        return FileInfo(path, st.st_size, st.st_mtime_ns)

    def open_read(self, path: str) -> BinaryIO:
        return open(check_local(path), "rb")

    def read_bytes(self, path: str) -> bytes:
        with open(check_local(path), "rb") as f:
            return f.read()

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        with open(check_local(path), "rb") as f:
            st = os.fstat(f.fileno())
            return f.read(), f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with open(check_local(path), "rb") as f:
            return os.pread(f.fileno(), length, start)

    def download(self, path: str, local_path: str, algorithm: str) -> str:
        """Copy ``path`` to ``local_path``; returns the ``algorithm`` checksum (``shardio.format.checksum``) of the
        bytes copied."""
        from shardio.format.checksum import new_hasher

        digest = new_hasher(algorithm)
        with open(check_local(path), "rb") as src, open(local_path, "wb") as out:
            while chunk := src.read(8 << 20):
                out.write(chunk)
                digest.update(chunk)
        return digest.hexdigest()

    def exists(self, path: str) -> bool:
        return os.path.exists(check_local(path))

    def is_file(self, path: str) -> bool:
        return os.path.isfile(check_local(path))

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(check_local(path))

    def file_size(self, path: str) -> int:
        return os.stat(check_local(path)).st_size

    def stat_fingerprint(self, path: str) -> tuple[int, int]:
        """(size, mtime in ns): how an input is recognised between runs without reading it."""
        st = os.stat(check_local(path))
        return st.st_size, st.st_mtime_ns

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(check_local(path)))
        except FileNotFoundError:
            return []

    def list_files(self, folder: str, recursive: bool = False) -> list[FileInfo]:
        root = check_local(folder)
        found = []
        if recursive:
            for base, dirs, files in os.walk(root):
                dirs.sort()
                for name in files:
                    found.append(self.info(os.path.join(base, name)))
        else:
            for name in self.list_dir(root):
                full = os.path.join(root, name)
                if os.path.isfile(full):
                    found.append(self.info(full))
        return sorted(found, key=lambda f: f.path)

    def makedirs(self, path: str) -> None:
        os.makedirs(check_local(path), exist_ok=True)

    def remove(self, path: str) -> None:
        try:
            os.remove(check_local(path))
        except FileNotFoundError:
            pass

    def upload(self, local_path: str, path: str) -> str:
        import shutil

        with atomic_writer(path) as out, open(local_path, "rb") as f:
            shutil.copyfileobj(f, out, 16 << 20)
        return ""

    def create_temp(self, final_path: str) -> tuple[int, str]:
        """Create a new, empty temp file beside ``final_path`` (``.tmp-NAME.RANDOM``, mode 0o666 less
        the umask); returns (writable fd, temp path)."""
        return _local_create_temp(check_local(final_path))

    def promote(self, staged_path: str, final_path: str) -> None:
        """Move a staged (fsynced) temp file to its final name in the same folder, replacing what is there."""
        os.replace(check_local(staged_path), check_local(final_path))

    def publish(self, path: str, data: bytes, if_version: str | None = None) -> str:
        """Atomic replace (``if_version`` is not checked here: the flock excludes a second writer)."""
        with atomic_writer(path) as f:
            f.write(data)
        return ""

    def publish_new(self, path: str, data: bytes) -> str:
        """Publish ``data`` at ``path`` only if nothing is there (``FileExistsError`` otherwise),
        atomically: the fsynced temp file is hard-linked to the name, which fails if the name exists. On
        a filesystem without hard links (some FUSE / SMB mounts: EPERM, ENOTSUP) it is a check, then a
        rename: not atomic against a second writer, which the directory's lock already excludes."""
        path = check_local(path)
        fd, tmp = _local_create_temp(path)
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
            sync_dir(os.path.dirname(path) or ".")
        finally:
            self.remove(tmp)
        return ""

    def barrier(self, path: str) -> None:
        sync_dir(path)

    def checksum(self, path: str, algorithm: str) -> str:
        from shardio.format.checksum import file_checksum

        return file_checksum(path, algorithm)

    def lock(self, directory: str, wait: bool = False) -> ContextManager[Any]:
        return lock(directory, wait)


@contextmanager
def lock(directory: str, wait: bool = False, poll_s: float = 0.5) -> Iterator[_LocalLockHandle]:
    """Hold the one-writer lock of local ``directory`` (``flock`` on ``DIR/.lock``; the kernel drops it
    at any exit, SIGKILL included); ``OutputLocked`` naming the holder if another live process has it
    (or wait for it), ``OutputUnusable`` if the directory is not ours to write."""
    path = os.path.join(check_local(directory), LOCK_NAME)
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
        yield _LocalLockHandle()
    finally:
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID runs on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def writer_holding(directory: str) -> str:
    """Who holds the one-writer lock of ``directory`` ("pid 123 on host"), "" if nobody does, as far as
    a reader can tell without taking it (a reader must never make a starting run fail to take the lock).

    The lock file's note says who: locally ``pid N on HOST`` while held (emptied at release; a SIGKILLed
    holder leaves it, so a dead pid on this host is nobody), on object storage the lease's JSON (held until
    ``expires``). A holder on another host is taken at its word."""
    try:
        note = read_bytes(join(directory, LOCK_NAME)).decode("utf-8", "replace").strip()
    except (OSError, ValueError, ShardioError):
        return ""  # no lock file (never written), or unreadable: the caller says what else it sees
    if note.startswith("{"):
        try:
            doc = json.loads(note)
            holder, host, pid, expires = doc["holder"], doc.get("host"), doc.get("pid"), float(doc["expires"])
        except (ValueError, KeyError, TypeError):
            return ""
    else:
        pid_text, _, host = note.removeprefix("pid ").partition(" on ")
        if not pid_text.isdigit() or not host:
            return ""
        holder, pid, expires = note, int(pid_text), float("inf")
    if expires < time.time():
        return ""
    if host == os.uname().nodename and isinstance(pid, int) and pid != os.getpid() and not pid_alive(pid):
        return ""
    return str(holder)


_LOCAL = LocalStorage()
_REMOTE: Any = None


def for_path(path: str) -> Storage:
    """The backend serving ``path``: ``S3Storage`` for ``s3://`` (``MissingExtra`` without the ``s3``
    extra), ``LocalStorage`` for a local path, ``UnsupportedPath`` for any other scheme."""
    global _REMOTE
    if is_remote(path):
        if _REMOTE is None:
            from shardio.store.s3 import S3Storage

            _REMOTE = S3Storage()
        return _REMOTE
    check_local(path)
    return _LOCAL


# Module-level shorthands, each dispatching on its path.


def join(*parts: str) -> str:
    return for_path(parts[0]).join(*parts)


def open_read(path: str) -> BinaryIO:
    return for_path(path).open_read(path)


def read_bytes(path: str) -> bytes:
    return for_path(path).read_bytes(path)


def file_size(path: str) -> int:
    return for_path(path).file_size(path)


def stat_fingerprint(path: str) -> tuple[int, int]:
    return for_path(path).stat_fingerprint(path)


def info(path: str) -> FileInfo:
    return for_path(path).info(path)


def exists(path: str) -> bool:
    return for_path(path).exists(path)


def is_file(path: str) -> bool:
    return for_path(path).is_file(path)


def remove(path: str) -> None:
    for_path(path).remove(path)


def list_dir(path: str) -> list[str]:
    return for_path(path).list_dir(path)


def list_files(folder: str, recursive: bool = False) -> list[FileInfo]:
    return for_path(folder).list_files(folder, recursive)


def makedirs(path: str) -> None:
    for_path(path).makedirs(path)


def create_temp(final_path: str) -> tuple[int, str]:
    return for_path(final_path).create_temp(final_path)


def promote(staged_path: str, final_path: str) -> None:
    for_path(final_path).promote(staged_path, final_path)


def publish_new(path: str, data: bytes) -> str:
    return for_path(path).publish_new(path, data)
