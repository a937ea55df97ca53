"""An opened place: a dataset directory (``open_root``) or an input (``open_input``: a file, a folder, a prefix,
a glob) with the backend that serves it, chosen once by the opening (the backend table's ``for_path``) and
then carried down instead of the path. What lies below the opening asks ``root.storage`` and joins under
``root.path``; it never looks at the scheme again. These two functions are the only callers of ``for_path``
(``tests/project/test_layering.py`` holds it).

A dataset's root is compared and hashed by its path, which ``open_root`` normalises once (``file://`` stripped, a
URL's trailing slash dropped, a local path without its trailing separator), so one dataset is one key:
the one-writer lock (``shardio.write.lock``) keys what this process holds by it. It is pickled as its
path and opened again where it is unpickled (a Ray task, a DataLoader worker): a backend's clients and
connections are never pickled."""

from __future__ import annotations

import os
from typing import Any

from shardio.store.backends import for_path
from shardio.store.base import Storage
from shardio.store.paths import REMOTE_SCHEMES, check_local, normalize, scheme

__all__ = ["DatasetRoot", "Place", "open_root", "open_input", "root_path"]


class DatasetRoot:
    """A place opened once: ``path`` (normalised) and ``storage``, the backend that serves it."""

    __slots__ = ("path", "storage")

    path: str
    storage: Storage

    def __init__(self, path: str, storage: Storage) -> None:
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "storage", storage)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a DatasetRoot is not changed ({name})")

    @property
    def is_local(self) -> bool:
        """Whether its backend is the local filesystem (a memory map, an fd, ``flock``)."""
        return self.storage.is_local

    def join(self, *parts: str) -> str:
        """A path under the root, as its backend spells it."""
        return self.storage.join(self.path, *parts)

    def at(self, path: str) -> DatasetRoot:
        """Another place the same backend serves (a file a listing of this one found, a folder beside it),
        opened without choosing again; its path as given."""
        return DatasetRoot(path, self.storage)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DatasetRoot) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return open_input, (self.path,)  # the path as it was opened (a dataset's normalised already)

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"DatasetRoot({self.path!r})"


# What an entry point takes: a path (a string or a ``PathLike``), or a root opened already. Public functions take
# a place and open it at their top (``open_root``: nothing to do for a root); what they call below takes the root.
Place = str | os.PathLike[str] | DatasetRoot


def root_path(path: str) -> str:
    """``path`` as a root holds it: ``file://`` stripped, a URL's trailing slash dropped (``"s3://b/ds/"`` and
    ``"s3://b/ds"`` are one dataset), a local path without a trailing separator (``"ds/"`` and ``"ds"``);
    ``UnsupportedPath`` for a scheme no backend serves."""
    path = normalize(path)
    if "://" not in path and len(path) > 1:
        path = path.rstrip("/") or "/"
    return path


def open_root(place: Place) -> DatasetRoot:
    """The place at ``place``, opened: its backend chosen here, once (``MissingExtra`` without the ``s3``
    extra, ``UnsupportedPath`` for an unknown scheme). A root already opened is returned as it is, so an
    entry point that takes a path or a root opens at most once."""
    if isinstance(place, DatasetRoot):
        return place
    path = root_path(os.fspath(place))
    return DatasetRoot(path, for_path(path))


def open_input(place: Place) -> DatasetRoot:
    """An input (a file, a folder, ``URL/`` for a prefix, a glob pattern) opened: its backend chosen here,
    once; its path kept as given but for a stripped ``file://`` (a trailing ``/`` names a prefix). Refusals as
    ``open_root``'s; an input already opened is returned as it is."""
    if isinstance(place, DatasetRoot):
        return place
    path = os.fspath(place)
    path = path if scheme(path) in REMOTE_SCHEMES else check_local(path)
    return DatasetRoot(path, for_path(path))
