"""The epoch order and its split over ranks (numpy only): which samples, in which order, on which rank.

An epoch is a list of contiguous *runs* ``(shard, start, stop)`` over the shards' stored samples; global
batches of ``batch_size`` are cut from it and dealt to the ranks. Positions are places in the epoch order
(0 .. samples-1), the same on every rank and worker for one (seed, epoch). The design and its measured
trade-offs are in docs/reader.md.

Order versions (a resume state records the one its epoch was cut with; a state without one is version 1):

- **2** (``ORDER_VERSION``): ``np.random.default_rng([seed, epoch])`` permutes the shards (O(shards));
  they are split into ``ceil(shards / shuffle_window)`` windows of near-equal size, and window ``i`` is
  cut into blocks with its own stream ``default_rng([seed, epoch, i])``: any window is computable on its
  own, without the windows before it (what a lazy, per-window plan needs).
- **1**: one stream ``default_rng([seed, epoch])`` for everything, windows of exactly ``shuffle_window``
  shards (the last one shorter): shardio's order before version 2, kept so old states resume exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, overload, runtime_checkable

import numpy as np

__all__ = ["DEFAULT_SHUFFLE_BLOCK", "DEFAULT_SHUFFLE_WINDOW", "ORDER_VERSION", "ORDER_VERSIONS", "Deal", "DealtBatches",
           "RankBatches",
           "checked_batches_seen", "consumed_position", "epoch_runs", "epoch_windows", "join_runs", "rank_batches",
           "run_pieces", "window_bounds", "window_runs"]

ORDER_VERSION = 2
ORDER_VERSIONS = (1, 2)
# Measured by ``python -m bench.shuffle`` (docs/reader.md): a dataset of up to 256 shards is shuffled as
# one permutation (batches of 256 from 200 shards of 1,000: 144.5 distinct shards, a permutation's 144.6;
# windows of 8 and blocks of 16, the defaults before: 7.3), and blocks of 1 keep the reader at 0.5 of
# np.copyto and above for 196 KB samples. Larger datasets: each batch draws from one window of 256 shards.
DEFAULT_SHUFFLE_WINDOW = 256
DEFAULT_SHUFFLE_BLOCK = 1

_NO_RUNS = np.empty((0, 3), np.int64)


def epoch_runs(
    counts: np.ndarray, *, shuffle: bool, seed: int, epoch: int, shuffle_window: int, shuffle_block: int,
    order_version: int = ORDER_VERSION,
) -> np.ndarray:
    """The epoch order as an R×3 int64 array of runs ``(shard, start, stop)`` (see docs/reader.md).

    ``shuffle=False``: the shards in manifest order. ``shuffle=True``: shards permuted, grouped in windows
    of about ``shuffle_window`` shards, each shard cut into blocks of ``shuffle_block`` samples (boundaries
    shifted by a random per-shard phase), and the blocks of each window permuted (``order_version``: the
    module docstring)."""
    counts = np.asarray(counts, dtype=np.int64)
    if order_version not in ORDER_VERSIONS:
        raise ValueError(f"order_version {order_version!r} is not one of {ORDER_VERSIONS}")
    if not shuffle:
        runs = np.stack([np.arange(len(counts)), np.zeros_like(counts), counts], axis=1)
        return runs[counts > 0]
    if order_version == 1:
        return join_runs(_epoch_runs_v1(counts, seed, epoch, shuffle_window, shuffle_block))
    windows = epoch_windows(len(counts), seed=seed, epoch=epoch, shuffle_window=shuffle_window)
    runs = [window_runs(counts, shards, seed=seed, epoch=epoch, window=i, shuffle_block=shuffle_block)
            for i, shards in enumerate(windows)]
    return join_runs(np.concatenate(runs)) if runs else _NO_RUNS


def epoch_windows(shards: int, *, seed: int, epoch: int, shuffle_window: int) -> list[np.ndarray]:
    """Order version 2: the shards of each window, in order. ``ceil(shards / shuffle_window)`` windows
    whose sizes differ by at most one, so that the last window is not a sliver that mixes a few shards
    (300 shards in windows of 256: two of 150, not 256 and 44)."""
    order = np.random.default_rng([seed, epoch]).permutation(shards)
    bounds = window_bounds(shards, shuffle_window)
    return [order[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]


def window_bounds(shards: int, shuffle_window: int) -> np.ndarray:
    """Order version 2: where each window starts in the shard permutation, and the end (int64,
    ``ceil(shards / shuffle_window) + 1`` values): window ``i`` is ``order[bounds[i]:bounds[i + 1]]``."""
    count = -(-shards // shuffle_window)
    return np.arange(count + 1, dtype=np.int64) * shards // max(count, 1)


def window_runs(counts: np.ndarray, shards: np.ndarray, *, seed: int, epoch: int, window: int,
                shuffle_block: int) -> np.ndarray:
    """Order version 2: the runs of window number ``window`` holding ``shards`` (from ``epoch_windows``),
    from its own stream ``default_rng([seed, epoch, window])``: each shard cut into blocks of
    ``shuffle_block`` (the first one shortened by a random phase), the window's blocks permuted."""
    rng = np.random.default_rng([seed, epoch, window])
    shards = shards[counts[shards] > 0]
    sizes = counts[shards]
    phase = rng.integers(0, np.minimum(shuffle_block, sizes))  # one draw per shard, 0 when the block is 1
    blocks = -(-(sizes - phase) // shuffle_block) + (phase > 0)
    first = np.cumsum(blocks) - blocks
    k = np.arange(int(blocks.sum())) - np.repeat(first, blocks)  # block number within its shard
    shift = np.repeat(np.where(phase > 0, phase - shuffle_block, 0), blocks)
    starts = np.maximum(k * shuffle_block + shift, 0)
    stops = np.minimum((k + 1) * shuffle_block + shift, np.repeat(sizes, blocks))
    runs = np.stack([np.repeat(shards, blocks), starts, stops], axis=1)
    # np.take gathers the same rows as runs[permutation], 4x faster (256k runs: 1.0 ms against 4.1)
    return np.take(runs, rng.permutation(len(runs)), axis=0)


def _epoch_runs_v1(counts: np.ndarray, seed: int, epoch: int, shuffle_window: int,
                   shuffle_block: int) -> np.ndarray:
    """Order version 1, unchanged: one stream, windows of ``shuffle_window`` shards in a row."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(counts))
    windows = []
    for first in range(0, len(order), shuffle_window):
        blocks = []
        for shard in order[first : first + shuffle_window]:
            count = int(counts[shard])
            if count == 0:
                continue
            phase = int(rng.integers(0, min(shuffle_block, count)))
            starts = np.arange(phase, count, shuffle_block)
            starts = np.concatenate([[0], starts]) if phase else starts
            stops = np.append(starts[1:], count)
            blocks.append(np.stack([np.full_like(starts, shard), starts, stops], axis=1))
        window = np.concatenate(blocks) if blocks else _NO_RUNS
        windows.append(window[rng.permutation(len(window))])
    return np.concatenate(windows).astype(np.int64) if windows else _NO_RUNS


def join_runs(runs: np.ndarray) -> np.ndarray:
    """Blocks that land next to their stored neighbour are one copy, not two (the order is unchanged)."""
    if len(runs) == 0:
        return _NO_RUNS
    joined = (runs[1:, 0] == runs[:-1, 0]) & (runs[1:, 1] == runs[:-1, 2])
    head = np.flatnonzero(np.concatenate([[True], ~joined]))
    tail = np.append(head[1:], len(runs)) - 1
    return np.stack([runs[head, 0], runs[head, 1], runs[tail, 2]], axis=1)


@runtime_checkable
class DealtBatches(Protocol):
    """A pass's batches as one rank's deal of them (``RankBatches``, ``BucketRankBatches``), or a DataLoader
    worker's share of it: what lets the shard cache plan the batches the ranks sharing its directory read."""

    @property
    def steps(self) -> range:
        """The step of the pass (0: its first batch on every rank) of each batch held: a worker's share's."""

    def of_rank(self, rank: int) -> Sequence[range]:
        """The whole pass as dealt to ``rank`` (every rank has as many batches)."""


class RankBatches(Sequence[range]):
    """This rank's batches of an epoch (``rank_batches``), each a range of epoch positions, computed on
    demand: a few ints whatever the epoch's size (LAION-2B at 256 a batch on 64 ranks: 140k batches a
    rank, which a list of ranges held as ~8 MB). Slices are views too (a DataLoader worker's share,
    ``batches[worker::workers]``), so an ``EpochPass`` pickles in bytes."""

    def __init__(self, samples: int, batch_size: int, rank: int, world_size: int, drop_last: bool,
                 start: int = 0, indices: range | None = None) -> None:
        self._args = (samples, batch_size, rank, world_size, drop_last, start)
        left = samples - start
        per_round = batch_size * world_size
        self._full = left // per_round  # full batches: every rank gets one per round
        self._first = start + rank * batch_size
        self._stride = per_round
        self._batch_size = batch_size
        self._tail: range | None = None
        rest = left - self._full * per_round
        if rest and not drop_last:
            base, extra = divmod(rest, world_size)
            if base == 0 and rank >= rest:  # nothing left for this rank: repeat one of the first samples
                repeat = start + (rank - rest) % left  # the modulo only matters with fewer samples than ranks
                self._tail = range(repeat, repeat + 1)
            else:
                first = start + self._full * per_round + rank * base + min(rank, extra)
                self._tail = range(first, first + base + (rank < extra))
        whole = range(self._full + (self._tail is not None))
        self._indices = whole if indices is None else indices

    def _batch(self, number: int) -> range:
        if number < self._full:
            first = self._first + number * self._stride
            return range(first, first + self._batch_size)
        if self._tail is None:  # unreachable through __getitem__: indices stop at the full rounds
            raise IndexError(number)
        return self._tail

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, index: int) -> range: ...
    @overload
    def __getitem__(self, index: slice) -> RankBatches: ...
    def __getitem__(self, index: int | slice) -> range | RankBatches:
        if isinstance(index, slice):
            return RankBatches(*self._args, indices=self._indices[index])
        return self._batch(self._indices[index])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    @property
    def steps(self) -> range:
        """The pass's step of each batch held (``DealtBatches``)."""
        return self._indices

    def of_rank(self, rank: int) -> RankBatches:
        """The whole pass as dealt to ``rank`` (``DealtBatches``)."""
        samples, batch_size, _, world_size, drop_last, start = self._args
        return RankBatches(samples, batch_size, rank, world_size, drop_last, start)

    def __repr__(self) -> str:
        return f"RankBatches({len(self)} batches: {list(self[:3])}{'...' if len(self) > 3 else ''})"


