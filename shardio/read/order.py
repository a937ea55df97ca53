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

import numpy as np

__all__ = ["DEFAULT_SHUFFLE_BLOCK", "DEFAULT_SHUFFLE_WINDOW", "ORDER_VERSION", "ORDER_VERSIONS",
           "consumed_position", "epoch_runs", "epoch_windows", "rank_batches", "run_pieces", "window_runs"]

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
        return _join(_epoch_runs_v1(counts, seed, epoch, shuffle_window, shuffle_block))
    windows = epoch_windows(len(counts), seed=seed, epoch=epoch, shuffle_window=shuffle_window)
    runs = [window_runs(counts, shards, seed=seed, epoch=epoch, window=i, shuffle_block=shuffle_block)
            for i, shards in enumerate(windows)]
    return _join(np.concatenate(runs)) if runs else _NO_RUNS


def epoch_windows(shards: int, *, seed: int, epoch: int, shuffle_window: int) -> list[np.ndarray]:
    """Order version 2: the shards of each window, in order. ``ceil(shards / shuffle_window)`` windows
    whose sizes differ by at most one, so that the last window is not a sliver that mixes a few shards
    (300 shards in windows of 256: two of 150, not 256 and 44)."""
    order = np.random.default_rng([seed, epoch]).permutation(shards)
    count = -(-shards // shuffle_window)
    bounds = [i * shards // count for i in range(count + 1)]
    return [order[bounds[i] : bounds[i + 1]] for i in range(count)]


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
    return runs[rng.permutation(len(runs))]


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


def _join(runs: np.ndarray) -> np.ndarray:
    """Blocks that land next to their stored neighbour are one copy, not two (the order is unchanged)."""
    if len(runs) == 0:
        return _NO_RUNS
    joined = (runs[1:, 0] == runs[:-1, 0]) & (runs[1:, 1] == runs[:-1, 2])
    head = np.flatnonzero(np.concatenate([[True], ~joined]))
    tail = np.append(head[1:], len(runs)) - 1
    return np.stack([runs[head, 0], runs[head, 1], runs[tail, 2]], axis=1)


def rank_batches(samples: int, batch_size: int, rank: int, world_size: int, drop_last: bool,
                 start: int = 0) -> list[range]:
    """This rank's batches of the epoch positions ``start .. samples-1``, each a range of positions.

    Global batches are dealt round robin (rank ``r`` gets ``r, r + W, ...``); the rest ``R`` after the
    full rounds is dropped (``drop_last``) or split into one smaller batch per rank, sizes differing by at
    most one, ranks that would get nothing repeating one of the first positions: every rank gets the same
    number of batches, so DDP never waits. ``start > 0`` is a resumed epoch: the same rule over what is left.
    """
    left = samples - start
    per_round = batch_size * world_size
    full_rounds = left // per_round
    batches = [
        range(start + g * batch_size, start + (g + 1) * batch_size)
        for g in range(rank, full_rounds * world_size, world_size)
    ]
    rest = left - full_rounds * per_round
    if rest and not drop_last:
        base, extra = divmod(rest, world_size)
        if base == 0 and rank >= rest:  # nothing left for this rank: repeat one of the first samples
            repeat = start + (rank - rest) % left  # the modulo only matters with fewer samples than ranks
            batches.append(range(repeat, repeat + 1))
        else:
            first = start + full_rounds * per_round + rank * base + min(rank, extra)
            batches.append(range(first, first + base + (rank < extra)))
    return batches


def consumed_position(samples: int, batch_size: int, world_size: int, start: int, batches_each: int) -> int:
    """The epoch position before which every sample was handed out, once each of ``world_size`` ranks has
    taken ``batches_each`` of its batches from ``start`` (ranks step in lockstep under DDP). Past the full
    rounds every rank has had its share of the rest: the epoch is done (``samples``)."""
    full_rounds = (samples - start) // (batch_size * world_size)
    if batches_each <= full_rounds:
        return start + batches_each * batch_size * world_size
    return samples


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
