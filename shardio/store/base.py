"""The storage interface every file access of shardio and preprocess goes through: ``Storage``, with the
local filesystem (``shardio.store.local.LocalStorage``) and object storage (``shardio.store.object_store``:
S3, Google Cloud Storage, Azure Blob) as backends, chosen by URL scheme once, where a dataset or an input is opened
(``shardio.store.backends.for_path``); the caller then holds its ``Storage`` and asks it (``is_local``)
instead of looking at the path again. The dataset-directory protocol (``shardio.write.directory``) uses
only this interface, so object storage is a second backend, not a change to the protocol.

What the protocol needs from storage, and how the local backend provides each:

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
- **Listing** (``list_dir``) of one folder's names, sorted, or (``iter_dir``) its files' names as the
  backend gives them, unordered, so a folder of millions is never one list; ``stat``-like ``file_size`` /
  ``stat_fingerprint``; ``remove`` (a missing object is not an error).
- **An exclusive writer** (``lock``): one writer per dataset directory, released if the holder dies.
  Local: ``flock`` on ``DIR/.lock`` (the kernel drops it at any exit, SIGKILL included; per host: on a
  filesystem shared by several hosts, schedule runs from one host). (S3: a lease object created with
  put-if-absent, holding an expiry the holder renews, taken over once expired.)
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, BinaryIO, ContextManager, Protocol

__all__ = ["FileInfo", "Storage", "TEMP_PREFIX", "LOCK_NAME"]

# Files being written carry this prefix until their atomic rename; a run that finds any left over
# (from a killed run) deletes them before it starts.
TEMP_PREFIX = ".tmp-"
# The one-writer lock's file (a flock locally, a lease object on object storage).
LOCK_NAME = ".lock"


@dataclass(frozen=True)
class FileInfo:
    """One file or object: ``version`` is the ETag on object storage, "" locally (where size and mtime
    recognise a file)."""

    path: str
    size: int
    mtime_ns: int
    version: str = ""



class Storage(Protocol):
    """What ``shardio.write.directory``, the reader and the job need from a backend (guarantees: module
    docstring). ``is_local``: its paths are files on this host (a memory map, an fd work on them).
    ``stages_in_place``: a staged file becomes the dataset's file by a rename, so its bytes must be on disk
    before a commit lists it; otherwise it is a scratch copy, and ``promote``'s upload is what makes it durable."""

    is_local: bool
    stages_in_place: bool

    def join(self, *parts: str) -> str: ...
    def info(self, path: str) -> FileInfo: ...
    def open_read(self, path: str) -> BinaryIO: ...
    def read_bytes(self, path: str) -> bytes: ...
    def read_versioned(self, path: str) -> tuple[bytes, str]: ...
    def read_range(self, path: str, start: int, length: int) -> bytes: ...
    def read_tagged(self, path: str) -> tuple[bytes, str]: ...  # bytes + FileInfo.version, one GET
    def download(self, path: str, local_path: str, algorithm: str) -> str: ...  # checksum of what it wrote
    def exists(self, path: str) -> bool: ...
    def is_file(self, path: str) -> bool: ...
    def is_dir(self, path: str) -> bool: ...
    def file_size(self, path: str) -> int: ...
    def stat_fingerprint(self, path: str) -> tuple[int, int]: ...
    def list_dir(self, path: str) -> list[str]: ...
    def iter_dir(self, path: str) -> Iterator[str]: ...  # files only, unordered, a page at a time
    def list_files(self, folder: str, recursive: bool = False) -> list[FileInfo]: ...
    def makedirs(self, path: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def upload(self, local_path: str, path: str) -> str: ...
    def create_temp(self, final_path: str) -> tuple[int, str]: ...
    def promote(self, staged_path: str, final_path: str) -> None: ...
    def publish(self, path: str, data: bytes, if_version: str | None = None) -> str: ...
    def publish_new(self, path: str, data: bytes) -> str: ...
    def barrier(self, path: str) -> None: ...
    def checksum(self, path: str, algorithm: str) -> str: ...  # shardio.store.checksum's algorithms
    def lock(self, directory: str, wait: bool = False) -> ContextManager[Any]: ...
