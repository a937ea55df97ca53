"""What every object-store backend shares (``ObjectStorage``): the ``Storage`` interface on a bucket or
container, through obstore, whichever cloud is behind it. A backend (``shardio.store.s3``, ``.gcs``,
``.azure``) says only how a store is made for one bucket from that cloud's own configuration, how its
conditional replace names a version, and what its settings and credentials are called (for the error hints
and for the tasks of a cluster run); the requests, the retries, the error explanation
(``shardio.store.s3_errors``), the lease and the commit's probe are the same code for all of them.

How the directory protocol's guarantees map onto object storage (``shardio.store.base`` lists them):

- publish: one PUT (atomic per object); ``if_version`` makes it conditional on the version read
  (S3 and Azure: ``If-Match: ETAG``; GCS: ``x-goog-if-generation-match: GENERATION``).
- publish_new: put-if-absent (S3 and Azure: ``If-None-Match: *``; GCS: ``x-goog-if-generation-match: 0``).
  A retried create whose first attempt landed reads back the same bytes and counts as done.
- staging + promote: a shard is written to local scratch (``create_temp``), then uploaded at its final
  key (in parts above 16 MB): an object is visible whole or not at all. An upload that completed but was
  never committed is an unlisted object, which the next run holding the lease removes.
- barrier: nothing (a completed PUT is durable and strongly consistent on S3, GCS and Azure Blob).
- lock: a lease object (``shardio.store.lease``).

Before a run writes, ``check_conditional_writes`` proves on the store itself that a second create of one
object is refused: a server that ignores the precondition, or does not take the upload at all (an emulator
without the cloud's upload API), is refused with ``UnsupportedStore`` before anything is written.

Transient failures (connection reset, 5xx, throttling) are retried by obstore with exponential backoff
(up to ~60 s in all, so a server restart is ridden out); a refused credential or a missing bucket is not
retried and becomes ``StorageAccessError`` (exit 2) within one request.

A download (``download``, the reader's cache's one way in) fetches the object in pieces at once, each
written at its offset and hashed in order as it comes, every GET holding bytes from one budget per process:
``shardio.store.piece_download`` says how and how long a fault can last.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, BinaryIO, ContextManager

from shardio.errors import (CommitConflict, MissingExtra, StorageAccessError, UnsupportedStore)
from shardio.store import piece_download
from shardio.store.checksum import new_hasher
from shardio.store.reader_file import ReaderFile
from shardio.store.base import LOCK_NAME, FileInfo
from shardio.store.lease import lease
from shardio.store.s3_errors import StoreSettings, explain, parse, refused_access
from shardio.store.scratch import scratch_dir

__all__ = ["CLIENT_OPTIONS", "ObjectStorage", "client_options", "obstore_module", "retry_config", "split_url"]

# Above this a shard is uploaded in parts, 4 at a time (S3 wants parts of 5 MB or more).
_PART_BYTES = 16 << 20
_DOWNLOAD_CHUNK = 8 << 20
_LIST_PAGE = 1000  # objects per LIST page (the most S3 gives; GCS and Azure take it)

MAX_RETRIES = 50


def retry_config() -> dict[str, Any]:
    """obstore's retries, the same on every cloud: up to ~60 s in all, so a server restart is ridden out
    (a new dict each time: a caller may change its copy). The count is not what bounds them: obstore's
    backoff is jittered (each wait drawn from [init, previous x base)), so 8 retries of a refused connection
    give up after 3-5 s; 50 retries wait at least 50 x 200 ms = 10 s, and the timeout ends them."""
    return {
        "max_retries": MAX_RETRIES,
        "retry_timeout": timedelta(seconds=60),
        "backoff": {"init_backoff": timedelta(milliseconds=200), "max_backoff": timedelta(seconds=8), "base": 2},
    }


CLIENT_OPTIONS: dict[str, Any] = {"connect_timeout": "5s", "timeout": "300s"}


def client_options(endpoint: str | None) -> dict[str, Any]:
    """obstore's client options for a store at ``endpoint`` (None: the cloud's own): plain HTTP allowed only
    for an ``http://`` endpoint (a loopback emulator, a server on a private network). A new dict each time."""
    options = dict(CLIENT_OPTIONS)
    if endpoint and endpoint.startswith("http://"):
        options["allow_http"] = True
    return options


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``); the same for ``gs://`` and ``az://CONTAINER/...``."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageAccessError(f"{url}: no bucket name in the URL (expected {scheme}://BUCKET/PATH)")
    return bucket, key.strip("/")


