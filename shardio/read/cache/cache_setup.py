"""A remote snapshot's shard cache with its defaults: the cache directory (``$SHARDIO_CACHE_DIR``, else
``~/.cache/shardio``), the limit (the dataset, or half the free disk), and sizes such as ``"50GB"``. The
snapshot makes one with these defaults when nobody attached one (``shardio preview``, a script);
``ShardDataset`` makes one with its arguments."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence

from shardio.format import ShardEntry
from shardio.format.model_outputs import OutputSpec
from shardio.read.cache.cache_dir import Downloader
from shardio.read.cache.cache_units import ShardUnits
from shardio.read.cache.shard_cache import ShardCache
from shardio.store.root import Place

__all__ = ["cache_for", "default_cache_dir", "default_cache_limit", "parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)

def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"50GB"`` (10^9), ``"512MiB"`` (2^20), ``"1.5TB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value))
        if match is None:
            raise ValueError(f"cache_limit {value!r} is not a size: use an int of bytes or a string such as "
                             "'50GB', '512MiB'")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size <= 0:
        raise ValueError(f"cache_limit must be positive, got {value!r}")
    return size


def default_cache_dir() -> str:
    """``$SHARDIO_CACHE_DIR``, else ``~/.cache/shardio``."""
    return os.environ.get("SHARDIO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "shardio")


def default_cache_limit(dataset_bytes: int, cache_dir: str) -> int:
    """The smaller of the dataset's size (files listed by the manifest) and half the free space of the
    disk holding ``cache_dir``."""
    probe = os.path.abspath(cache_dir)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return max(1, min(dataset_bytes, shutil.disk_usage(probe).free // 2))


def cache_for(place: Place, shards: Sequence[ShardEntry], shape: tuple[int, int, int], cache_dir: str | None,
              cache_limit: int | str | None, store: Downloader | None = None,
              buckets: Sequence[tuple[int, int]] | None = None, outputs: Sequence[OutputSpec] = ()) -> ShardCache:
    """The cache of a remote snapshot's ``shards`` (a ``ShardTable`` or a list of entries), defaults
    resolved (``default_cache_dir``, ``default_cache_limit``); no shard's unit is made until it is used.
    ``buckets``: a bucketed dataset's (h, w) by bucket id (each shard mapped at its bucket's shape);
    ``outputs``: the root's model outputs (cached with their shards)."""
    cache_dir = cache_dir or default_cache_dir()
    units = ShardUnits(place, shards, outputs=outputs)
    if cache_limit is None:
        limit = default_cache_limit(int(units.sizes().sum()), cache_dir)
    else:
        limit = parse_size(cache_limit)
    return ShardCache(units, store, cache_dir, limit, shape=shape, buckets=buckets)
