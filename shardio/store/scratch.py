"""This process's local scratch folder: staged shards before their upload (object storage).

``($SHARDIO_SCRATCH or the temp dir)/shardio-scratch-UID/PID-RANDOM``:

- **One parent per user**, created ``0700`` and refused if another user owns it: on a machine several
  people share, one user's folder must never block another's run (a ``0755`` parent made by the first
  user did), nor put their staged pixels in reach.
- **One folder per process, locked while it lives**: its ``.owner`` file is held with ``flock`` until the
  process exits. A SIGKILLed worker cannot remove its own folder, so the first call in a process removes
  the folders whose lock it can take, and only those: a PID alone would not do (a process of another
  container sharing the temp dir has a PID that looks dead here), and a lock dies with its process
  whatever killed it. On a filesystem without ``flock`` (some NFS mounts) folders still work, and none
  is ever swept: nothing can prove its process gone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile

__all__ = ["OWNER_FILE", "scratch_dir"]

OWNER_FILE = ".owner"

_SCRATCH: tuple[int, str, int] | None = None  # (pid, folder, fd holding its lock)


def scratch_dir() -> str:
    """This process's scratch folder (made, and its parent swept of dead processes' folders, on first use)."""
    global _SCRATCH
    if _SCRATCH is not None and _SCRATCH[0] == os.getpid() and os.path.isdir(_SCRATCH[1]):
        return _SCRATCH[1]
    parent = _user_parent()
    _remove_unowned(parent)
    # Made under a dot name the sweep skips, locked, then renamed: no sweep can see it unlocked.
    making = tempfile.mkdtemp(prefix=f".new-{os.getpid()}-", dir=parent)
    fd = os.open(os.path.join(making, OWNER_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until this process exits; a forked child gets its own folder
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise
        # A filesystem without flock (some NFS mounts): the folder works, but no sweep can ever prove
        # its process gone, so it is never removed by another; it is left, not risked.
    path = os.path.join(parent, os.path.basename(making).removeprefix(".new-"))
    os.rename(making, path)
    _SCRATCH = (os.getpid(), path, fd)
    return path


def _user_parent() -> str:
    base = os.environ.get("SHARDIO_SCRATCH") or tempfile.gettempdir()
    parent = os.path.join(base, f"shardio-scratch-{os.getuid()}")
    os.makedirs(parent, mode=0o700, exist_ok=True)
    owner = os.stat(parent).st_uid
    if owner != os.getuid():
        raise PermissionError(errno.EACCES, f"{parent}: scratch folder owned by uid {owner}, not by this "
                              f"user (uid {os.getuid()}); remove it or set SHARDIO_SCRATCH")
    return parent


def _remove_unowned(parent: str) -> None:
    """Remove the folders of processes that are gone: those whose ``.owner`` lock can be taken. A folder
    without one (not ours) or with a dot name (being made) is left alone."""
    for name in os.listdir(parent):
        if name.startswith("."):
            continue
        folder = os.path.join(parent, name)
        try:
            fd = os.open(os.path.join(folder, OWNER_FILE), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # held: its process runs
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
