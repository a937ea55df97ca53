"""How a ``ShardDataset`` on object storage reads through its shard cache: the shuffle window that fits
it (``fitting_window``) and the batch assembler whose memory maps give way to it (``CachedAssembler``).
The cache itself is ``shardio.read.cache.shard_cache``, made with its defaults by ``shardio.read.cache.cache_setup``;
its directory ``shardio.read.cache.cache_dir``.
"""

from __future__ import annotations

import operator
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, overload

import numpy as np
import torch
from torch.utils.data import get_worker_info

from shardio.read.batches import FIELDS, Batch, BatchAssembler
from shardio.read.cache.cache_dir import cache_key
from shardio.read.cache.cache_group import CacheGroup, NodeSteps, hold_after, node_reads
from shardio.read.cache.group_positions import GroupPositions
from shardio.read.layout import EpochOrder, Layout
from shardio.read.snapshot import DatasetSnapshot, ShardMeta
from shardio.read.selection import SubsetSnapshot
from shardio.read.cache.shard_cache import ShardCache
from shardio.read.yuv_pixels import YuvPlanes

__all__ = ["CachedAssembler", "PassShards", "cache_units", "fitting_window"]

_first = operator.itemgetter(0)  # a piece's shard


def cache_units(snapshot: DatasetSnapshot) -> Sequence[int]:
    """Each snapshot shard's index in its cache: itself, or for a subset the parent shard of a segment (a range or
    a column: no object a shard, at millions of shards)."""
    if isinstance(snapshot, SubsetSnapshot):
        return snapshot.segments[:, 0]
    return range(len(snapshot.shards))


