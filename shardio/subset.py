"""``SubsetDataset``: a ``ShardDataset`` over chosen samples: by key, by source input, or a fraction.

A subset is a view, never a copy: its samples are grouped into *segments*, maximal runs of selected
samples that are contiguous in one shard, and the dataset treats each segment as a shard (a slice of
that shard's memory map). So shuffling, batching across segments, ranks, workers, ``state_dict`` and
augmentation positions are exactly ``ShardDataset``'s, on the subset's samples in stored order.

- ``inputs=["00001.tar", ...]``: every sample of those inputs (a manifest input path or its base name).
  Reads no metadata: whole shards.
- ``keys=[...]``: those samples (every key must exist). Reads every shard's ``.jsonl`` once at open
  (about 1 s per million samples).
- ``fraction=f, fraction_seed=s``: the samples whose ``blake2b(s, key)`` falls below ``f`` of the hash
  range. Decided by the key alone, so the subset is the same on every rank and every open, and keeps
  its members when a nightly run appends inputs (a sample's membership never depends on the others).
  The count is binomial around ``f × N``, not exactly ``round(f × N)``. Reads every ``.jsonl`` once.

Given several, the subset is their intersection. Segments cost a few µs each per batch (a short copy
each): a fraction of 0.5 of a dataset cuts every shard into ~N/4 segments; fine for training-set
subsets, slower per sample than whole shards for tiny images.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from shardio.dataset import ShardDataset
from shardio.errors import ShardError
from shardio.reader import DatasetSnapshot, ShardMeta

__all__ = ["SubsetDataset", "SubsetSnapshot", "fraction_member", "select_samples"]


def fraction_member(key: str, fraction: float, seed: int = 0) -> bool:
    """Whether the sample ``key`` belongs to the ``fraction`` subset of ``seed``."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8, key=str(seed).encode("ascii")).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def select_samples(snapshot: DatasetSnapshot, *, keys: Iterable[str] | None = None,
                   inputs: Iterable[str] | None = None, fraction: float | None = None,
                   fraction_seed: int = 0) -> np.ndarray:
    """The stored indices (sorted int64) of the samples the criteria select (their intersection)."""
    if keys is None and inputs is None and fraction is None:
        raise ValueError("give keys=, inputs= or fraction= (or use ShardDataset for every sample)")
    chosen = np.ones(len(snapshot), dtype=bool)
    if inputs is not None:
        chosen &= _input_mask(snapshot, list(inputs))
    if keys is not None or fraction is not None:
        all_keys = [key for shard in range(len(snapshot.shards)) for key in snapshot.meta(shard).keys]
        if keys is not None:
            wanted = set(keys)
            mask = np.fromiter((k in wanted for k in all_keys), dtype=bool, count=len(all_keys))
            missing = wanted - {k for k, m in zip(all_keys, mask) if m}
            if missing:
                raise ShardError(
                    f"{snapshot.directory}: {len(missing)} of the {len(wanted)} subset keys are not in the "
                    f"dataset (generation {snapshot.generation}), e.g. {sorted(missing)[:5]}; check the "
                    "key list against `shardio info` or open the generation it was made from")
            chosen &= mask
        if fraction is not None:
            if not 0 < fraction <= 1:
                raise ValueError(f"fraction must be in (0, 1], got {fraction}")
            chosen &= np.fromiter((fraction_member(k, fraction, fraction_seed) for k in all_keys),
                                  dtype=bool, count=len(all_keys))
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
    """The ``selected`` samples of ``parent``, its "shards" being segments of the parent's shards."""

    def __init__(self, parent: DatasetSnapshot, selected: np.ndarray, cache_shards: int = 16) -> None:
        selected = np.unique(np.asarray(selected, dtype=np.int64))
        shard_of = np.searchsorted(parent.offsets, selected, side="right") - 1
        local = selected - parent.offsets[shard_of]
        cut = np.flatnonzero((np.diff(selected) != 1) | (np.diff(shard_of) != 0)) + 1
        heads = np.concatenate([[0], cut]).astype(np.int64)
        tails = np.append(cut, len(selected)).astype(np.int64)
        self.parent, self.directory, self.manifest = parent, parent.directory, parent.manifest
        self.selected = selected
        # (parent shard, start, stop) of each segment
        self.segments = np.stack([shard_of[heads], local[heads], local[tails - 1] + 1], axis=1) \
            if len(selected) else np.empty((0, 3), np.int64)
        self.shards = [parent.shards[int(s)] for s in self.segments[:, 0]]
        self.counts = (self.segments[:, 2] - self.segments[:, 1]).astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.cache_shards = cache_shards
        self._maps: OrderedDict[int, tuple[np.ndarray, ShardMeta | None]] = OrderedDict()

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

    def pixels(self, shard_index: int) -> np.ndarray:
        shard, start, stop = (int(v) for v in self.segments[shard_index])
        return self._parent(shard, with_meta=False)[0][start:stop]

    def meta(self, shard_index: int) -> ShardMeta:
        shard, start, stop = (int(v) for v in self.segments[shard_index])
        meta = self._parent(shard, with_meta=True)[1]
        assert meta is not None
        # The has_* flags stay the shard's: a batch has "cls" where its shards carry labels, as without
        # a subset.
        return ShardMeta(keys=meta.keys[start:stop], txt=meta.txt[start:stop], cls=meta.cls[start:stop],
                         json=meta.json[start:stop], has_txt=meta.has_txt, has_cls=meta.has_cls,
                         has_json=meta.has_json)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = OrderedDict()  # a worker maps its own shards (a pickled memmap is a full copy)
        return state


class SubsetDataset(ShardDataset):
    """``ShardDataset`` over the samples ``keys``/``inputs``/``fraction`` select (see the module
    docstring); every other argument is ``ShardDataset``'s. ``len(ds.snapshot)`` is the subset's size and
    ``ds.snapshot.selected`` its samples' stored indices in the full dataset."""

    def __init__(self, path: str, batch_size: int, *, keys: Iterable[str] | None = None,
                 inputs: Iterable[str] | None = None, fraction: float | None = None,
                 fraction_seed: int = 0, **kwargs: Any) -> None:
        drop_last = bool(kwargs.pop("drop_last", False))
        # Opened whole first (checks, and under DDP the ranks' agreement on the snapshot), then narrowed;
        # drop_last's "at least one full batch" check is the subset's, below.
        super().__init__(path, batch_size, drop_last=False, **kwargs)
        selected = select_samples(self.snapshot, keys=keys, inputs=inputs, fraction=fraction,
                                  fraction_seed=fraction_seed)
        if len(selected) == 0:
            raise ShardError(f"{path}: the subset (keys={keys is not None}, inputs={inputs}, "
                             f"fraction={fraction}) selects no sample")
        self.snapshot = SubsetSnapshot(self.snapshot, selected)
        self.samples = len(self.snapshot)
        self.drop_last = drop_last
        if drop_last and self.samples < batch_size * self.world_size:
            raise ValueError(f"{path}: the subset's {self.samples} samples make no full batch of "
                             f"{batch_size} on each of {self.world_size} ranks, and drop_last=True would "
                             "yield nothing")
