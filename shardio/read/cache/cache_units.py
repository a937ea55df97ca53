"""A snapshot's shards as the cache's units, one made when asked for: at LAION-2B (2.3M shards) a unit
per shard up front was 2.3M objects, minutes and GBs in every rank and DataLoader worker, while a pass
reads only its share. What the cache needs of all of them (the total and largest sizes, the checksum
algorithms) comes from the ``ShardTable``'s columns, and nothing per shard is kept here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import overload

import numpy as np

from shardio.format.shard_table import ShardTable
from shardio.format.entries import ShardEntry
from shardio.format.model_outputs import OutputSpec
from shardio.format.spec import HEADER_BYTES
from shardio.read.cache.cache_dir import CachedShard
from shardio.store.checksum import XXH3_128
from shardio.store.root import DatasetRoot, Place, open_root

__all__ = ["ShardUnits", "download_threads", "largest_two", "unit_sizes", "unit_algorithms"]


# Parallel downloads: on the loopback server 4 threads fetched 438 MB/s and 8 fetched 652 MB/s, against
# 881 MB/s of raw GETs into memory (bench.object_store). A large shard is fetched by many connections at once
# anyway (the store's fetch threads: ``shardio.store.piece_download``); small shards are one request each, so
# their number in flight is set by bytes: as many threads as shards of the mean size make
# ``DOWNLOAD_BYTES_IN_FLIGHT`` (a 2 MB JPEG shard: 32), never fewer than ``DOWNLOAD_THREADS`` nor more than
# ``MAX_DOWNLOAD_THREADS``.
DOWNLOAD_THREADS = 8
DOWNLOAD_BYTES_IN_FLIGHT = 64 << 20
MAX_DOWNLOAD_THREADS = 32


def download_threads(unit_bytes: int | None = None) -> int:
    """Parallel downloads of a cache: ``SHARDIO_DOWNLOAD_THREADS``, else enough for
    ``DOWNLOAD_BYTES_IN_FLIGHT`` of units of ``unit_bytes`` (their mean size) within ``DOWNLOAD_THREADS`` ..
    ``MAX_DOWNLOAD_THREADS``; ``DOWNLOAD_THREADS`` when the size is not given."""
    configured = os.environ.get("SHARDIO_DOWNLOAD_THREADS", "").strip()
    if not configured:
        if not unit_bytes:
            return DOWNLOAD_THREADS
        return max(DOWNLOAD_THREADS, min(MAX_DOWNLOAD_THREADS, DOWNLOAD_BYTES_IN_FLIGHT // unit_bytes))
    if not configured.isdigit() or int(configured) < 1:
        raise ValueError(f"SHARDIO_DOWNLOAD_THREADS={configured!r}: a whole number of threads, at least 1")
    return int(configured)


class ShardUnits(Sequence[CachedShard]):
    """``units[i]``: shard ``i``'s ``CachedShard``, made anew at each call (the cache keeps those it
    uses). ``join`` builds the URLs; by default the root's backend's (the root travels to a spawned worker
    as its path, and is opened again there). Given a path and a ``join``, no backend is asked for.
    ``outputs``: the root's model outputs (each unit holds its shard's output files too)."""

    def __init__(self, place: Place, shards: Sequence[ShardEntry],
                 join: Callable[..., str] | None = None, outputs: Sequence[OutputSpec] = ()) -> None:
        self._place = place
        self.directory = str(place)
        self.shards = shards if isinstance(shards, ShardTable) else ShardTable.from_entries(shards)
        self._join = join
        self.outputs = tuple(outputs)

    def __len__(self) -> int:
        return len(self.shards)

    @overload
    def __getitem__(self, index: int) -> CachedShard: ...

    @overload
    def __getitem__(self, index: slice) -> list[CachedShard]: ...

    def __getitem__(self, index: int | slice) -> CachedShard | list[CachedShard]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return CachedShard.of(self.directory, self.shards[index], self.join, self.outputs)

    @property
    def root(self) -> DatasetRoot:
        """The dataset's root (opened here, once, only for units made from a path)."""
        if not isinstance(self._place, DatasetRoot):
            self._place = open_root(self._place)
        return self._place

    @property
    def join(self) -> Callable[..., str]:
        return self._join if self._join is not None else self.root.storage.join

    def sizes(self) -> np.ndarray:
        """Every unit's size (its ``.npy`` and ``.jsonl`` bytes, and its output files'), int64, from the table's
        columns: an output file is its header and its samples' bytes at their bucket's shape."""
        sizes = self.shards.column("bytes") + self.shards.column("meta_bytes")
        if self.outputs:
            # bytes of one sample of every output, by bucket (a bucket no sample reached has no shape, and no shard)
            sample_bytes = np.array([sum(o.sample_bytes(b) for o in self.outputs if o.shapes[b] is not None)
                                     for b in range(len(self.outputs[0].shapes))], dtype=np.int64)
            buckets = self.shards.column("bucket")
            sizes = sizes + len(self.outputs) * HEADER_BYTES + self.shards.column("samples") * sample_bytes[buckets]
        return sizes

    def algorithms(self) -> set[str]:
        """The checksum algorithms the units' files are checked by: the shards' (a count over the table's codes)
        and xxh3_128 where the dataset has outputs."""
        return self.shards.checksum_algorithms() | ({XXH3_128} if self.outputs else set())


def unit_sizes(units: Sequence[CachedShard]) -> np.ndarray:
    """Every unit's size, int64: column operations for ``ShardUnits``, a walk over a list of units."""
    if isinstance(units, ShardUnits):
        return units.sizes()
    return np.fromiter((u.size for u in units), dtype=np.int64, count=len(units))


def unit_algorithms(units: Sequence[CachedShard]) -> set[str]:
    """The checksum algorithms the units name: a count over the table's codes for ``ShardUnits``."""
    if isinstance(units, ShardUnits):
        return units.algorithms()
    return {u.algorithm for u in units} | ({XXH3_128} if any(u.outputs for u in units) else set())


def largest_two(sizes: np.ndarray) -> tuple[int, ...]:
    """The two largest of ``sizes`` (fewer if there are fewer), largest first: a partition in place (the
    array is the caller's own, made for this), not a sort."""
    if len(sizes) > 2:
        sizes.partition(len(sizes) - 2)
        sizes = sizes[-2:]
    return tuple(sorted((int(s) for s in sizes), reverse=True))
