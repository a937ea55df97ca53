"""The epoch order and its split over ranks (numpy only): which samples, in which order, on which rank.

An epoch is a list of contiguous *runs* ``(shard, start, stop)`` over the shards' stored samples; global
batches of ``batch_size`` are cut from it and dealt to the ranks. Positions are places in the epoch order
(0 .. samples-1), the same on every rank and worker for one (seed, epoch). The design and its measured
trade-offs are in docs/reader.md.
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["consumed_position", "epoch_runs", "rank_batches", "run_pieces"]


def epoch_runs(
    counts: np.ndarray, *, shuffle: bool, seed: int, epoch: int, shuffle_window: int, shuffle_block: int
) -> np.ndarray:
    """The epoch order as an R×3 int64 array of runs ``(shard, start, stop)`` (see docs/reader.md).

    ``shuffle=False``: the shards in manifest order. ``shuffle=True``, from
    ``np.random.default_rng([seed, epoch])``: shards permuted, grouped in windows of ``shuffle_window``,
    each shard cut into blocks of ``shuffle_block`` (boundaries shifted by a random per-shard phase), and
    the blocks of each window permuted."""
    counts = np.asarray(counts, dtype=np.int64)
    if not shuffle:
        runs = np.stack([np.arange(len(counts)), np.zeros_like(counts), counts], axis=1)
        return runs[counts > 0]
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
        window = np.concatenate(blocks) if blocks else np.empty((0, 3), np.int64)
        windows.append(window[rng.permutation(len(window))])
    runs = np.concatenate(windows).astype(np.int64) if windows else np.empty((0, 3), np.int64)
    # Blocks that land next to their stored neighbour are one copy, not two.
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


def run_pieces(ends: list[int], runs: list[list[int]], positions: range) -> list[tuple[int, int, int]]:
    """The ``(shard, start, stop)`` slices holding ``positions``; ``ends[i]`` is the epoch position after
    run ``i`` (Python lists: per-piece work is a few operations, not numpy scalar calls)."""
    first = bisect.bisect_right(ends, positions.start)
    last = bisect.bisect_left(ends, positions.stop)
    pieces = []
    for i in range(first, last + 1):
        shard, start, stop = runs[i]
        begin = ends[i] - (stop - start)
        pieces.append((shard, start + max(0, positions.start - begin),
                       start + min(stop - start, positions.stop - begin)))
    return pieces