def fitting_window(shuffle_window: int, defaulted: bool, cache: ShardCache, dataset: str, buckets: int = 1,
                   in_flight: int = 0) -> int:
    """The shuffle window to use with ``cache`` for the dataset at ``dataset`` (the URL its warnings
    name). A shuffled pass reads every batch from about the shards of one window (order version 2 with blocks
    of 1: 162 of 256 shards in a batch of 256), and a batch across a window's end from two, so two windows
    must fit on disk at once (which also lets the next window download while this one is read), or the pass is
    refused or downloads shards again and again. The default window is clamped to what fits, with a warning; a
    window the caller chose is kept, with one. The processes of a cache directory's group, ranks and workers, plan
    the same batches and hold the same files, each within the whole limit (``shardio.read.cache.cache_group``), and
    read several steps of a batch on every rank at once: ``in_flight`` shards more (``shards_in_flight``), so a
    process ahead of the group seldom waits for room. A bucketed dataset's
    ``buckets`` (those with samples) take turns, each reading its own window: two windows of each must fit. A
    cache that holds the whole dataset (the default ``cache_limit`` is its size) needs no room for windows:
    every shard stays once downloaded, so the window is kept, and a dataset smaller than two windows reads in
    the order of its local copy."""
    dataset_bytes = cache.dataset_bytes
    if dataset_bytes <= cache.limit:
        return shuffle_window
    largest = cache.largest_sizes[0]
    fits = max(1, (cache.limit // largest - in_flight) // (2 * buckets))
    need = min(min(2 * shuffle_window * buckets + in_flight, len(cache.units)) * largest, dataset_bytes)
    if need <= cache.limit:
        return shuffle_window
    where = dataset
    each = f" for each of {buckets} buckets" if buckets > 1 else ""
    group = f" and {in_flight} shards for the steps its ranks read at once" if in_flight else ""
    if defaulted:
        warnings.warn(f"{where}: cache_limit {cache.limit} bytes holds two windows of {fits} shards of up to "
                      f"{largest} bytes{each}{group}, not of the default {shuffle_window} ({need} bytes): using "
                      f"shuffle_window={fits}, so batches mix fewer shards (docs/reader.md); raise cache_limit "
                      f"to {need} or pass shuffle_window={fits} to silence this", stacklevel=3)
        return fits
    warnings.warn(f"{where}: shuffle_window={shuffle_window} needs {need} bytes of cache (two windows of "
                  f"shards of up to {largest} bytes{each}{group}), cache_limit is {cache.limit}: shards will be "
                  f"downloaded more than once an epoch; raise cache_limit or lower shuffle_window to {fits}",
                  stacklevel=3)
    return shuffle_window


class PassShards(Sequence[list[int]]):
    """The steps of a pass as the cache plans them, computed when asked: step ``k``'s cache units (every group
    rank's batch of the step, ``NodeSteps``), each once, in their first read's order. The order's windows are made
    by one thread at a time: the cache grows its plan from its download threads while the reader takes its own
    batches' pieces (``pieces``) from the same order."""

    def __init__(self, node: NodeSteps, plan: EpochOrder, unit_of: Sequence[int]) -> None:
        self.node, self.plan, self.unit_of = node, plan, unit_of
        self._identity = isinstance(unit_of, range) and unit_of == range(len(unit_of))
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.node)

    @overload
    def __getitem__(self, index: int) -> list[int]: ...
    @overload
    def __getitem__(self, index: slice) -> list[list[int]]: ...
    def __getitem__(self, index: int | slice) -> list[int] | list[list[int]]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        shards: list[int] = []
        with self._lock:
            for positions in self.node[index]:
                shards += map(_first, self.plan.pieces(positions))
        if not self._identity:  # a subset's: its segments' parent shards
            shards = [int(self.unit_of[shard]) for shard in shards]
        return list(dict.fromkeys(shards))

    def pieces(self, positions: range) -> list[tuple[int, int, int]]:
        """The ``(shard, start, stop)`` pieces of this process's batch at ``positions``."""
        with self._lock:
            return self.plan.pieces(positions)


class CachedAssembler(BatchAssembler):
    """A ``BatchAssembler`` whose memory maps give way to the cache: before each shard (and while the
    reader waits for room) it drops its maps of files the cache wants to evict, so a doomed file is
    removed as soon as no batch is being assembled from it (its bytes count against the limit until
    then). A batch of one slice is copied (into a reused buffer), not handed out as a view of the map: a
    view would keep the cached file's blocks on disk for as long as the program keeps the batch (a
    ``list(ds)`` would hold every shard), and the limit could not be kept; an encoded batch's JPEG bytes
    (a yuv420 batch's planes, a model output's rows, of one slice) are copied out for the same reason. The
    pinned (CUDA) and worker paths copy anyway."""

    def __init__(self, snapshot: DatasetSnapshot, cache: ShardCache, cache_shards: int, buffers: int = 4,
                 fields: tuple[str, ...] = FIELDS, batch_size: int = 0, *, layout: Layout,
                 threads: int | None = None, group: CacheGroup | None = None, lag_steps: int = 4) -> None:
        super().__init__(snapshot, cache_shards, buffers, fields, batch_size, layout=layout, threads=threads)
        self.shard_cache = cache
        self.group = CacheGroup.alone(0) if group is None else group  # the processes planning with this one
        # How many steps another process of the group may read behind this one: under DDP the ranks are in one
        # step, and each assembles ``prefetch`` batches ahead of it (a DataLoader worker: its share of the steps).
        self.lag_steps = lag_steps
        self._group_positions: tuple[tuple[int, int], GroupPositions | None] | None = None
        self._seen_dooms = 0
        cache.on_wait = self.release_doomed

    def batches(self, plan: EpochOrder, batches: Sequence[range], shared: bool, pinned: bool,
                encoded: bool = False, *, pass_id: tuple[int, int] = (0, 0)) -> Iterator[Batch]:
        """The batches, the cache given the exact access sequence (downloads ahead, Belady): the shards of every
        batch the processes of this directory's group read in the pass (``shardio.read.cache.cache_group``: the ranks
        sharing it, their workers), step by step, so they all hold the same files; the cache plans them a horizon
        ahead (``shardio.read.cache.cache_plan``) and advances a step at a time."""
        cache = self.shard_cache
        node, steps = node_reads(batches, self.group)
        shards = PassShards(node, plan, cache_units(self.snapshot))
        worker = get_worker_info()
        spread = 1 if worker is None else worker.num_workers  # a rank's workers read its steps in turn
        alone = len(self.group.ranks) == 1 and spread == 1
        # One process of the group downloads ahead with the whole limit: the first rank's (its first worker)
        lead = self.group.index == 0 and (worker is None or worker.id == 0)
        positions = None if alone else self._positions(spread, 0 if worker is None else worker.id)
        if positions is not None:
            positions.begin(*pass_id)
        cache.plan(shards, behind=0 if alone else self.lag_steps * spread, lead=lead, positions=positions,
                   hold_after=hold_after(spread))
        for step, batch in zip(steps, batches):
            cache.advance(step)
            self.release_read()
            yield self.assemble(shards.pieces(batch), shared, pinned, encoded)

    def _positions(self, spread: int, worker: int) -> GroupPositions | None:
        """This process's slot in its group's positions file (each rank's workers after one another); None where
        the directory cannot take the file (another user's, read-only): the group then plans with ``lag_steps``."""
        key = (spread, worker)
        if self._group_positions is None or self._group_positions[0] != key:
            try:
                found = GroupPositions(self.shard_cache.cache_dir, self.group.name, len(self.group.ranks) * spread,
                                       self.group.index * spread + worker)
            except OSError:
                found = None
            self._group_positions = (key, found)
        return self._group_positions[1]

    def _open(self, shard: int) -> tuple[Any, ShardMeta, Any]:
        # Every way to a shard's map (``shard``, ``assemble``) comes here: maps of doomed files go first.
        if self.shard_cache.dooms != self._seen_dooms:
            self.release_doomed()
        return super()._open(shard)

    def assemble(self, pieces: list[tuple[int, int, int]], shared: bool, pinned: bool,
                 encoded: bool = False) -> dict[str, Any]:
        batch = super().assemble(pieces, shared, pinned, encoded)
        one_view = len(pieces) == 1 and not shared and not pinned
        if one_view:  # each model output of one slice is a view of its map too: copied out for the same reason
            for output in self.snapshot.outputs:
                batch[output.name] = batch[output.name].clone()
        if "image" not in batch:  # a dataset without pixels (``encoding: none``)
            return batch
        if isinstance(batch["image"], YuvPlanes):  # a yuv420 batch's planes: a view only for one slice
            planes = batch["image"]
            if one_view:
                copy = torch.from_numpy(self.buffers.take(tuple(planes.planes.shape)))
                copy.copy_(planes.planes)
                batch["image"] = replace(planes, planes=copy)
            return batch
        if encoded:  # the JPEG bytes copied out of the maps too (a few MB a batch), for the same reason
            images = batch["image"]
            flat = np.concatenate(images.jpegs) if len(images) else np.empty(0, np.uint8)
            bounds = np.cumsum([0] + [len(jpeg) for jpeg in images.jpegs]).tolist()
            batch["image"] = replace(images, jpegs=[flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
            return batch
        if one_view:  # the one case BatchAssembler gives a view
            view = batch["image"]
            image = torch.from_numpy(self.buffers.take(tuple(view.shape)))
            image.copy_(view)
            batch["image"] = image
        return batch

    def release_read(self) -> None:
        """Let go of the maps of shards this pass reads no more (``ShardCache.read_no_more``): their room is the
        next window's to take while this batch is assembled (decoded), not after."""
        finished = self.shard_cache.read_no_more({cache_key(self.snapshot.shards[s]) for s in self.cache})
        if finished:
            self._let_go(finished)

    def release_doomed(self) -> None:
        self._seen_dooms = self.shard_cache.dooms
        self._let_go(self.shard_cache.doomed())

    def _let_go(self, keys: set[str]) -> None:
        """Drop every map this assembler keeps of the units with these cache keys (all the shards, or a subset's
        segments, that share one), and tell the cache, which counts their room free at once."""
        for shard in [s for s in self.cache if cache_key(self.snapshot.shards[s]) in keys]:
            del self.cache[shard]
            self.output_maps.pop(shard, None)  # its model outputs' maps hold the unit as its pixels' do
        if isinstance(self.snapshot, SubsetSnapshot):  # it keeps maps of the parent's shards too
            self.snapshot.forget(keys)
        self.shard_cache.maps_dropped()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_group_positions"] = None  # each process maps the file itself
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.shard_cache.on_wait = self.release_doomed  # a worker's own cache (pickled afresh)