def rank_batches(samples: int, batch_size: int, rank: int, world_size: int, drop_last: bool,
                 start: int = 0) -> RankBatches:
    """This rank's batches of the epoch positions ``start .. samples-1``, each a range of positions.

    Global batches are dealt round robin (rank ``r`` gets ``r, r + W, ...``); the rest ``R`` after the
    full rounds is dropped (``drop_last``) or split into one smaller batch per rank, sizes differing by at
    most one, ranks that would get nothing repeating one of the first positions: every rank gets the same
    number of batches, so DDP never waits. ``start > 0`` is a resumed epoch: the same rule over what is left.
    """
    return RankBatches(samples, batch_size, rank, world_size, drop_last, start)


def consumed_position(samples: int, batch_size: int, world_size: int, start: int, batches_each: int) -> int:
    """The epoch position before which every sample was handed out, once each of ``world_size`` ranks has
    taken ``batches_each`` of its batches from ``start`` (ranks step in lockstep under DDP). Past the full
    rounds every rank has had its share of the rest: the epoch is done (``samples``)."""
    full_rounds = (samples - start) // (batch_size * world_size)
    if batches_each <= full_rounds:
        return start + batches_each * batch_size * world_size
    return samples


@dataclass(frozen=True)
class Deal:
    """How an epoch is dealt out: batches of ``batch_size`` to ``rank`` of ``world_size`` ranks, the rest
    dropped or split (``drop_last``), and the order's ``shuffle`` and ``seed`` (a bucketed epoch's rounds
    are shuffled by them too)."""

    batch_size: int
    rank: int
    world_size: int
    drop_last: bool
    shuffle: bool = False
    seed: int = 0

    @property
    def per_round(self) -> int:
        """Samples of one step of the whole job: a batch on every rank."""
        return self.batch_size * self.world_size


