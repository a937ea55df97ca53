"""``Storage`` on S3-compatible object storage (``s3://bucket/key``), through obstore.

Created when the first ``s3://`` path is opened (``shardio.store.backends.for_path``), which imports
obstore: a training image without the ``s3`` extra still imports ``shardio``. obstore was chosen over
fsspec/s3fs because the commit protocol needs
conditional writes (put-if-absent, If-Match) as first-class calls, and because it is faster on the
same server (``bench/README.md``, "Object storage"). Works against AWS S3, MinIO, Cloudflare R2 and
SeaweedFS; the tests run it against SeaweedFS.

Configuration is the standard AWS one, nothing of ours: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
/ ``AWS_SESSION_TOKEN``, ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``), ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) for a non-AWS server, and profiles (``AWS_PROFILE``, ``~/.aws/config``,
``~/.aws/credentials``, SSO, instance roles), which boto3 resolves when no key is in the environment.

How the directory protocol's guarantees map here (``shardio.store.base`` lists them):

- publish: one PUT (atomic per object); ``if_version`` adds ``If-Match: ETAG``.
- publish_new: ``If-None-Match: *`` (put-if-absent). A retried create whose first attempt landed reads
  back the same bytes and counts as done.
- staging + promote: a shard is written to local scratch (``create_temp``), then uploaded at its final
  key (multipart above 16 MB): an object is visible whole or not at all. A killed upload leaves an
  incomplete multipart upload, invisible to readers (a bucket lifecycle rule
  ``AbortIncompleteMultipartUpload`` reclaims its space); an upload that completed but was never
  committed is an unlisted object, which the next run holding the lease removes.
- barrier: nothing (a completed PUT is durable and strongly consistent on S3, R2, MinIO, SeaweedFS).
- lock: a lease object (``shardio.store.lease``).

Transient failures (connection reset, 5xx, SlowDown) are retried by obstore with exponential backoff
(up to ~60 s in all, so a server restart is ridden out); a refused credential or a missing bucket is not
retried and becomes ``StorageAccessError`` (exit 2) within one request.
"""

from __future__ import annotations

import io
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, BinaryIO, ContextManager

from shardio.format.checksum import new_hasher
from shardio.errors import CommitConflict, MissingExtra, StorageAccessError, StorageUnavailable, UnsupportedStore
from shardio.store.base import LOCK_NAME, FileInfo
from shardio.store.lease import lease
from shardio.store.scratch import scratch_dir
from shardio.store.s3_errors import StoreSettings, explain

__all__ = ["CARRIED_VARIABLES", "CREDENTIAL_VARIABLES", "S3Storage", "SCHEMES", "carried_settings",
           "driver_credentials", "split_url"]

SCHEMES = ("s3://",)

# Above this a shard is uploaded in parts, 4 at a time (S3 wants parts of 5 MB or more).
_PART_BYTES = 16 << 20
_DOWNLOAD_CHUNK = 8 << 20


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageAccessError(f"{url}: no bucket name in the URL (expected s3://BUCKET/PATH)")
    return bucket, key.strip("/")


def _obstore() -> Any:
    try:
        import obstore
    except ImportError as e:
        raise MissingExtra(
            "s3:// paths need the object-storage extra, which is not installed: pip install 'shardio[s3]' "
            "(it adds obstore and boto3)") from e
    return obstore


def _endpoint() -> str | None:
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return os.environ[name]
    return None


