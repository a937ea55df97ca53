"""Shard checksums: the one owner of which algorithms a manifest may name and how a file's digest is taken.

Two algorithms, each a lower-case hex digest of a whole file's bytes:

- ``xxh3_128`` (``WRITE_ALGORITHM``): what every new shard is written with. It is a non-cryptographic
  checksum: it catches corruption and truncation, which is what the manifest's digests are for, not
  tampering (whoever can rewrite a shard can rewrite the manifest too). ~59 GB/s from cache against
  1.8 GB/s for sha256 with SHA-NI: 0.003 instead of 0.11 ms per 196 KB image, where sha256 was ~2.5% of
  the job's CPU. A stranger checks it with ``xxh128sum FILE`` (package ``xxhash`` in Debian/Ubuntu,
  Homebrew, conda), which prints the same hex.
- ``sha256``: shards written before it (manifests with ``sha256``/``meta_sha256``). They are read and
  checked as before, also in a dataset that mixes both after an incremental run; ``sha256sum`` checks them.

The ``xxhash`` package is imported only when an ``xxh3_128`` digest is actually taken, so ``import
shardio`` (and reading a local dataset without ``verify``) needs numpy and torch alone; the ``preprocess``
and ``s3`` extras install it.

It lives in ``store/``, the lower layer: a backend takes checksums itself (``Storage.checksum``, a download
hashed as it is written), and the format names the algorithms from here, importing downwards.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from typing import Any, Protocol

from shardio.errors import MissingExtra, ShardFormatError

__all__ = ["XXH3_128", "SHA256", "ALGORITHMS", "ALGORITHM_CODES", "ALGORITHM_NAMES", "DIGEST_BYTES", "WRITE_ALGORITHM",
           "Hasher", "new_hasher", "require", "file_checksum"]

XXH3_128 = "xxh3_128"
SHA256 = "sha256"
ALGORITHMS = (XXH3_128, SHA256)
# A format 3 index segment stores the algorithm as a code and the digest as raw bytes (spec, "Index").
ALGORITHM_CODES = {XXH3_128: 0, SHA256: 1}
ALGORITHM_NAMES = {code: name for name, code in ALGORITHM_CODES.items()}
DIGEST_BYTES = {XXH3_128: 16, SHA256: 32}
WRITE_ALGORITHM = XXH3_128


class Hasher(Protocol):
    """A streaming digest (``hashlib``'s interface, which ``xxhash`` shares)."""

    def update(self, data: Any, /) -> None: ...
    def hexdigest(self) -> str: ...


def _xxhash() -> Any:
    try:
        import xxhash
    except ImportError as e:
        raise MissingExtra(
            "xxh3_128 shard checksums (writing or checking one) need the xxhash package, which is not "
            "installed: pip install xxhash (or the extra that brings it: pip install 'shardio[s3]' or "
            "'shardio[preprocess]')"
        ) from e
    return xxhash


def new_hasher(algorithm: str) -> Hasher:
    """A fresh streaming digest of ``algorithm`` (``update`` with bytes or a buffer, then ``hexdigest``).
    ShardFormatError for a name this shardio does not know (a manifest's entries are checked when it is
    loaded, naming it: ``ShardEntry.from_json``)."""
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == XXH3_128:
        return _xxhash().xxh3_128()  # type: ignore[no-any-return]
    raise ShardFormatError(f"unknown checksum algorithm {algorithm!r} (this shardio checks "
                           f"{', '.join(ALGORITHMS)}); HINT: upgrade shardio")


def require(algorithm: str) -> None:
    """Fail now, not in the middle of the work, if ``algorithm`` cannot be checked here (an unknown name:
    ShardFormatError; xxh3_128 without the xxhash package: MissingExtra saying what to install)."""
    new_hasher(algorithm)


# Hashed through mmap in windows of this size, each released after hashing: no copy out of the page cache
# (for sha256 that took 0.22 -> 0.12 ms per 256² image; for xxh3 the copy would cost more than the hash),
# and RSS does not grow by a whole shard.
_WINDOW = 16 << 20


def file_checksum(path: str, algorithm: str) -> str:
    """The ``algorithm`` hex digest of the whole local file at ``path``, through mmap (an object's checksum is
    its backend's: ``Storage.checksum``, streamed with no local copy)."""
    require(algorithm)  # before any I/O
    digest = new_hasher(algorithm)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return digest.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for start in range(0, size, _WINDOW):
                    length = min(_WINDOW, size - start)
                    digest.update(view[start : start + length])
                    mapped.madvise(mmap.MADV_DONTNEED, start, length)
            finally:
                view.release()
    return digest.hexdigest()
