"""The reading face of the shard cache (``shardio.read.cache.shard_cache.ShardCache``): a cached shard's pixels
(raw, JPEG, yuv420), model outputs, header and metadata, each read once the unit is there (``_acquire`` waits
for it) and under the cache's lock from that check to the map, so no eviction comes in between; every map holds
its unit until the last view of it is gone."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any

import numpy as np

from shardio.format import HEADER_BYTES
from shardio.read.cache.cache_dir import CacheDir, CachedShard
from shardio.read.jpeg_pixels import JpegPixels, map_jpeg_shard
from shardio.read.yuv_pixels import YuvPixels, map_yuv_shard

__all__ = ["CachedViews"]


class CachedViews:
    """What ``ShardCache`` reads with: it gives the lock, the directory, the units, the wait for a unit and the
    map counts these use."""

    _cond: threading.Condition
    files: CacheDir
    _maps: dict[str, int]
    _released: deque[str]

    def unit(self, shard: int) -> CachedShard:
        raise NotImplementedError

    def _acquire(self, unit: CachedShard) -> None:
        raise NotImplementedError

    def path(self, key: str) -> str:
        """Where the ``.npy`` of the unit with this cache key (``shardio.read.cache.cache_dir.cache_key``) is cached."""
        return self.files.path(key)

    def pixels(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s N×H×W×3 pixels: a copy-on-write map of the cached file (waits for it)."""
        unit = self.unit(shard)
        height, width = self.files.unit_shape(unit)
        with self._cond:  # held from the check to the map: no eviction in between
            self._acquire(unit)
            if unit.samples == 0:
                return np.empty((0, height, width, 3), np.uint8)
            mapped = np.memmap(self.path(unit.key), dtype=np.uint8, mode="c", offset=HEADER_BYTES,
                               shape=(unit.samples, height, width, 3))
            self._hold_map(unit.key, mapped._mmap)
        return mapped

    def jpeg_pixels(self, shard: int) -> JpegPixels:
        """Shard ``shard`` of a JPEG dataset: ``JpegPixels`` over a map of the cached file (waits for it);
        held, like ``pixels``' maps, until the last view of it is gone."""
        unit = self.unit(shard)
        height, width = self.files.unit_shape(unit)
        with self._cond:  # held from the check to the map: no eviction in between
            self._acquire(unit)
            mapped = map_jpeg_shard(unit.npy_url, self.path(unit.key), unit.samples, height, width)
            self._hold_map(unit.key, mapped.data._mmap)
        return mapped

    def yuv_pixels(self, shard: int) -> YuvPixels:
        """Shard ``shard`` of a yuv420 dataset: ``YuvPixels`` over a map of the cached file's planes (waits for
        it); held, like ``pixels``' maps, until the last view of it is gone."""
        unit = self.unit(shard)
        height, width = self.files.unit_shape(unit)
        with self._cond:  # held from the check to the map: no eviction in between
            self._acquire(unit)
            mapped = map_yuv_shard(unit.npy_url, self.path(unit.key), unit.samples, height, width)
            if unit.samples == 0:
                return mapped
            self._hold_map(unit.key, mapped.planes._mmap)
        return mapped

    def output_arrays(self, shard: int) -> dict[str, np.ndarray]:
        """Shard ``shard``'s model outputs by name, each (N, *its bucket's shape) of its stored dtype: copy-on-write
        maps of the cached files (waits for the unit); each map holds the unit, like ``pixels``' maps, until the
        last view of it is gone."""
        unit = self.unit(shard)
        arrays: dict[str, np.ndarray] = {}
        with self._cond:  # held from the check to the maps: no eviction in between
            self._acquire(unit)
            for output in unit.outputs:
                shape = (unit.samples, *output.shape)
                if unit.samples == 0:
                    arrays[output.name] = np.empty(shape, np.dtype(output.descr))
                    continue
                mapped = np.memmap(self.files.output_path(unit, output), dtype=np.dtype(output.descr), mode="c",
                                   offset=HEADER_BYTES, shape=shape)
                self._hold_map(unit.key, mapped._mmap)
                arrays[output.name] = mapped
        return arrays

    def _hold_map(self, key: str, mapping: Any) -> None:
        """A map of ``key``'s unit (under the lock, after ``_acquire``): the unit is held until the map is gone."""
        self._maps[key] = self._maps.get(key, 0) + 1
        weakref.finalize(mapping, self._released.append, key).atexit = False

    def header(self, shard: int) -> bytes:
        """The first ``HEADER_BYTES`` of shard ``shard``'s cached ``.npy`` (waits for it): all there is of a
        dataset without pixels (``encoding: none``)."""
        unit = self.unit(shard)
        with self._cond:  # an open file stays readable even if evicted once the lock is released
            self._acquire(unit)
            f = open(self.path(unit.key), "rb")  # noqa: SIM115 - read outside the lock
        with f:
            return f.read(HEADER_BYTES)

    def meta_bytes(self, shard: int) -> bytes:
        """Shard ``shard``'s ``.jsonl`` bytes (waits for it)."""
        unit = self.unit(shard)
        with self._cond:  # an open file stays readable even if evicted once the lock is released
            self._acquire(unit)
            f = open(self.files.meta_path(unit), "rb")  # noqa: SIM115 - read outside the lock
        with f:
            return f.read()
