"""Which paths shardio takes: local paths (``file://`` stripped) and the URL schemes a backend serves; any
other scheme is refused by name (``UnsupportedPath``), and a URL is never turned into a local path. A leaf:
the backends and their table (``shardio.store.backends``) both ask it."""

from __future__ import annotations

from shardio.errors import UnsupportedPath

__all__ = ["REMOTE_SCHEMES", "scheme", "check_local", "normalize"]

# Schemes with a backend in ``shardio.store.backends``; any other "scheme://" is refused by name.
REMOTE_SCHEMES = ("s3", "gs", "az")
# Other spellings of those stores, refused with the one shardio takes.
_SPELLED_OTHERWISE = {"gcs": "gs://BUCKET/PATH", "azure": "az://CONTAINER/PATH", "abfs": "az://CONTAINER/PATH",
                      "abfss": "az://CONTAINER/PATH"}


def scheme(path: str) -> str:
    """``path``'s URL scheme ("s3", "gs", "az"), "" for a local path (``file://`` included)."""
    head, sep, _ = path.partition("://")
    return "" if not sep or head == "file" else head


def check_local(path: str) -> str:
    """``path`` as a local path (``file://`` stripped); ``UnsupportedPath`` for any URL: the caller needs
    a real file here (a memory map, an fd)."""
    if "://" in path and not path.startswith("file://"):
        name = path.split("://", 1)[0]
        if name in REMOTE_SCHEMES:
            raise UnsupportedPath(f"{path}: this needs a local path, not an {name}:// URL")
        if name in _SPELLED_OTHERWISE:
            raise UnsupportedPath(
                f"{path}: {name}:// URLs are not taken; write it as {_SPELLED_OTHERWISE[name]} (an Azure "
                "account comes from AZURE_STORAGE_ACCOUNT_NAME)")
        raise UnsupportedPath(
            f"{path}: {name}:// paths are not supported (only local paths and s3://, gs:// and az:// URLs); "
            "copy the data locally or mount it"
        )
    return path[len("file://") :] if path.startswith("file://") else path



def normalize(path: str) -> str:
    """A dataset or input path as the backends take it: a URL unchanged, a local path without
    ``file://``; ``UnsupportedPath`` for a scheme no backend serves."""
    if scheme(path) in REMOTE_SCHEMES:
        stripped = path.rstrip("/")  # "s3://b/ds/" and "s3://b/ds" are one dataset
        return stripped if "://" in stripped and stripped.split("://", 1)[1] else path
    return check_local(path)
