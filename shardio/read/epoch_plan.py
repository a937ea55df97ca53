"""The epoch plan, computed lazily: a batch's ``(shard, start, stop)`` pieces, window by window on demand.

``shardio.read.order.epoch_runs`` writes the whole epoch down: with blocks of 1 that is one run per
sample, 24 bytes each (26M runs and 2.85 GB RSS for one rank at 410k shards of 1,000 samples). A rank
reads its batches in position order, and order version 2 makes each window computable on its own
(``default_rng([seed, epoch, window])`` after the shard permutation), so ``EpochPlan`` keeps only

- the shard permutation of ``default_rng([seed, epoch])`` (8 bytes a shard: 18 MB at 2.3M shards), and
- the epoch position where each window starts (8 bytes a window),

and makes a window when a batch first reaches into it, keeping the last ``KEPT_WINDOWS`` (a batch spans at
most two windows when a window holds at least a batch; smaller windows are just made again). A window
(``_Window``) is its block permutation (8 bytes a block: 2 MB for 256 shards of 1,000) and per-shard
arrays; a batch gathers only its own blocks. The pieces are exactly ``run_pieces`` over ``epoch_runs``
(``tests/read/test_epoch_plan.py`` checks it over random layouts): joining runs within a batch's range is
joining them in the whole epoch, since a join never crosses a window (their shards differ) and
``run_pieces`` cuts at the range's ends anyway.

Unshuffled orders are one run per shard (O(shards) already) and order version 1 draws every window from one
stream, so window ``i`` needs all the draws before it: both stay eager, behind the same interface. Version
1 is only for resuming states saved before version 2; its plan is per sample, as it always was.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from shardio.read.order import (
    ORDER_VERSIONS,
    epoch_runs,
    join_runs,
    run_pieces,
    window_bounds,
)

__all__ = ["KEPT_WINDOWS", "EpochPlan"]

# Windows kept made: the one a batch ends in and the one before it (a batch straddling a window boundary).
# 256 shards of 1,000 samples: a 2 MB block permutation each (blocks of 16: 16k blocks, 256 KB + ends).
KEPT_WINDOWS = 2

Piece = tuple[int, int, int]


class _Window:
    """One window of order version 2 without its runs written down: the block permutation of its stream
    (8 bytes a block) and, per shard, where its blocks begin. A range of the window's positions becomes
    runs by gathering just those blocks, so a rank that reads 1/64 of a window pays its permutation
    (256k blocks: ~2.5 ms) and its own rows, not the 256k runs (``window_runs``: ~15 ms, 6 MB)."""

    def __init__(self, counts: np.ndarray, shards: np.ndarray, *, seed: int, epoch: int, window: int,
                 shuffle_block: int) -> None:
        # The same draws, in the same order, as ``shardio.read.order.window_runs`` (the reference).
        rng = np.random.default_rng([seed, epoch, window])
        self.shards = shards[counts[shards] > 0]
        self.sizes = counts[self.shards]
        self.block = shuffle_block
        phase = rng.integers(0, np.minimum(shuffle_block, self.sizes))  # 0 for every shard when blocks are 1
        blocks = -(-(self.sizes - phase) // shuffle_block) + (phase > 0)
        self.first = np.cumsum(blocks) - blocks  # block number of each shard's first block
        self.shift = np.where(phase > 0, phase - shuffle_block, 0)
        self.order = rng.permutation(int(blocks.sum()))  # the block at each place of the window
        # Window position after each place: blocks of 1 are one sample each (no array needed).
        self.ends: np.ndarray | None = None
        if shuffle_block > 1:
            runs = self._runs(self.order)
            self.ends = np.cumsum(runs[:, 2] - runs[:, 1])

    def _runs(self, block_ids: np.ndarray) -> np.ndarray:
        """``(shard, start, stop)`` of each block number, as ``window_runs`` cuts them."""
        owner = np.searchsorted(self.first, block_ids, side="right") - 1
        k = block_ids - self.first[owner]
        shift = self.shift[owner]
        starts = np.maximum(k * self.block + shift, 0)
        stops = np.minimum((k + 1) * self.block + shift, self.sizes[owner])
        return np.stack([self.shards[owner], starts, stops], axis=1)

    def pieces(self, positions: range) -> list[Piece]:
        """The slices holding the window's ``positions`` (counted from the window's start), joined where a
        block lands next to its stored neighbour, as ``run_pieces`` over the joined window would cut them."""
        if self.ends is None:
            runs = self._runs(self.order[positions.start : positions.stop])
        else:
            ends = self.ends
            first = int(np.searchsorted(ends, positions.start, side="right"))
            last = int(np.searchsorted(ends, positions.stop, side="left"))
            runs = self._runs(self.order[first : last + 1])
            runs[0, 1] += positions.start - (int(ends[first]) - int(runs[0, 2] - runs[0, 1]))
            runs[-1, 2] -= int(ends[last]) - positions.stop
        runs = join_runs(runs)
        return list(zip(runs[:, 0].tolist(), runs[:, 1].tolist(), runs[:, 2].tolist()))

    def runs(self) -> np.ndarray:
        return join_runs(self._runs(self.order))


class _Written:
    """An order written down whole (unshuffled: a run per shard; version 1), behind ``_Window``'s face."""

    def __init__(self, runs: np.ndarray) -> None:
        self._runs, self._ends = runs, np.cumsum(runs[:, 2] - runs[:, 1])

    def pieces(self, positions: range) -> list[Piece]:
        return run_pieces(self._ends, self._runs, positions)

    def runs(self) -> np.ndarray:
        return self._runs


