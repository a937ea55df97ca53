"""A folder that behaves as if on a read-only file system (a read-only mount or container layer): every
write under it fails with ``EROFS``, as the kernel answers, while reads (and ``flock`` on a descriptor
opened for reading) work. The tests run as root, which a ``chmod`` does not stop, and a read-only bind
mount needs privileges a test machine may lack: so the ``os`` calls that write are patched, for paths
under the folder only."""

from __future__ import annotations

import builtins
import errno
import os

import pytest

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND


def make_read_only(monkeypatch: pytest.MonkeyPatch, root: str) -> None:
    """Writes under ``root`` (creating, opening for writing, renaming, removing) raise ``EROFS``."""
    root = os.path.realpath(root)

    def under(path) -> bool:
        path = os.path.realpath(os.fspath(path))
        return path == root or path.startswith(root + os.sep)

    def refuse(path) -> OSError:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    real_open, real_mkdir, real_builtin_open = os.open, os.mkdir, builtins.open

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if under(path) and (flags & _WRITES or (flags & os.O_CREAT and not os.path.exists(path))):
            raise refuse(path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def mkdir(path, mode=0o777, *, dir_fd=None):
        if under(path):
            if os.path.exists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(path))
            raise refuse(path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    def open_file(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and under(file) and set(mode) & set("wax+"):
            raise refuse(file)
        return real_builtin_open(file, mode, *args, **kwargs)

    def refused_if_under(real):
        def call(*paths, **kwargs):
            if any(under(p) for p in paths[:2] if isinstance(p, (str, bytes, os.PathLike))):
                raise refuse(paths[0])
            return real(*paths, **kwargs)
        return call

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(builtins, "open", open_file)
    for name in ("remove", "unlink", "replace", "rename", "rmdir"):
        monkeypatch.setattr(os, name, refused_if_under(getattr(os, name)))
