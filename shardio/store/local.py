"""``Storage`` on a local (or mounted) filesystem, and how it gives each guarantee the directory protocol
needs (``shardio.store.base``): temp file + fsync + ``rename`` + fsync of the folder for an atomic
publish, ``link()`` for a conditional create, ``flock`` on ``DIR/.lock`` for the one writer."""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, ContextManager

from shardio.errors import OutputLocked, OutputUnusable
from shardio.store.checksum import file_checksum, new_hasher
from shardio.store.base import LOCK_NAME, TEMP_PREFIX, FileInfo
from shardio.store.paths import check_local

__all__ = ["LocalStorage", "atomic_writer", "sync_dir", "lock", "is_disk_full"]


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


class _LocalLockHandle:
    taken_over = False  # a flock is never taken from a live holder: the kernel drops it at its exit

    def check(self) -> None:
        """The flock cannot be lost while the process lives."""


class LocalStorage:
    """``Storage`` on a local (or mounted) filesystem."""

    is_local = True
    stages_in_place = True

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

    def read_tagged(self, path: str) -> tuple[bytes, str]:
        """The file's bytes and its ``FileInfo.version`` ("" locally: size and mtime recognise a file)."""
        return self.read_bytes(path), ""

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with open(check_local(path), "rb") as f:
            return os.pread(f.fileno(), length, start)

    def download(self, path: str, local_path: str, algorithm: str) -> str:
        """Copy ``path`` to ``local_path``; returns the ``algorithm`` checksum (``shardio.store.checksum``) of the
        bytes copied."""
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

    def iter_dir(self, path: str) -> Iterator[str]:
        """The names of the files in ``path`` (no folders), in directory order, read as they come
        (``os.scandir``): a folder of millions is never one list. Nothing for a missing folder."""
        try:
            listing = os.scandir(check_local(path))
        except FileNotFoundError:
            return
        with listing:
            for entry in listing:
                if not entry.is_dir():
                    yield entry.name

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
        return file_checksum(check_local(path), algorithm)

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
