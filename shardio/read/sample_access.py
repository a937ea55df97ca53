"""One sample by its global index in stored order, and the index of a sample's key: for evaluation and
debugging (``ShardDataset.sample``, ``ShardDataset.find``), never for training (batches are the fast path).

The stored order is the dataset's: shards as the index lists them (inputs by name, then shard), samples
within a shard in file order; a selection's (``selection=``) indices are over its samples alone. Index work
per ``sample(i)`` is one binary search over the cumulative sample counts the snapshot computed once at
open (``snapshot.offsets``: ~1 µs at 2.3M shards), then the shard's memory map and metadata through the
dataset's own cache of open shards (a shard already open costs nothing more; a new one: its ``.jsonl``
read once, a remote one downloaded through the shard cache).

``find(key, input=...)`` reads the keys of that input's shards (an input's shards are contiguous in the
stored order) and answers from a dict of them kept for the next call; without ``input`` the first call
reads every shard's keys once (O(samples) memory: ~100 bytes a key), each later call is one lookup. A key
that two inputs both hold is an error naming them: pass ``input=``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardio.format import ShardEntry
from shardio.read.jpeg_pixels import JpegPixels
from shardio.read.shard_meta import ShardMeta
from shardio.read.yuv_pixels import YuvPixels

__all__ = ["locate", "sample_at", "KeyFinder"]

ShardReader = Callable[[int], "tuple[np.ndarray | JpegPixels | YuvPixels, ShardMeta]"]


def locate(offsets: np.ndarray, index: int) -> tuple[int, int]:
    """(shard, row) of sample ``index`` (negative: from the end) given the cumulative counts ``offsets``
    (``offsets[s]`` = samples before shard ``s``, last = the total)."""
    total = int(offsets[-1])
    if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
        raise TypeError(f"a sample index is an int, not {type(index).__name__}")
    position = int(index) + (total if index < 0 else 0)
    if not 0 <= position < total:
        raise IndexError(f"sample {index} of {total}")
    shard = int(np.searchsorted(offsets, position, side="right")) - 1
    return shard, position - int(offsets[shard])


def sample_at(read_shard: ShardReader, offsets: np.ndarray, index: int) -> dict[str, Any]:
    """Sample ``index`` as one batch's row: ``image`` (uint8 H×W×3, a copy), ``__key__``, ``cls`` (-1: no
    label), ``txt``, ``json``, ``original_size`` (height, width) and ``crop_top_left`` (top, left) as int64
    [2] (as a batch's rows), and where it lies (``shard``, ``row``, ``index``: its position 0..len-1)."""
    shard, row = locate(offsets, index)
    pixels, meta = read_shard(shard)
    key, txt, cls, value, _, size, crop = meta.rows(row, row + 1)[0]
    return {"image": np.array(pixels[row]), "__key__": key, "cls": -1 if cls is None else cls, "txt": txt,
            "json": value, "original_size": np.array(size, np.int64),
            "crop_top_left": np.array(crop, np.int64), "shard": shard, "row": row,
            "index": int(offsets[shard]) + row}


class KeyFinder:
    """Keys to global indices for one snapshot (see the module docstring)."""

    def __init__(self, shards: Sequence[ShardEntry], offsets: np.ndarray, read_shard: ShardReader) -> None:
        self._shards, self._offsets, self._read_shard = shards, offsets, read_shard
        self._groups: dict[str, list[int]] | None = None  # input -> its shards, made at the first find
        self._by_input: dict[str, dict[str, int]] = {}
        self._all: dict[str, int | None] | None = None  # None value: the key is in several inputs

    def _shards_of(self, input_name: str) -> list[int]:
        if self._groups is None:
            self._groups = {}
            for shard, entry in enumerate(self._shards):  # one entry per shard, once
                self._groups.setdefault(entry.input, []).append(shard)
        return self._groups.get(input_name, [])

    def _names(self) -> list[str]:
        self._shards_of("")
        assert self._groups is not None
        return list(self._groups)

    def _keys(self, shards: list[int]) -> dict[str, int]:
        found: dict[str, int] = {}
        for shard in shards:
            keys = self._read_shard(shard)[1].keys
            base = int(self._offsets[shard])
            for row, key in enumerate(keys):
                found.setdefault(key, base + row)
        return found

    def find(self, key: str, input_name: str | None = None) -> int:
        if input_name is not None:
            if input_name not in self._by_input:
                shards = self._shards_of(input_name)
                if not shards:
                    raise KeyError(f"no input {input_name!r} in this dataset")
                self._by_input[input_name] = self._keys(shards)
            try:
                return self._by_input[input_name][key]
            except KeyError:
                raise KeyError(f"no key {key!r} in input {input_name!r}") from None
        if self._all is None:
            self._all = {}
            for name in self._names():
                for found, index in self._keys(self._shards_of(name)).items():
                    self._all[found] = None if found in self._all else index
        if key not in self._all:
            raise KeyError(f"no key {key!r} in this dataset")
        index = self._all[key]
        if index is None:
            holders = [name for name in self._names() if key in self._keys(self._shards_of(name))]
            raise KeyError(f"key {key!r} is in several inputs ({', '.join(holders[:5])}): pass input=")
        return index
