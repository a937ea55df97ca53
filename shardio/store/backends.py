"""The backend table: which ``Storage`` serves a path, by URL scheme, in one place (as LitData's
``_DOWNLOADERS`` / ``register_downloader``). A dataset or an input is given its backend once, when it is
opened (``for_path``), and holds it; nothing below the opening looks at the path's scheme again. The backends
never import this table.

A backend is created on first use and shared (one client per cloud and process: its connections and
per-bucket stores are reused); without the ``s3`` extra, the first ``s3://``, ``gs://`` or ``az://`` path
says what to install (``MissingExtra``), and ``import shardio`` still needs numpy and torch alone (the
object-store backends import obstore only when they are created)."""

from __future__ import annotations

from collections.abc import Callable

from shardio.store.base import Storage
from shardio.store.local import LocalStorage
from shardio.store.paths import REMOTE_SCHEMES, check_local, scheme
from shardio.store.azure import AzureStorage
from shardio.store.gcs import GCSStorage
from shardio.store.s3 import S3Storage

__all__ = ["for_path", "register_backend"]

# URL scheme -> the backend's factory; "" is a local path. Every scheme of ``paths.REMOTE_SCHEMES`` is here.
_BACKENDS: dict[str, Callable[[], Storage]] = {"": LocalStorage, "s3": S3Storage, "gs": GCSStorage,
                                               "az": AzureStorage}
_OPEN: dict[str, Storage] = {}


def register_backend(url_scheme: str, factory: Callable[[], Storage]) -> Callable[[], Storage] | None:
    """Serve ``url_scheme`` ("s3", "gs", "az", or "" for local paths) with ``factory``'s backend from now on (the one
    created before is dropped); returns the factory it replaces, to put back."""
    if url_scheme and url_scheme not in REMOTE_SCHEMES:
        raise ValueError(f"{url_scheme!r} is not a scheme shardio's paths take (shardio.store.paths)")
    _OPEN.pop(url_scheme, None)
    previous = _BACKENDS.get(url_scheme)
    _BACKENDS[url_scheme] = factory
    return previous


def for_path(path: str) -> Storage:
    """The backend serving ``path``: S3 for ``s3://``, Google Cloud Storage for ``gs://``, Azure Blob for
    ``az://`` (``MissingExtra`` without the ``s3`` extra), the local one for a local path,
    ``UnsupportedPath`` for any other scheme."""
    name = scheme(path)
    if name not in REMOTE_SCHEMES:
        check_local(path)  # refuses an unknown scheme, naming it
        name = ""
    found = _OPEN.get(name)
    if found is None:
        found = _OPEN[name] = _BACKENDS[name]()
    return found