class EpochPlan:
    """One epoch's order for ``counts`` (samples per shard) under ``(seed, epoch)`` and the order settings
    (``shardio.read.order``); ``pieces(positions)`` gives the slices holding a range of epoch positions.
    Memory: O(shards) plus ``KEPT_WINDOWS`` windows' block permutations, whatever the number of samples."""

    def __init__(self, counts: np.ndarray, *, shuffle: bool, seed: int, epoch: int, shuffle_window: int,
                 shuffle_block: int, order_version: int) -> None:
        if order_version not in ORDER_VERSIONS:
            raise ValueError(f"order_version {order_version!r} is not one of {ORDER_VERSIONS}")
        self.counts = np.asarray(counts, dtype=np.int64)
        self.samples = int(self.counts.sum())
        self.seed, self.epoch, self.shuffle_block = int(seed), int(epoch), int(shuffle_block)
        self._kept: OrderedDict[int, _Window | _Written] = OrderedDict()
        self.windows_built = 0  # how many times a window's runs were computed (for tests and benchmarks)
        if shuffle and order_version == 2:
            self.lazy = True
            self._order = np.random.default_rng([seed, epoch]).permutation(len(self.counts))
            self._shard_bounds = window_bounds(len(self.counts), shuffle_window)
            in_order = np.concatenate([[0], np.cumsum(self.counts[self._order])])
            self._starts = in_order[self._shard_bounds]  # epoch position of each window's start, and the end
        else:
            self.lazy = False
            runs = epoch_runs(self.counts, shuffle=shuffle, seed=seed, epoch=epoch,
                              shuffle_window=shuffle_window, shuffle_block=shuffle_block,
                              order_version=order_version)
            self._kept[0] = _Written(runs)
            self._starts = np.array([0, self.samples], dtype=np.int64)

    @property
    def windows(self) -> int:
        """Windows of the epoch (1 for an eager plan)."""
        return len(self._starts) - 1

    def window(self, index: int) -> _Window | _Written:
        """Window ``index`` (made now unless kept)."""
        kept = self._kept.get(index)
        if kept is not None:
            self._kept.move_to_end(index)
            return kept
        if not self.lazy or not 0 <= index < self.windows:
            raise IndexError(f"window {index} is not one of this plan's {self.windows}")
        shards = self._order[self._shard_bounds[index] : self._shard_bounds[index + 1]]
        made = _Window(self.counts, shards, seed=self.seed, epoch=self.epoch, window=index,
                       shuffle_block=self.shuffle_block)
        self.windows_built += 1
        self._kept[index] = made
        while len(self._kept) > KEPT_WINDOWS:
            self._kept.popitem(last=False)
        return made

    def pieces(self, positions: range) -> list[Piece]:
        """The ``(shard, start, stop)`` slices holding epoch ``positions``, in order: the same as
        ``run_pieces`` over the whole epoch's runs."""
        if not 0 <= positions.start <= positions.stop <= self.samples:
            raise ValueError(f"positions {positions} are outside the epoch's 0..{self.samples}")
        if positions.start == positions.stop:
            return []
        first = int(np.searchsorted(self._starts, positions.start, side="right")) - 1
        last = int(np.searchsorted(self._starts, positions.stop, side="left")) - 1
        pieces: list[Piece] = []
        for index in range(first, last + 1):
            begin, end = int(self._starts[index]), int(self._starts[index + 1])
            if begin == end:  # a window of empty shards
                continue
            local = range(max(positions.start, begin) - begin, min(positions.stop, end) - begin)
            pieces.extend(self.window(index).pieces(local))
        return pieces

    def runs(self) -> np.ndarray:
        """The whole epoch's runs (what ``epoch_runs`` returns), window after window: per sample, for
        tests and measurements of small datasets."""
        if not self.lazy:
            return self._kept[0].runs()
        built = [self.window(i).runs() for i in range(self.windows)]
        return join_runs(np.concatenate(built)) if built else np.empty((0, 3), np.int64)