def obstore_module(scheme: str) -> Any:
    """obstore, imported when the first object-store path is opened (``MissingExtra`` without it)."""
    try:
        import obstore
    except ImportError as e:
        raise MissingExtra(
            f"{scheme}:// paths need the object-storage extra, which is not installed: pip install "
            "'shardio[s3]' (it adds obstore, which speaks S3, Google Cloud Storage and Azure Blob)") from e
    return obstore


class ObjectStorage:
    """``Storage`` on one cloud's object storage; one instance serves every bucket of its scheme (a store is
    made per bucket, on first use). Subclasses give ``_new_store`` and ``settings`` (and may change how a
    version is named: ``_version``, ``_replace_mode``)."""

    is_local = False
    stages_in_place = False  # a shard is staged in local scratch and uploaded by promote
    scheme = ""  # "s3", "gs", "az"
    # What this cloud's settings and credentials are called in the environment (``carried_settings``:
    # non-secret ones, given to a cluster's tasks; ``driver_credentials``: only with --pass-credentials).
    CARRIED_VARIABLES: tuple[str, ...] = ()
    CREDENTIAL_VARIABLES: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._ob = obstore_module(self.scheme)
        self._stores: dict[str, Any] = {}
        self._checked_buckets: set[str] = set()
        self._lock = threading.Lock()

    # --- what a cloud says ----------------------------------------------------------------------------

    def _new_store(self, bucket: str) -> Any:
        """obstore's store for ``bucket``, from this cloud's configuration (``StorageAccessError`` when
        this machine has no credentials at all)."""
        raise NotImplementedError

    def where(self) -> str:
        """The endpoint requests go to, in words (for messages)."""
        endpoint = self.settings().endpoint
        return endpoint or self.settings().name

    def settings(self) -> StoreSettings:
        """How this process configured the store, for error hints (``shardio.store.s3_errors``)."""
        raise NotImplementedError

    def _version(self, meta: dict[str, Any]) -> str:
        """The version a conditional replace names (``read_versioned``): the ETag."""
        return _etag(meta)

    def _replace_mode(self, version: str) -> Any:
        """obstore's put mode replacing only ``version`` (``If-Match: ETAG``)."""
        return {"e_tag": version}

    def carried_settings(self) -> dict[str, str]:
        """This process's non-secret settings of this cloud as environment variables: what a Ray task on
        another node is given so that it reaches the same store (``preprocess.cluster.cluster_access``)."""
        return {name: os.environ[name] for name in self.CARRIED_VARIABLES if os.environ.get(name)}

    def driver_credentials(self) -> dict[str, str]:
        """This process's credentials as environment variables. Only for ``--pass-credentials``."""
        return {name: os.environ[name] for name in self.CREDENTIAL_VARIABLES if os.environ.get(name)}

    # --- plumbing -------------------------------------------------------------------------------------

    def credential_sources(self) -> list[str]:
        """The credentials this process configures for this cloud, named for messages: variables (a file's
        with its path, a secret's without its value) and files."""
        return [name for name in self.CREDENTIAL_VARIABLES if os.environ.get(name)]

    def _store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                try:
                    store = self._new_store(bucket)
                except self._ob.exceptions.BaseError as e:
                    raise self._unusable_credentials(bucket, e) from None
                self._stores[bucket] = store
            return store

    def _unusable_credentials(self, bucket: str, error: BaseException) -> StorageAccessError:
        """obstore refused to make a store from this machine's configuration (a key it cannot decode, a
        setting it cannot parse): no request was made, so it is the configuration, named with obstore's
        reason. The backends check what they can first and say it in their own words."""
        settings = self.settings()
        reason = parse(error).first_line
        if reason.startswith("Generic ") and " error: " in reason:  # "Generic GCS error: ..." says nothing
            reason = reason.split(" error: ", 1)[1]
        sources = self.credential_sources()
        named = f" ({', '.join(sources)})" if sources else ""
        return StorageAccessError(
            f"{self.scheme}://{bucket}: {settings.name} cannot use the credentials configured on this machine"
            f"{named}: {reason}; HINT: check {settings.credentials}")

    def _target(self, url: str) -> tuple[Any, str]:
        bucket, key = split_url(url)
        return self._store(bucket), key

    @contextmanager
    def _errors(self, url: str, doing: str) -> Iterator[None]:
        """obstore's exceptions as ours, naming the URL, the endpoint, the cause and the likely fix
        (``shardio.store.s3_errors``): a missing object stays FileNotFoundError."""
        ex = self._ob.exceptions
        try:
            yield
        except FileNotFoundError:
            self._check_bucket(url)
            raise
        except (ex.AlreadyExistsError, ex.PreconditionError):
            raise
        except ex.BaseError as e:
            raise explain(url, doing, e, self.settings(), split_url(url)[0]) from None

    def _check_bucket(self, url: str) -> None:
        """A HEAD on a missing bucket is a bare 404, like a missing key: one LIST per bucket and process
        tells the two apart, so "no such bucket" is never reported as "no such file"."""
        bucket = split_url(url)[0]
        if bucket in self._checked_buckets:
            return
        store = self._store(bucket)
        with self._errors(url, "listing the bucket"):
            try:
                self._ob.list_with_delimiter(store, "shardio-bucket-check/")
            except FileNotFoundError as e:
                settings = self.settings()
                create = settings.create_bucket.replace("BUCKET", bucket).replace("ENDPOINT", self.where())
                raise StorageAccessError(
                    f"{url}: bucket {bucket!r} does not exist at {self.where()}; HINT: create it first "
                    f"(shardio never creates buckets), e.g. `{create}`") from e
        self._checked_buckets.add(bucket)

    # --- paths ----------------------------------------------------------------------------------------

    def join(self, *parts: str) -> str:
        head, *rest = parts
        out = head.rstrip("/")
        for part in rest:
            part = part.strip("/")
            if part:
                out = f"{out}/{part}"
        return out

    # --- reading --------------------------------------------------------------------------------------

    def info(self, path: str) -> Any:
        store, key = self._target(path)
        if not key:  # the bucket itself: a "directory", never an object
            self._check_bucket(path)
            raise FileNotFoundError(2, "a bucket is not an object", path)
        with self._errors(path, "HEAD"):
            meta = self._ob.head(store, key)
        return _file_info(FileInfo, path, meta)

    def exists(self, path: str) -> bool:
        try:
            self.info(path)
            return True
        except FileNotFoundError:
            return self.is_dir(path)

    def is_file(self, path: str) -> bool:
        try:
            self.info(path)
            return True
        except FileNotFoundError:
            return False

    def is_dir(self, path: str) -> bool:
        """A "directory" is a prefix that has objects under it."""
        store, key = self._target(path)
        with self._errors(path, "LIST"):
            for chunk in self._ob.list(store, prefix=f"{key}/" if key else None, chunk_size=1):
                return bool(chunk)
        return False

    def file_size(self, path: str) -> int:
        return self.info(path).size

    def stat_fingerprint(self, path: str) -> tuple[int, int]:
        found = self.info(path)
        return found.size, found.mtime_ns

    def list_files(self, folder: str, recursive: bool = False) -> list[Any]:
        """Every object under ``folder/`` (one LIST request per 1,000), as FileInfo with full URLs."""
        store, key = self._target(folder)
        prefix = f"{key}/" if key else ""
        base = folder.rstrip("/")
        root = base[: len(base) - len(key)].rstrip("/") if key else base
        found = []
        with self._errors(folder, "LIST"):
            if recursive:
                for chunk in self._ob.list(store, prefix=prefix or None, chunk_size=1000):
                    found += [_file_info(FileInfo, f"{root}/{meta['path']}", meta) for meta in chunk]
            else:
                listed = self._ob.list_with_delimiter(store, prefix or None)
                found = [_file_info(FileInfo, f"{root}/{meta['path']}", meta) for meta in listed["objects"]]
        return sorted(found, key=lambda info: info.path)

    def list_dir(self, path: str) -> list[str]:
        store, key = self._target(path)
        prefix = f"{key}/" if key else ""
        with self._errors(path, "LIST"):
            listed = self._ob.list_with_delimiter(store, prefix or None)
        names = [meta["path"][len(prefix):] for meta in listed["objects"]]
        names += [common[len(prefix):].rstrip("/") for common in listed["common_prefixes"]]
        return sorted(name for name in names if name)

    def iter_dir(self, path: str) -> Iterator[str]:
        """The names of the objects directly under ``path/`` (no "folders"), a LIST page (1,000) at a
        time, in key order: a folder of millions is never one list. Nothing for a missing prefix."""
        store, key = self._target(path)
        prefix = f"{key}/" if key else ""
        with self._errors(path, "LIST"):
            pages = iter(self._ob.list(store, prefix=prefix or None, chunk_size=1000))
        while True:
            with self._errors(path, "LIST"):
                page = next(pages, None)
            if page is None:
                return
            for meta in page:
                name = meta["path"][len(prefix):]
                if name and "/" not in name:
                    yield name

    def iter_file_pages(self, folder: str) -> Iterator[list[Any]]:
        """The objects directly under ``folder/`` as FileInfo (full URLs, sizes, versions), one LIST page
        (1,000) at a time, in key order: what a check of millions of files streams instead of holding."""
        store, key = self._target(folder)
        prefix = f"{key}/" if key else ""
        base = folder.rstrip("/")
        root = base[: len(base) - len(key)].rstrip("/") if key else base
        with self._errors(folder, "LIST"):
            pages = iter(self._ob.list(store, prefix=prefix or None, chunk_size=_LIST_PAGE))
        while True:
            with self._errors(folder, "LIST"):
                page = next(pages, None)
            if page is None:
                return
            yield [_file_info(FileInfo, f"{root}/{meta['path']}", meta) for meta in page
                   if "/" not in meta["path"][len(prefix):]]

    def read_bytes(self, path: str) -> bytes:
        return self.read_versioned(path)[0]

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        """The object's bytes and its ETag (for a later ``publish(..., if_version=ETAG)``)."""
        store, key = self._target(path)
        with self._errors(path, "GET"):
            result = self._ob.get(store, key)
            data = bytes(result.bytes())
        return data, self._version(result.meta)

    def read_tagged(self, path: str) -> tuple[bytes, str]:
        """The object's bytes and its ETag as a listing gives it (``FileInfo.version``), from one GET: a
        reader holding a listing tells an object replaced since then without a HEAD. (``read_versioned``
        gives the version a conditional replace names instead: on GCS the generation, not the ETag.)"""
        store, key = self._target(path)
        with self._errors(path, "GET"):
            result = self._ob.get(store, key)
            data = bytes(result.bytes())
        return data, _etag(result.meta)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        store, key = self._target(path)
        with self._errors(path, "ranged GET"):
            return bytes(self._ob.get_range(store, key, start=start, length=length))

    def open_read(self, path: str) -> BinaryIO:
        """A seekable reader doing ranged GETs (8 MB buffered)."""
        store, key = self._target(path)
        with self._errors(path, "GET"):
            reader = self._ob.open_reader(store, key, buffer_size=_DOWNLOAD_CHUNK)
        return ReaderFile(reader, path)  # type: ignore[return-value]

    def download(self, path: str, local_path: str, algorithm: str, attempts: int = 3) -> str:
        """The whole object into ``local_path``, in pieces fetched at once and written at their offsets
        (``shardio.store.piece_download``); returns the ``algorithm`` checksum (``shardio.store.checksum``)
        of the bytes written, hashed in order as they come. A piece cut mid-way is fetched again, up to
        ``attempts`` times. On any failure the file is left empty."""
        store, key = self._target(path)

        def get_range(start: int, length: int) -> tuple[Any, int]:
            with self._errors(path, "GET"):
                try:
                    result = self._ob.get(store, key, options={"range": (start, start + length)})
                except self._ob.exceptions.BaseError as e:
                    if start or parse(e).status != 416:
                        raise
                    result = self._ob.get(store, key)  # an empty object has no range to ask for
                return result.bytes(), int(result.meta["size"])

        return piece_download.download(get_range, path, local_path, algorithm, attempts)

    def checksum(self, path: str, algorithm: str) -> str:
        """The ``algorithm`` checksum of the object, streamed (no local copy)."""
        store, key = self._target(path)
        digest = new_hasher(algorithm)
        with self._errors(path, "GET"):
            for chunk in self._ob.get(store, key).stream(min_chunk_size=_DOWNLOAD_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    # --- writing --------------------------------------------------------------------------------------

    def makedirs(self, path: str) -> None:
        """Nothing to make: a prefix exists once an object is under it."""

    def remove(self, path: str) -> None:
        store, key = self._target(path)
        with self._errors(path, "DELETE"):
            try:
                self._ob.delete(store, key)
            except FileNotFoundError:
                pass

    def upload(self, local_path: str, path: str) -> str:
        """Upload a local file at ``path`` (multipart above 16 MB); returns the ETag. The file is mapped and its
        pages handed to obstore as they are: read through a file object, a multipart upload took twice the CPU
        (a 39 MB shard: 55 against 28 ms on the bench's S3 server). A file that cannot be mapped (an empty one, a
        filesystem without maps) is read through."""
        store, key = self._target(path)
        with self._errors(path, "PUT"), open(local_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            try:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
            except OSError:
                mapped = None
            if mapped is None:
                return self._version(self._put(store, key, f.read() if size <= _PART_BYTES else f, size))
            view = memoryview(mapped)
            try:
                result = self._put(store, key, view, size)
            finally:
                try:
                    view.release()
                    mapped.close()
                except BufferError:  # obstore still holds part of it (a failed request): unmapped once let go
                    pass
        return self._version(result)

    def _put(self, store: Any, key: str, data: Any, size: int) -> Any:
        if size <= _PART_BYTES:
            return self._ob.put(store, key, data, use_multipart=False)
        return self._ob.put(store, key, data, use_multipart=True, chunk_size=_PART_BYTES, max_concurrency=4)

    def create_temp(self, final_path: str) -> tuple[int, str]:
        """Staging is a file in this process's local scratch (``shardio.store.scratch``), uploaded at its final
        key by ``promote``: the pixels never pass through the driver."""
        name = final_path.rsplit("/", 1)[-1]
        fd, local = tempfile.mkstemp(prefix=f".tmp-{name}.", dir=scratch_dir())
        return fd, local

    def promote(self, staged_path: str, final_path: str) -> None:
        try:
            self.upload(staged_path, final_path)
        finally:
            try:
                os.remove(staged_path)
            except FileNotFoundError:
                pass

    def publish(self, path: str, data: bytes, if_version: str | None = None) -> str:
        """PUT ``data`` (atomic per object); with ``if_version``, only over the object with that ETag
        (``CommitConflict`` if another writer replaced it). Returns the new ETag."""
        store, key = self._target(path)
        mode: Any = self._replace_mode(if_version) if if_version else "overwrite"
        with self._errors(path, "PUT"):
            try:
                result = self._ob.put(store, key, data, mode=mode, use_multipart=False)
            except (self._ob.exceptions.PreconditionError, self._ob.exceptions.AlreadyExistsError, FileNotFoundError):
                raise CommitConflict(
                    f"{path}: changed since this run read it (another writer committed, or the object was "
                    "replaced): nothing was overwritten; rerun to build on the new version") from None
        return self._version(result)

    def publish_new(self, path: str, data: bytes) -> str:
        """PUT only if nothing is at ``path`` (``FileExistsError`` otherwise); returns the ETag."""
        store, key = self._target(path)
        with self._errors(path, "PUT"):
            try:
                result = self._ob.put(store, key, data, mode="create", use_multipart=False)
            except (self._ob.exceptions.AlreadyExistsError, self._ob.exceptions.PreconditionError):
                # A create retried after its first attempt landed finds its own bytes: that is success.
                try:
                    existing, etag = self.read_versioned(path)
                except FileNotFoundError:  # deleted since (a lease released): the caller tries again
                    raise FileExistsError(17, "object existed, then was deleted", path) from None
                if existing == data:
                    return etag
                raise FileExistsError(17, "object exists", path) from None
        return self._version(result)

    def barrier(self, path: str) -> None:
        """A completed PUT is durable and visible to every reader at once: nothing to wait for."""

    def lock(self, directory: str, wait: bool = False) -> ContextManager[Any]:
        return lease(self, self.join(directory, LOCK_NAME), wait=wait)

    def check_conditional_writes(self, directory: str) -> None:
        """Prove on the store itself the two preconditions the lease and the commit rely on, with one probe
        object: a create over an existing object is refused, and a replace naming a version that was
        replaced since is refused (while one naming the current version succeeds). A store that accepts
        either, or does not take the upload at all, is refused (``UnsupportedStore``): on it two runs could
        both commit."""
        probe = self.join(directory, f".probe-conditional-{os.getpid()}-{threading.get_ident()}")
        store, key = self._target(probe)
        ex = self._ob.exceptions
        refused = (ex.AlreadyExistsError, ex.PreconditionError)
        ignored = []
        with self._errors(probe, "PUT"):
            try:
                first = self._ob.put(store, key, b"1", mode="overwrite", use_multipart=False)
            except ex.BaseError as e:
                failure = parse(e)
                if failure.status in (400, 405, 501) and not refused_access(failure):
                    raise UnsupportedStore(
                        f"{directory}: {failure.endpoint or self.where()} does not take {self.settings().name}'s "
                        f"object upload ({failure.method or 'PUT'} answered {failure.cause()}), so the commit's "
                        "conditional writes cannot be used there: nothing was written; use the cloud's own "
                        "service (or an emulator that serves its upload API) or a local directory") from None
                raise
            try:
                try:
                    self._ob.put(store, key, b"2", mode="create", use_multipart=False)
                    ignored.append("create-if-absent")
                except refused:
                    pass
                except ex.NotSupportedError:
                    ignored.append("create-if-absent")
                if not ignored and not self._version(first):
                    ignored.append("replace-if-unchanged: a write returned no version to name")
                if not ignored:
                    old = self._version(first)
                    self._ob.put(store, key, b"3", mode=self._replace_mode(old), use_multipart=False)
                    try:
                        self._ob.put(store, key, b"4", mode=self._replace_mode(old), use_multipart=False)
                        ignored.append("replace-if-unchanged")
                    except (*refused, FileNotFoundError):
                        pass
                    except ex.NotSupportedError:
                        ignored.append("replace-if-unchanged")
            finally:
                self.remove(probe)
        if ignored:
            raise UnsupportedStore(
                f"{directory}: {self.where()} ignores conditional writes ({' and '.join(ignored)}), so two runs "
                "could overwrite each other's commit: nothing was written; use a store that supports them (AWS "
                "S3, Google Cloud Storage, Azure Blob, MinIO, R2, SeaweedFS do) or write to a local directory")


def _etag(meta: dict[str, Any]) -> str:
    """The ETag as the object's HEAD gives it, quoted (GCS lists it unquoted: one object, one version)."""
    etag = meta.get("e_tag") or ""
    return etag if not etag or etag.startswith(('"', "W/")) else f'"{etag}"'


def _file_info(cls: Any, path: str, meta: dict[str, Any]) -> Any:
    modified = meta.get("last_modified")
    mtime_ns = int(modified.timestamp() * 1e9) if modified is not None else 0
    return cls(path=path, size=int(meta["size"]), mtime_ns=mtime_ns, version=_etag(meta))