def _store_options() -> dict[str, Any]:
    """obstore's S3Store keyword arguments from the standard AWS environment and config files."""
    options: dict[str, Any] = {
        "client_options": {"connect_timeout": "5s", "timeout": "300s"},
        "retry_config": {
            "max_retries": 8,
            "retry_timeout": timedelta(seconds=60),
            "backoff": {"init_backoff": timedelta(milliseconds=200), "max_backoff": timedelta(seconds=8),
                        "base": 2},
        },
    }
    endpoint = _endpoint()
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not os.environ.get("AWS_ACCESS_KEY_ID"):
        # No key in the environment: profiles, SSO, instance roles, as the AWS CLI resolves them.
        try:
            import boto3
        except ImportError:
            boto3 = None
        if boto3 is not None:
            session = boto3.Session()
            if session.get_credentials() is not None:
                from obstore.auth.boto3 import Boto3CredentialProvider

                options["credential_provider"] = Boto3CredentialProvider(session)
            region = region or session.region_name
            scoped = session._session.get_scoped_config()  # the profile's section of ~/.aws/config
            endpoint = endpoint or (scoped.get("s3") or {}).get("endpoint_url") or scoped.get("endpoint_url")
    if endpoint:
        options["endpoint"] = endpoint
        if endpoint.startswith("http://"):
            options["client_options"]["allow_http"] = True
        # Non-AWS servers (MinIO, SeaweedFS, R2) address buckets by path, not by virtual host.
        options["virtual_hosted_style_request"] = False
    if region:
        options["region"] = region
    return options


# What a process on another machine needs to reach the same store as this one, none of it secret: the
# endpoint, the region and obstore's S3 options (addressing style, plain http, ...). Never a key, a secret
# or a token, nor AWS_PROFILE / AWS_CONFIG_FILE (they name files on this machine).
CARRIED_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
                     "AWS_ALLOW_HTTP", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "AWS_S3_EXPRESS",
                     "AWS_UNSIGNED_PAYLOAD", "AWS_SKIP_SIGNATURE", "AWS_CHECKSUM_ALGORITHM", "AWS_REQUEST_PAYER")
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def carried_settings() -> dict[str, str]:
    """This process's non-secret S3 settings as environment variables (``CARRIED_VARIABLES``), a profile's
    endpoint and region included: what a Ray task on another node is given so that it reaches the same
    server in the same region (``preprocess.cluster_access``)."""
    settings = {name: os.environ[name] for name in CARRIED_VARIABLES if os.environ.get(name)}
    options = _store_options()  # resolves a profile's endpoint and region too
    if options.get("endpoint") and not _endpoint():
        settings["AWS_ENDPOINT_URL"] = options["endpoint"]
    if options.get("region"):
        settings.setdefault("AWS_REGION", options["region"])
    return settings


def driver_credentials() -> dict[str, str]:
    """This process's credentials as environment variables (the environment's, else what a profile, SSO
    or an instance role resolves to now: temporary ones expire). Only for ``--pass-credentials``."""
    found = {name: os.environ[name] for name in CREDENTIAL_VARIABLES if os.environ.get(name)}
    if "AWS_ACCESS_KEY_ID" in found:
        return found
    try:
        import boto3
    except ImportError:
        return {}
    credentials = boto3.Session().get_credentials()
    if credentials is None:
        return {}
    frozen = credentials.get_frozen_credentials()
    found = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
    if frozen.token:
        found["AWS_SESSION_TOKEN"] = frozen.token
    return found


def _finds_no_credentials(options: dict[str, Any]) -> bool:
    """Whether this machine has no credentials at all, as boto3 resolves them (environment, profiles,
    SSO, container and instance roles; it gives the instance metadata service 1 s). Said at once: obstore
    would ask the metadata service again and, off EC2, retry its connect timeouts for a minute."""
    if os.environ.get("AWS_ACCESS_KEY_ID") or "credential_provider" in options:
        return False
    if os.environ.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true"):
        return False
    try:
        import boto3  # noqa: F401 - without it this cannot be told: obstore tries by itself
    except ImportError:
        return False
    return True  # _store_options asked boto3 already, and it found none


# Where the region probe goes: AWS's global endpoint (None); the tests point it at a fake server.
_AWS_PROBE_ENDPOINT: str | None = None


