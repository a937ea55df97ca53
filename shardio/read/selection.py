"""Sample selections: which stored samples a dataset reads, as a snapshot of segments (numpy only).

``SampleSelection`` is what ``ShardDataset(selection=...)`` applies to every snapshot it opens: the first
one, the generation a resumed state pins, and the newest one a new epoch follows. It is a value (the
criteria), not a list of indices, so that it means the same on any generation and pickles small for
spawned DataLoader workers. ``SubsetSnapshot`` is the result: the selected samples grouped into
*segments*, maximal runs contiguous in one shard, each presented as a shard (a slice of that shard's
memory map), so the epoch order, ranks, workers, resume and prefetch are ``ShardDataset``'s own.

- ``inputs``: every sample of those inputs (a manifest input path or its base name).
- ``keys``: those samples (every key must exist). Reads every shard's ``.jsonl`` at each open (about
  1 s per million samples).
- ``fraction``, ``fraction_seed``: the samples whose ``blake2b(fraction_seed, key)`` falls below
  ``fraction`` of the hash range. Decided by the key alone: the same on every rank and every open, and a
  sample keeps its membership when a nightly run appends inputs. The count is binomial around
  ``fraction × N``. Reads every ``.jsonl`` at each open.

Given several, the selection is their intersection. A subset's batch schema is its own: the fields its
shards carry (``SubsetSnapshot.fields``, which reads the selected shards' ``.jsonl`` once per open).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardio.read.cache.cache_dir import cache_key
from shardio.errors import ShardError
from shardio.read.snapshot import DatasetSnapshot, ShardMeta

__all__ = ["SampleSelection", "SubsetSnapshot", "fraction_member", "select_samples"]


def fraction_member(key: str, fraction: float, seed: int = 0) -> bool:
    """Whether the sample ``key`` belongs to the ``fraction`` subset of ``seed``."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8, key=str(seed).encode("ascii")).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


@dataclass(frozen=True)
class SampleSelection:
    """The criteria of a subset (see the module docstring); ``apply`` narrows a snapshot to them."""

    keys: tuple[str, ...] | None = None
    inputs: tuple[str, ...] | None = None
    fraction: float | None = None
    fraction_seed: int = 0

    def __post_init__(self) -> None:
        if self.keys is None and self.inputs is None and self.fraction is None:
            raise ValueError("give keys=, inputs= or fraction= (or use ShardDataset for every sample)")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")

    def apply(self, snapshot: DatasetSnapshot) -> SubsetSnapshot:
        """The selected samples of ``snapshot``; a ``ShardError`` when they are none."""
        selected = select_samples(snapshot, self)
        if len(selected) == 0:
            inputs = None if self.inputs is None else list(self.inputs)
            raise ShardError(f"{snapshot.directory}: the subset (keys={self.keys is not None}, inputs="
                             f"{inputs}, fraction={self.fraction}) selects no sample of generation "
                             f"{snapshot.generation}")
        return SubsetSnapshot(snapshot, selected)


def select_samples(snapshot: DatasetSnapshot, selection: SampleSelection) -> np.ndarray:
    """The stored indices (sorted int64) of the samples ``selection`` picks in ``snapshot``."""
    chosen = np.ones(len(snapshot), dtype=bool)
    if selection.inputs is not None:
        chosen &= _input_mask(snapshot, list(selection.inputs))
    if selection.keys is None and selection.fraction is None:
        return np.flatnonzero(chosen).astype(np.int64)
    all_keys = [key for shard in range(len(snapshot.shards)) for key in snapshot.meta(shard).keys]
    if selection.keys is not None:
        wanted = set(selection.keys)
        mask = np.fromiter((k in wanted for k in all_keys), dtype=bool, count=len(all_keys))
        missing = wanted - {k for k, m in zip(all_keys, mask) if m}
        if missing:
            raise ShardError(
                f"{snapshot.directory}: {len(missing)} of the {len(wanted)} subset keys are not in the "
                f"dataset (generation {snapshot.generation}), e.g. {sorted(missing)[:5]}; check the "
                "key list against `shardio info` or open the generation it was made from")
        chosen &= mask
    if selection.fraction is not None:
        fraction, seed = selection.fraction, selection.fraction_seed
        chosen &= np.fromiter((fraction_member(k, fraction, seed) for k in all_keys), dtype=bool,
                              count=len(all_keys))
    return np.flatnonzero(chosen).astype(np.int64)