def checked_batches_seen(batches_seen: int, full: int) -> int:
    """A state's ``batches_seen``, refused outside a rank's ``0..full`` batches of its epoch."""
    if not 0 <= batches_seen <= full:
        raise ValueError(f"batches_seen={batches_seen} is outside a rank's 0..{full} of that epoch")
    return batches_seen


def run_pieces(ends: np.ndarray, runs: np.ndarray, positions: range) -> list[tuple[int, int, int]]:
    """The ``(shard, start, stop)`` slices holding ``positions``; ``ends[i]`` is the epoch position after
    run ``i``. Vectorised per batch: with blocks of 1 a batch of 256 is 256 runs, and numpy arrays keep
    the plan at 32 bytes a run where Python lists took ~150."""
    first = int(np.searchsorted(ends, positions.start, side="right"))
    last = int(np.searchsorted(ends, positions.stop, side="left"))
    chunk, chunk_ends = runs[first : last + 1], ends[first : last + 1]
    lengths = chunk[:, 2] - chunk[:, 1]
    begins = chunk_ends - lengths
    starts = chunk[:, 1] + np.maximum(0, positions.start - begins)
    stops = chunk[:, 1] + np.minimum(lengths, positions.stop - begins)
    return list(zip(chunk[:, 0].tolist(), starts.tolist(), stops.tolist()))
