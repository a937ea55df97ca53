"""The one shard checker: what is wrong with a listed shard, from the sizes the format implies (O(1)) or
also its checksums (reads every byte). The reader checks sizes on open, ``verify`` checksums, a corrupt
manifest's restore both; it lives with the format, not the write side, so the reader imports no writer."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

from shardio.format.manifests import DatasetIndex
from shardio.format.spec import RAW, SHARDS_DIR, Manifest, ShardEntry, expected_shard_size
from shardio.store.backends import for_path
from shardio.store.base import Storage

__all__ = ["shard_problem", "shard_problems"]


def _file_problem(store: Storage, path: str, size: int, algorithm: str, checksum: str | None,
                  listed: dict[str, int] | None = None) -> str | None:
    try:
        actual = store.file_size(path) if listed is None else listed[path]
    except (FileNotFoundError, KeyError):
        return f"{path}: listed in the manifest but missing"
    if actual != size:
        return f"{path}: {actual} bytes, the manifest says {size} (truncated or overwritten)"
    if checksum is not None and store.checksum(path, algorithm) != checksum:
        return f"{path}: {algorithm} differs from the manifest (corrupt)"
    return None


def shard_problem(directory: str, entry: ShardEntry, shape: tuple[int, int, int],
                  checksums: bool = False, listed: dict[str, int] | None = None,
                  encoding: str = RAW) -> str | None:
    """What is wrong with one listed shard (its .npy and .jsonl), or None: the size the format implies and
    each file's size, O(1); with ``checksums`` also each file's checksum (reads every byte). ``listed``
    (path -> size, from one listing) saves a request per file on object storage. ``encoding``: the
    manifest's (a JPEG shard's size is the listed one; its offsets are checked when it is mapped)."""
    store = for_path(directory)
    expected = expected_shard_size(entry, shape, encoding)
    if entry.bytes != expected:
        return (f"{store.join(directory, entry.path)}: the manifest lists {entry.bytes} bytes, "
                f"{entry.samples} samples imply {expected} (inconsistent)")
    for rel, size, checksum in ((entry.path, entry.bytes, entry.checksum),
                                (entry.meta_path, entry.meta_bytes, entry.meta_checksum)):
        problem = _file_problem(store, store.join(directory, rel), size, entry.checksum_algorithm,
                                checksum if checksums else None, listed)
        if problem is not None:
            return problem
    return None


# Shards checked per batch of threads: a dataset of millions of shards is never held as a list of entries.
_CHUNK = 4096


def shard_problems(directory: str, manifest: Manifest | DatasetIndex, shards: Iterable[ShardEntry] | None = None,
                   checksums: bool = False, threads: int = 1) -> list[tuple[ShardEntry, str]]:
    """``shard_problem`` for each of ``shards`` (default: every listed shard), as (entry, problem) pairs.
    Both hashes release the GIL while they read (xxh3_128: tens of GB/s a core from cache; an old shard's
    sha256: ~1-2 GB/s), so a few ``threads`` keep a disk busy. Entries are taken ``_CHUNK`` at a time (a
    ``DatasetIndex`` makes each when it is reached), so memory holds a chunk, not the dataset."""
    store = for_path(directory)
    listed: dict[str, int] | None = None
    check = lambda entry: shard_problem(directory, entry, manifest.shape, checksums, listed,  # noqa: E731
                                        manifest.encoding)
    found: list[tuple[ShardEntry, str]] = []
    entries = iter(manifest.shards if shards is None else shards)
    with ThreadPoolExecutor(threads) if threads > 1 else nullcontext() as pool:
        while chunk := list(itertools.islice(entries, _CHUNK)):
            if listed is None and not store.is_local:
                # One LIST per 1,000 objects instead of two HEADs per shard (once, and only with a shard to check).
                listed = {info.path: info.size for info in store.list_files(store.join(directory, SHARDS_DIR))}
            problems = list(pool.map(check, chunk)) if pool is not None and len(chunk) > 1 else map(check, chunk)
            found += [(entry, problem) for entry, problem in zip(chunk, problems) if problem is not None]
    return found
