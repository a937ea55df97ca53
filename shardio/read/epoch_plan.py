"""The epoch plan, computed lazily: a batch's ``(shard, start, stop)`` pieces, window by window on demand.

``shardio.read.order.epoch_runs`` writes the whole epoch down: with blocks of 1 that is one run per
sample, 24 bytes each (26M runs and 2.85 GB RSS for one rank at 410k shards of 1,000 samples). A rank
reads its batches in position order, and order version 2 makes each window computable on its own
(``default_rng([seed, epoch, window])`` after the shard permutation), so ``EpochPlan`` keeps only

- the shard permutation of ``default_rng([seed, epoch])`` (8 bytes a shard: 18 MB at 2.3M shards), and
- the epoch position where each window starts (8 bytes a window),

and builds a window's runs when a batch first reaches into it, keeping the last ``KEPT_WINDOWS`` (a batch
spans at most two windows when a window holds at least a batch; smaller windows are just rebuilt). The
pieces are exactly ``run_pieces`` over ``epoch_runs`` (``tests/test_epoch_plan.py`` checks it over random
layouts): runs are joined within a window only, and joins never cross windows, whose shards differ.

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
    window_runs,
)

__all__ = ["KEPT_WINDOWS", "EpochPlan"]

# Windows whose runs stay built: the one a batch ends in and the one before it (a batch straddling a
# window boundary). 256 shards of 1,000 samples: 256k runs, 6 MB each (plus ~25 MB while one is built).
KEPT_WINDOWS = 2

Piece = tuple[int, int, int]


class EpochPlan:
    """One epoch's order for ``counts`` (samples per shard) under ``(seed, epoch)`` and the order settings
    (``shardio.read.order``); ``pieces(positions)`` gives the slices holding a range of epoch positions.
    Memory: O(shards) plus ``KEPT_WINDOWS`` windows' runs, whatever the number of samples."""

    def __init__(self, counts: np.ndarray, *, shuffle: bool, seed: int, epoch: int, shuffle_window: int,
                 shuffle_block: int, order_version: int) -> None:
        if order_version not in ORDER_VERSIONS:
            raise ValueError(f"order_version {order_version!r} is not one of {ORDER_VERSIONS}")
        self.counts = np.asarray(counts, dtype=np.int64)
        self.samples = int(self.counts.sum())
        self.seed, self.epoch, self.shuffle_block = int(seed), int(epoch), int(shuffle_block)
        self._kept: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
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
            self._kept[0] = (runs, np.cumsum(runs[:, 2] - runs[:, 1]))
            self._starts = np.array([0, self.samples], dtype=np.int64)

    @property
    def windows(self) -> int:
        """Windows of the epoch (1 for an eager plan)."""
        return len(self._starts) - 1

    def window(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Window ``index``'s runs ``(shard, start, stop)`` and the position after each, counted from the
        window's start (built now unless kept)."""
        kept = self._kept.get(index)
        if kept is not None:
            self._kept.move_to_end(index)
            return kept
        if not self.lazy or not 0 <= index < self.windows:
            raise IndexError(f"window {index} is not one of this plan's {self.windows}")
        shards = self._order[self._shard_bounds[index] : self._shard_bounds[index + 1]]
        runs = join_runs(window_runs(self.counts, shards, seed=self.seed, epoch=self.epoch, window=index,
                                     shuffle_block=self.shuffle_block))
        kept = (runs, np.cumsum(runs[:, 2] - runs[:, 1]))
        self.windows_built += 1
        self._kept[index] = kept
        while len(self._kept) > KEPT_WINDOWS:
            self._kept.popitem(last=False)
        return kept

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
            runs, ends = self.window(index)
            local = range(max(positions.start, begin) - begin, min(positions.stop, end) - begin)
            pieces.extend(run_pieces(ends, runs, local))
        return pieces

    def runs(self) -> np.ndarray:
        """The whole epoch's runs (what ``epoch_runs`` returns), window after window: per sample, for
        tests and measurements of small datasets."""
        if not self.lazy:
            return self._kept[0][0]
        built = [self.window(i)[0] for i in range(self.windows)]
        return join_runs(np.concatenate(built)) if built else np.empty((0, 3), np.int64)