def _input_mask(snapshot: DatasetSnapshot, names: list[str]) -> np.ndarray:
    known = {entry.input for entry in snapshot.shards}
    by_name: dict[str, set[str]] = {}
    for name in known:
        by_name.setdefault(name, set()).add(name)
        by_name.setdefault(os.path.basename(name), set()).add(name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ShardError(f"{snapshot.directory}: no input named {unknown[:5]} in the dataset; it has "
                         f"{len(known)} inputs, e.g. {sorted(known)[:5]}")
    wanted = set().union(*(by_name[n] for n in names)) if names else set()
    mask = np.zeros(len(snapshot), dtype=bool)
    for shard, entry in enumerate(snapshot.shards):
        if entry.input in wanted:
            mask[snapshot.offsets[shard] : snapshot.offsets[shard + 1]] = True
    return mask


class SubsetSnapshot(DatasetSnapshot):
    """The ``selected`` samples of ``parent``, its "shards" being segments of the parent's shards;
    ``selected`` holds their stored indices in ``parent``."""

    def __init__(self, parent: DatasetSnapshot, selected: np.ndarray, cache_shards: int = 16) -> None:
        super().__init__(parent.root, parent.manifest)
        selected = np.unique(np.asarray(selected, dtype=np.int64))
        shard_of = np.searchsorted(parent.offsets, selected, side="right") - 1
        local = selected - parent.offsets[shard_of]
        cut = np.flatnonzero((np.diff(selected) != 1) | (np.diff(shard_of) != 0)) + 1
        heads = np.concatenate([[0], cut]).astype(np.int64)
        tails = np.append(cut, len(selected)).astype(np.int64)
        self.parent, self.selected = parent, selected
        # (parent shard, start, stop) of each segment
        self.segments = np.stack([shard_of[heads], local[heads], local[tails - 1] + 1], axis=1) \
            if len(selected) else np.empty((0, 3), np.int64)
        self.shards = [parent.shards[int(s)] for s in self.segments[:, 0]]
        self.counts = (self.segments[:, 2] - self.segments[:, 1]).astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        # A segment is in its parent shard's bucket (a bucketed dataset's batches stay one bucket).
        self._shard_buckets = np.asarray(parent.shard_buckets, np.int64)[self.segments[:, 0]]
        self.cache_shards = cache_shards
        self._maps: OrderedDict[int, tuple[np.ndarray, ShardMeta | None]] = OrderedDict()
        self._fields: tuple[str, ...] | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields the subset's shards carry: a subset is a dataset with its own batch schema (a subset
        of caption-only inputs has no ``cls``). Reads the selected shards' ``.jsonl`` once."""
        if self._fields is None:
            # Through _parent: the .jsonl parsed here is the one the first batches use (no second parse).
            metas = [self._parent(int(shard), with_meta=True)[1] for shard in np.unique(self.segments[:, 0])]
            flags = {"cls": any(m.has_cls for m in metas), "txt": any(m.has_txt for m in metas),
                     "json": any(m.has_json for m in metas)}
            self._fields = tuple(name for name, carried in flags.items() if carried)
        return self._fields

    def _parent(self, shard: int, with_meta: bool) -> tuple[np.ndarray, ShardMeta | None]:
        # One memory map (and parsed .jsonl) per parent shard, however many segments it is cut into.
        hit = self._maps.get(shard)
        if hit is None or (with_meta and hit[1] is None):
            pixels = hit[0] if hit is not None else self.parent.pixels(shard)
            hit = (pixels, self.parent.meta(shard) if with_meta else None)
            self._maps[shard] = hit
            if len(self._maps) > self.cache_shards:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(shard)
        return hit

    def forget(self, keys: set[str]) -> None:
        """Drop the kept maps of the parent's shards with these cache keys (``shardio.read.cache.cache_dir.cache_key``;
        a shard cache evicting them: ``shardio.read.cache.cached_reading.CachedAssembler``)."""
        for shard in [s for s in self._maps if cache_key(self.parent.shards[s]) in keys]:
            del self._maps[shard]

    def pixels(self, shard_index: int) -> np.ndarray:
        shard, start, stop = (int(v) for v in self.segments[shard_index])
        return self._parent(shard, with_meta=False)[0][start:stop]

    def output_arrays(self, shard_index: int) -> dict[str, np.ndarray]:
        """The segment's rows of each model output of its parent shard (the parent's maps, sliced)."""
        shard, start, stop = (int(v) for v in self.segments[shard_index])
        return {name: array[start:stop] for name, array in self.parent.output_arrays(shard).items()}

    def meta(self, shard_index: int) -> ShardMeta:
        shard, start, stop = (int(v) for v in self.segments[shard_index])
        meta = self._parent(shard, with_meta=True)[1]
        if meta is None:  # _parent(with_meta=True) always parses it
            raise ShardError(f"{self.directory}: no metadata for shard {shard}")
        # A window sharing the shard's parsed lines; the has_* flags stay the shard's: a batch has "cls"
        # where its shards carry labels, as without a subset.
        return meta.window(start, stop)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = OrderedDict()  # a worker maps its own shards (a pickled memmap is a full copy)
        return state
