"""The lazy epoch plan (``shardio.read.epoch_plan``) gives exactly the eager plan's pieces, and holds only
O(shards) plus two windows, over many random layouts (loops with fixed seeds, no timing)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from shardio.read.epoch_plan import KEPT_WINDOWS, EpochPlan
from shardio.read.order import ORDER_VERSIONS, RankBatches, epoch_runs, rank_batches, run_pieces


def _eager_batches(samples: int, batch_size: int, rank: int, world_size: int, drop_last: bool,
                   start: int) -> list[range]:
    """``rank_batches`` as it was written before it became lazy: the reference for ``RankBatches``."""
    left = samples - start
    per_round = batch_size * world_size
    full_rounds = left // per_round
    batches = [range(start + g * batch_size, start + (g + 1) * batch_size)
               for g in range(rank, full_rounds * world_size, world_size)]
    rest = left - full_rounds * per_round
    if rest and not drop_last:
        base, extra = divmod(rest, world_size)
        if base == 0 and rank >= rest:
            repeat = start + (rank - rest) % left
            batches.append(range(repeat, repeat + 1))
        else:
            first = start + full_rounds * per_round + rank * base + min(rank, extra)
            batches.append(range(first, first + base + (rank < extra)))
    return batches


def _random_layout(rng: np.random.Generator) -> np.ndarray:
    """Counts of 1..40 shards: full, partial, zeros (sometimes runs of them, sometimes all of them)."""
    shards = int(rng.integers(1, 41))
    counts = rng.integers(0, 30, size=shards)
    counts[rng.random(shards) < 0.25] = 0
    if rng.random() < 0.3:
        counts[: int(rng.integers(0, shards + 1))] = 0
    return counts.astype(np.int64)


def test_lazy_pieces_equal_the_eager_plan_over_random_layouts() -> None:
    """500 layouts x every rank: each batch's pieces, from the lazy plan, equal run_pieces over
    epoch_runs; random counts with zeros, windows, blocks, batch sizes, world sizes, drop_last, starts."""
    rng = np.random.default_rng(24)
    checked = 0
    for _ in range(500):
        counts = _random_layout(rng)
        samples = int(counts.sum())
        settings = {"shuffle": bool(rng.random() < 0.85), "seed": int(rng.integers(0, 1000)),
                    "epoch": int(rng.integers(0, 5)), "shuffle_window": int(rng.integers(1, 12)),
                    "shuffle_block": int(rng.choice([1, 1, 2, 3, 7])),
                    "order_version": int(rng.choice(ORDER_VERSIONS))}
        runs = epoch_runs(counts, **settings)
        ends = np.cumsum(runs[:, 2] - runs[:, 1])
        plan = EpochPlan(counts, **settings)
        assert plan.samples == samples
        assert plan.runs().tolist() == runs.tolist()
        batch_size, world_size = int(rng.integers(1, 20)), int(rng.integers(1, 6))
        drop_last = bool(rng.random() < 0.5)
        start = int(rng.integers(0, samples + 1))
        fresh = EpochPlan(counts, **settings)  # no window built yet: a resumed pass starts cold
        for rank in range(world_size):
            batches = rank_batches(samples, batch_size, rank, world_size, drop_last, start)
            for positions in batches:
                assert fresh.pieces(positions) == run_pieces(ends, runs, positions), (settings, positions)
                checked += 1
    assert checked > 2000


def test_rank_batches_are_the_eager_list_and_slice_like_one() -> None:
    rng = np.random.default_rng(7)
    for _ in range(400):
        samples = int(rng.integers(0, 300))
        batch_size, world_size = int(rng.integers(1, 17)), int(rng.integers(1, 9))
        rank, drop_last = int(rng.integers(0, world_size)), bool(rng.random() < 0.5)
        start = int(rng.integers(0, samples + 1))
        lazy = rank_batches(samples, batch_size, rank, world_size, drop_last, start)
        eager = _eager_batches(samples, batch_size, rank, world_size, drop_last, start)
        assert list(lazy) == eager and len(lazy) == len(eager) and lazy == eager
        workers = int(rng.integers(1, 5))
        for worker in range(workers):  # a DataLoader worker's share, and a slice of it
            assert list(lazy[worker::workers]) == eager[worker::workers]
            assert list(lazy[worker::workers][1:]) == eager[worker::workers][1:]
        if eager:
            assert lazy[-1] == eager[-1] and lazy[0] == eager[0]
        with pytest.raises(IndexError):
            lazy[len(eager)]


def test_rank_batches_pickle_in_bytes_whatever_the_epoch() -> None:
    """What an EpochPass carries to DataLoader workers: no list per batch (LAION-2B: 140k batches a rank)."""
    small = pickle.dumps(rank_batches(10_000, 256, 3, 64, False))
    huge = rank_batches(2_300_000_000, 256, 3, 64, False)
    assert len(huge) == 140_381 and len(pickle.dumps(huge)) <= len(small) + 64
    assert pickle.loads(pickle.dumps(huge[1::4])) == huge[1::4]
    assert isinstance(huge[1::4], RankBatches)


def test_a_rank_builds_each_window_once_and_keeps_two() -> None:
    """Rank 0 of 4 walks 40 windows in order: each window's runs are built once (the ranks' batches of a
    window are in a row) and no more than KEPT_WINDOWS are held at any time."""
    counts = np.full(400, 50, dtype=np.int64)
    plan = EpochPlan(counts, shuffle=True, seed=1, epoch=2, shuffle_window=10, shuffle_block=1,
                     order_version=2)
    assert plan.windows == 40
    seen = []
    batches = rank_batches(plan.samples, 64, 0, 4, False)
    for positions in batches:
        seen.extend(plan.pieces(positions))
        assert len(plan._kept) <= KEPT_WINDOWS
    assert plan.windows_built == 40
    assert sum(stop - start for _, start, stop in seen) == sum(len(b) for b in batches) == 78 * 64 + 8


def test_a_plan_holds_o_shards_before_any_window() -> None:
    """Made for 2.3M shards of 1,000 samples (2.3 billion samples), the plan holds its permutation and
    window starts only (each array O(shards)), and the first batch builds one window."""
    counts = np.full(2_300_000, 1000, dtype=np.int64)
    plan = EpochPlan(counts, shuffle=True, seed=0, epoch=0, shuffle_window=256, shuffle_block=1,
                     order_version=2)
    held = plan._order.nbytes + plan._starts.nbytes + plan._shard_bounds.nbytes
    assert held <= 8 * 2_300_000 + 2 * 8 * (plan.windows + 1)
    first = plan.pieces(range(0, 256))
    assert sum(b - a for _, a, b in first) == 256 and plan.windows_built == 1
    assert plan.window(0).order.nbytes <= 8 * 256 * 1000  # one window's block permutation, not the epoch's


def test_positions_outside_the_epoch_are_refused() -> None:
    plan = EpochPlan(np.array([3, 0, 4]), shuffle=True, seed=0, epoch=0, shuffle_window=1, shuffle_block=1,
                     order_version=2)
    with pytest.raises(ValueError, match="outside the epoch's 0..7"):
        plan.pieces(range(5, 9))
    assert plan.pieces(range(7, 7)) == []
    with pytest.raises(ValueError, match="order_version"):
        EpochPlan(np.array([3]), shuffle=True, seed=0, epoch=0, shuffle_window=1, shuffle_block=1,
                  order_version=3)


def test_a_pass_carries_no_per_sample_state(tmp_path) -> None:
    """What a pass hands to DataLoader workers is a few ints (no list of batches, no runs), and the
    lazily planned iteration, in windows of 2 shards, with workers, is the eager order sample for sample."""
    from dataset_fixtures import indices, make_dataset

    from shardio import ShardDataset, ShardLoader

    make_dataset(str(tmp_path))
    ds = ShardDataset(str(tmp_path), 5, shuffle=True, seed=3, shuffle_window=2, rank=1, world_size=2)
    epoch_pass = ds.begin_pass()
    assert isinstance(epoch_pass.batches, RankBatches) and len(epoch_pass.batches) == 12
    assert len(pickle.dumps(epoch_pass)) < 600
    assert ds.plan(0).windows == 8  # 15 shards in windows of 2
    got = np.concatenate([indices(b) for b in ShardLoader(ds, num_workers=2)])
    positions = np.concatenate([np.arange(r.start, r.stop) for r in epoch_pass.batches])
    assert (got == ds.sample_order(1)[positions]).all()  # the loader's pass is epoch 1
