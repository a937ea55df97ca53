"""A node-local copy of a remote dataset's index segments, shared by every process on the node: ranks and
DataLoader workers opening one object-store dataset fetch each segment once per node, and a reopen (a
restart, the next generation) fetches only the segments it does not hold.

A segment is immutable and named by its SHA-256 (``index/SHA256.npz``, ``shardio.format.spec``), so the
copy is content addressed and shared across datasets and generations. Layout, under the shard cache's
directory (``$SHARDIO_CACHE_DIR``, else ``~/.cache/shardio``, or the reader's ``cache_dir``)::

    index/SHA256.npz          a checked copy (its size and SHA-256 are the root's)
    index/.tmp-SHA256.RANDOM  a download in progress (or killed: removed by the next fetch of it); never read
    index/.SHA256.lock        the segment's lock file (empty; never removed)

A process that lacks a segment takes ``flock(LOCK_EX)`` on its lock file, looks again (another process may
have fetched it meanwhile), else downloads into a temp name, hashing as it streams, and renames it into
place only when size and SHA-256 match the root. A copy is re-hashed at every open (``map_segment``; ~0.2 s
for a 300 MB index): one that does not match its name (corrupted on disk, or forged) is removed and fetched
again, never used. A cache directory this process cannot write (another user's, a read-only mount or
container layer, a full disk) falls back to reading the segment whole, with one warning per directory and
process; copies already there are still used. A directory where a copy belongs, or a file where the
``index/`` folder belongs, is a ``ShardError`` naming it: the cache removes only its own files. The copies
are not counted in the shard cache's ``cache_limit`` (an index is ~130 bytes a shard: 300 MB for
LAION-2B-en's 2.3M shards) and are not evicted; delete ``index/`` to reclaim them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from shardio.errors import ShardError, ShardIntegrityError
from shardio.store.checksum import SHA256
from shardio.format.segment_columns import SegmentColumns, check_segment, map_segment, segment_from_bytes
from shardio.store.base import Storage

__all__ = ["SEGMENTS_DIR", "cached_segment"]

SEGMENTS_DIR = "index"


# What a directory this process cannot write answers: another user's (EACCES, EPERM), a read-only mount or
# container layer (EROFS), a full disk or quota (ENOSPC, EDQUOT). Reading the segment whole serves them all.
_CANNOT_WRITE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT})
_warned: set[str] = set()  # cache folders already warned about, in this process


def _warn_once(folder: str, error: OSError) -> None:
    if folder in _warned:
        return
    _warned.add(folder)
    reason = os.strerror(error.errno) if error.errno is not None else str(error)
    warnings.warn(f"{folder}: the index segment cache cannot be written here ({reason}): each open reads "
                  "the index segments whole from the store; set cache_dir (or SHARDIO_CACHE_DIR) to a "
                  "writable directory to keep them", stacklevel=2)


def _checked_copy(path: str, expected_bytes: int, sha256: str) -> SegmentColumns | None:
    """The copy at ``path`` mapped, if it is there and right; a wrong one is removed."""
    try:
        return map_segment(path, expected_bytes, sha256)
    except FileNotFoundError:
        return None
    except ShardIntegrityError:
        try:
            os.remove(path)  # corrupt or forged: never used; fetched again below
        except FileNotFoundError:
            pass
        return None


@contextmanager
def _locked(folder: str, sha256: str) -> Iterator[None]:
    fd = os.open(os.path.join(folder, f".{sha256}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def cached_segment(store: Storage, url: str, expected_bytes: int, sha256: str, cache_root: str) -> SegmentColumns:
    """Segment ``url`` (``expected_bytes``, named ``sha256``) from the node's copy under ``cache_root``,
    fetched into it first if no process on this node has."""
    folder = os.path.join(cache_root, SEGMENTS_DIR)
    final = os.path.join(folder, f"{sha256}.npz")
    try:
        os.makedirs(folder, exist_ok=True)
        found = _checked_copy(final, expected_bytes, sha256)
        if found is not None:
            return found
        with _locked(folder, sha256):
            found = _checked_copy(final, expected_bytes, sha256)  # fetched by another process meanwhile
            if found is not None:
                return found
            for name in os.listdir(folder):  # a killed download's leftover: no one else downloads it now
                if name.startswith(f".tmp-{sha256}."):
                    os.remove(os.path.join(folder, name))
            temp = os.path.join(folder, f".tmp-{sha256}.{secrets.token_hex(4)}")
            try:
                digest = store.download(url, temp, SHA256)
                check_segment(url, os.path.getsize(temp), digest, expected_bytes, sha256)
                os.replace(temp, final)
            finally:
                try:
                    os.remove(temp)
                except FileNotFoundError:
                    pass
    except IsADirectoryError as e:
        raise ShardError(f"{e.filename}: a directory where the segment cache keeps a file (a copy of {url}, "
                         "or its lock); remove it, or set cache_dir (or SHARDIO_CACHE_DIR) to another "
                         "directory") from e
    except (FileExistsError, NotADirectoryError) as e:  # makedirs: a file stands where a folder belongs
        raise ShardError(f"{folder}: not a directory, where the segment cache keeps its copies of the "
                         "index; remove what is there, or set cache_dir (or SHARDIO_CACHE_DIR) to another "
                         "directory") from e
    except OSError as e:
        if e.errno not in _CANNOT_WRITE:
            raise
        _warn_once(folder, e)
        return segment_from_bytes(store.read_bytes(url), url, expected_bytes, sha256)
    mapped = _checked_copy(final, expected_bytes, sha256)
    if mapped is None:
        raise ShardIntegrityError(f"{url}: the copy fetched into {final} vanished or changed before it was "
                                  "opened (another process writing the cache directory?)")
    return mapped