def _aws_bucket_region(bucket: str) -> str | None:
    """The AWS region ``bucket`` lives in, or None if that cannot be told (the request itself then says
    what is wrong). AWS answers a request signed for another region with a redirect or a 400 that obstore
    does not follow, and a bucket is often in another region than the profile's (public datasets in
    us-east-1): boto3 finds the bucket's region by itself, and so does this, with one anonymous HEAD of the
    bucket, whose ``x-amz-bucket-region`` header AWS sends even when it refuses the request."""
    try:
        import boto3
        import botocore
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return None
    config = Config(signature_version=botocore.UNSIGNED, connect_timeout=5, read_timeout=10,
                    retries={"max_attempts": 2})
    try:
        client = boto3.session.Session().client("s3", region_name="us-east-1",
                                                endpoint_url=_AWS_PROBE_ENDPOINT, config=config)
        headers = client.head_bucket(Bucket=bucket)["ResponseMetadata"]["HTTPHeaders"]
    except ClientError as exc:
        headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    except (BotoCoreError, ValueError):
        return None
    return headers.get("x-amz-bucket-region") or None


class S3Storage:
    """``Storage`` for ``s3://`` URLs. One instance serves every bucket (a store is made per bucket)."""

    is_local = False

    def __init__(self) -> None:
        self._ob = _obstore()
        self._stores: dict[str, Any] = {}
        self._checked_buckets: set[str] = set()
        self._lock = threading.Lock()

    # --- plumbing -------------------------------------------------------------------------------------

    def _store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                from obstore.store import S3Store

                options = dict(_store_options())
                if _finds_no_credentials(options):
                    raise StorageAccessError(
                        f"s3://{bucket}: no S3 credentials on this machine ({socket.gethostname()}): no "
                        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, no profile in ~/.aws, no instance or "
                        "container role; HINT: set them (on a Ray cluster, on every node, or pass the driver's "
                        "with `preprocess run --pass-credentials`); a public bucket reads with "
                        "AWS_SKIP_SIGNATURE=true")
                # AWS itself: the bucket's own region, as boto3 finds it (else the configured one).
                region = None if "endpoint" in options else _aws_bucket_region(bucket)
                if region:
                    options["region"] = region
                store = S3Store(bucket, **options)
                self._stores[bucket] = store
            return store

    def _target(self, url: str) -> tuple[Any, str]:
        bucket, key = split_url(url)
        return self._store(bucket), key

    def where(self) -> str:
        return _endpoint() or "AWS S3"

    def settings(self) -> StoreSettings:
        """How this process configured S3, for error hints (``shardio.store.s3_errors``)."""
        endpoint = _endpoint()
        create = "aws s3 mb s3://BUCKET" + (" --endpoint-url ENDPOINT" if endpoint else "")
        return StoreSettings("AWS S3", "AWS_ENDPOINT_URL", endpoint,
                             "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE", create)

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

    def read_bytes(self, path: str) -> bytes:
        return self.read_versioned(path)[0]

    def read_versioned(self, path: str) -> tuple[bytes, str]:
        """The object's bytes and its ETag (for a later ``publish(..., if_version=ETAG)``)."""
        store, key = self._target(path)
        with self._errors(path, "GET"):
            result = self._ob.get(store, key)
            data = bytes(result.bytes())
        return data, result.meta.get("e_tag") or ""

    def read_range(self, path: str, start: int, length: int) -> bytes:
        store, key = self._target(path)
        with self._errors(path, "ranged GET"):
            return bytes(self._ob.get_range(store, key, start=start, length=length))

    def open_read(self, path: str) -> BinaryIO:
        """A seekable reader doing ranged GETs (8 MB buffered)."""
        store, key = self._target(path)
        with self._errors(path, "GET"):
            reader = self._ob.open_reader(store, key, buffer_size=_DOWNLOAD_CHUNK)
        return _Reader(reader, path)  # type: ignore[return-value]

    def download(self, path: str, local_path: str, algorithm: str, attempts: int = 3) -> str:
        """The whole object into ``local_path``, streamed in 8 MB pieces (memory stays flat), hashed on the
        way: returns the ``algorithm`` checksum (``shardio.format.checksum``) of the bytes written, so a checked
        download reads nothing back. A stream cut mid-way (obstore retries each request, not a body already
        flowing) restarts, up to ``attempts``."""
        store, key = self._target(path)
        for attempt in range(attempts):
            digest = new_hasher(algorithm)
            try:
                with self._errors(path, "GET"), open(local_path, "wb") as out:
                    for chunk in self._ob.get(store, key).stream(min_chunk_size=_DOWNLOAD_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                return digest.hexdigest()
            except StorageUnavailable:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

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
        """Upload a local file at ``path`` (multipart above 16 MB); returns the ETag."""
        store, key = self._target(path)
        size = os.path.getsize(local_path)
        with self._errors(path, "PUT"), open(local_path, "rb") as f:
            if size <= _PART_BYTES:
                result = self._ob.put(store, key, f.read(), use_multipart=False)
            else:
                result = self._ob.put(store, key, f, use_multipart=True, chunk_size=_PART_BYTES,
                                      max_concurrency=4)
        return result.get("e_tag") or ""

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
        mode: Any = {"e_tag": if_version} if if_version else "overwrite"
        with self._errors(path, "PUT"):
            try:
                result = self._ob.put(store, key, data, mode=mode, use_multipart=False)
            except (self._ob.exceptions.PreconditionError, self._ob.exceptions.AlreadyExistsError, FileNotFoundError):
                raise CommitConflict(
                    f"{path}: changed since this run read it (another writer committed, or the object was "
                    "replaced): nothing was overwritten; rerun to build on the new version") from None
        return result.get("e_tag") or ""

    def publish_new(self, path: str, data: bytes) -> str:
        """PUT only if nothing is at ``path`` (``FileExistsError`` otherwise); returns the ETag."""
        store, key = self._target(path)
        with self._errors(path, "PUT"):
            try:
                result = self._ob.put(store, key, data, mode="create", use_multipart=False)
            except (self._ob.exceptions.AlreadyExistsError, self._ob.exceptions.PreconditionError):
                # A create retried after its first attempt landed finds its own bytes: that is success.
                existing, etag = self.read_versioned(path)
                if existing == data:
                    return etag
                raise FileExistsError(17, "object exists", path) from None
        return result.get("e_tag") or ""

    def barrier(self, path: str) -> None:
        """A completed PUT is durable and visible to every reader at once: nothing to wait for."""

    def lock(self, directory: str, wait: bool = False) -> ContextManager[Any]:
        return lease(self, self.join(directory, LOCK_NAME), wait=wait)

    def check_conditional_writes(self, directory: str) -> None:
        """Refuse a store that ignores ``If-None-Match``: on it two writers could both commit. Two creates
        of one probe object: the second must be refused."""
        probe = self.join(directory, f".probe-conditional-{os.getpid()}-{threading.get_ident()}")
        store, key = self._target(probe)
        with self._errors(probe, "PUT"):
            self._ob.put(store, key, b"1", mode="overwrite", use_multipart=False)
            try:
                self._ob.put(store, key, b"2", mode="create", use_multipart=False)
                honoured = False
            except (self._ob.exceptions.AlreadyExistsError, self._ob.exceptions.PreconditionError):
                honoured = True
            except self._ob.exceptions.NotSupportedError:
                honoured = False
            finally:
                self.remove(probe)
        if not honoured:
            raise UnsupportedStore(
                f"{directory}: {self.where()} ignores conditional writes (If-None-Match), so two runs could "
                "overwrite each other's commit; use a store that supports them (AWS S3, MinIO, R2, SeaweedFS "
                "do) or write to a local directory")


def _file_info(cls: Any, path: str, meta: dict[str, Any]) -> Any:
    modified = meta.get("last_modified")
    mtime_ns = int(modified.timestamp() * 1e9) if modified is not None else 0
    return cls(path=path, size=int(meta["size"]), mtime_ns=mtime_ns, version=meta.get("e_tag") or "")


class _Reader(io.RawIOBase):
    """obstore's ReadableFile as a binary file object (context manager, readinto)."""

    def __init__(self, reader: Any, path: str) -> None:
        self._reader, self.name = reader, path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return bytes(self._reader.read() if size is None or size < 0 else self._reader.read(size))

    def readall(self) -> bytes:
        return self.read()

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._reader.seek(offset, whence)

    def tell(self) -> int:
        return self._reader.tell()

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
        super().close()
