"""The lazy epoch plan (``shardio.read.epoch_plan``) gives exactly the eager plan's pieces, and holds only
O(shards) plus two windows, over many random layouts (loops with fixed seeds, no timing); the bucketed order
(``shardio.read.bucket_order``) deals rounds of one bucket, ranks in step, resumes and interleaves the buckets."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest

from shardio.read.bucket_order import BucketPlan, BucketRankBatches, bucket_seed, interleave
from shardio.read.epoch_plan import KEPT_WINDOWS, EpochPlan
from shardio.read.order import ORDER_VERSIONS, RankBatches, epoch_runs, rank_batches, run_pieces
from shardio.read.shuffle_quality import permutation_quality, runs_order, shuffle_quality


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


# --- the bucketed epoch order (shardio.read.bucket_order): rounds of one bucket, ranks in step, resume, interleave

SIZES = [37, 0, 101, 64, 9]


def _bucket(offsets: np.ndarray, batch: range) -> int:
    return int(np.searchsorted(offsets, batch.start, side="right")) - 1


def _ranks(sizes, batch_size, world, drop_last, **kw):
    return [BucketRankBatches(sizes, batch_size, r, world, drop_last, shuffle=True, seed=3, epoch=1, **kw)
            for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_bucket_each_step_and_cover(world: int, drop_last: bool) -> None:
    batch_size = 4
    ranks = _ranks(SIZES, batch_size, world, drop_last)
    offsets = ranks[0].offsets
    assert len({len(r) for r in ranks}) == 1
    seen = []
    for step in range(len(ranks[0])):
        batches = [r[step] for r in ranks]
        buckets = {_bucket(offsets, b) for b in batches}
        assert len(buckets) == 1, (step, batches)
        bucket = buckets.pop()
        for b in batches:
            assert offsets[bucket] <= b.start < b.stop <= offsets[bucket + 1]
            seen.extend(b)
    counted = np.bincount(seen, minlength=sum(SIZES))
    per_round = batch_size * world
    for bucket, size in enumerate(SIZES):
        part = counted[offsets[bucket] : offsets[bucket + 1]]
        if drop_last:  # exactly the bucket's remainder is missing, the rest seen once
            kept = size // per_round * per_round
            assert (part[:kept] == 1).all() and (part[kept:] == 0).all()
        else:  # every sample at least once; repeats only where a rank had nothing left (a short round)
            assert (part >= 1).all()
            assert part.sum() - size <= world


def test_unshuffled_interleave_is_proportional_and_smooth() -> None:
    sequence = interleave(np.array([10, 0, 30, 5]), shuffle=False, seed=0, epoch=0, start=[0, 0, 0, 0])
    assert np.bincount(sequence, minlength=4).tolist() == [10, 0, 30, 5]
    for bucket, rounds in ((0, 10), (2, 30), (3, 5)):
        places = np.flatnonzero(sequence == bucket)
        assert np.diff(places).max() <= 2 * len(sequence) / rounds  # evenly spread


def _longest_run(sequence: np.ndarray) -> int:
    return max(len(list(group)) for _, group in itertools.groupby(sequence.tolist()))


def test_shuffled_interleave_mixes_buckets() -> None:
    # Three buckets of 100 rounds each: a uniform shuffle of 300 rounds has a run of at least k with
    # probability at most 300 * (1/3)^(k-1) (a run starts at one of 300 places, then k-1 more of its
    # bucket); the longest is ~5 typically, and 14 or more has chance <= 2e-4 per seed (the seeds are fixed).
    for seed in range(20):
        sequence = interleave(np.array([100, 100, 100]), shuffle=True, seed=seed, epoch=0, start=[0, 0, 0])
        assert _longest_run(sequence) < 14
        assert np.bincount(sequence).tolist() == [100, 100, 100]
    a = interleave(np.array([5, 5]), shuffle=True, seed=1, epoch=0, start=[0, 0])
    assert (a == interleave(np.array([5, 5]), shuffle=True, seed=1, epoch=0, start=[0, 0])).all()
    epochs = {tuple(interleave(np.array([50, 50]), shuffle=True, seed=1, epoch=e, start=[0, 0])) for e in range(4)}
    assert len(epochs) == 4


@pytest.mark.parametrize("world", [1, 3])
def test_resume_same_world_is_the_same_batches(world: int) -> None:
    full = _ranks(SIZES, 4, world, False)
    for taken in (0, 1, 5, len(full[0])):
        consumed = full[0].consumed_after(taken)
        resumed = _ranks(SIZES, 4, world, False, skip=taken)
        for rank in range(world):
            assert list(resumed[rank]) == list(full[rank])[taken:]
        assert full[0].consumed_after(taken) == consumed


@pytest.mark.parametrize("old,new", [(2, 3), (3, 1), (1, 5), (4, 2)])
def test_resume_other_world_sees_the_rest_once(old: int, new: int) -> None:
    batch_size = 4
    first = _ranks(SIZES, batch_size, old, True)
    taken = len(first[0]) // 2
    consumed = first[0].consumed_after(taken)
    seen = [p for r in first for b in list(r)[:taken] for p in b]
    after = _ranks(SIZES, batch_size, new, False, start=consumed)
    later = [p for r in after for b in r for p in b]
    counted = np.bincount(seen + later, minlength=sum(SIZES))
    assert (counted >= 1).all()
    assert not set(seen) & set(later)
    assert len(later) - len(set(later)) <= new * len(SIZES)  # repeats only in short rounds


def test_worker_slices_partition_a_rank() -> None:
    batches = _ranks(SIZES, 4, 2, False)[1]
    workers = [list(batches[w::3]) for w in range(3)]
    assert sorted(map(tuple, sum(workers, []))) == sorted(map(tuple, batches))


def _plan(counts, shard_buckets, shuffle=True, seed=0):
    return BucketPlan(np.array(counts), np.array(shard_buckets), max(shard_buckets) + 1, shuffle=shuffle, seed=seed,
                      epoch=0, shuffle_window=256, shuffle_block=1, order_version=2)


def test_plan_maps_bucket_positions_to_the_bucket_shards() -> None:
    counts = [5, 7, 3, 4, 6]
    shard_buckets = [1, 0, 1, 0, 1]
    plan = _plan(counts, shard_buckets)
    assert plan.sizes == [11, 14]
    covered = set()
    for bucket in range(2):
        pieces = plan.pieces(range(int(plan.offsets[bucket]), int(plan.offsets[bucket + 1])))
        for shard, start, stop in pieces:
            assert shard_buckets[shard] == bucket
            covered.update((shard, i) for i in range(start, stop))
    assert covered == {(s, i) for s, n in enumerate(counts) for i in range(n)}
    with pytest.raises(ValueError, match="one bucket"):
        plan.pieces(range(10, 12))
    unshuffled = _plan(counts, shard_buckets, shuffle=False)
    assert unshuffled.pieces(range(0, 11)) == [(1, 0, 7), (3, 0, 4)]


def test_bucket_seeds_differ() -> None:
    assert len({bucket_seed(s, b) for s in range(3) for b in range(5)}) == 15


def test_shuffle_within_a_bucket_is_todays() -> None:
    # A bucket's order is EpochPlan's over its shards: the same distinct-shards metric as a single shape.
    rng = np.random.default_rng(0)
    counts = np.full(200, 100)
    shard_buckets = rng.integers(0, 2, 200)
    plan = _plan(counts, shard_buckets)
    for bucket in range(2):
        members = plan.members[bucket]
        mine = plan.plan(bucket).runs()  # shards numbered within the bucket
        alone = EpochPlan(counts[members], shuffle=True, seed=bucket_seed(0, bucket), epoch=0, shuffle_window=256,
                          shuffle_block=1, order_version=2).runs()
        assert (mine == alone).all()
        sub_counts = counts[members]
        quality = shuffle_quality(runs_order(alone, sub_counts), np.repeat(np.arange(len(members)), sub_counts), 64)
        reference = permutation_quality(sub_counts, 64)
        assert quality.sources_share(reference) > 0.98  # as mixed as a permutation, like a single shape
        assert quality.neighbour_rate < 3 * reference.neighbour_rate


def test_a_pass_pickles_small_and_the_same() -> None:
    sizes = [256 * 1000, 256 * 3000 + 7]
    batches = BucketRankBatches(sizes, 256, 1, 2, False, shuffle=True, seed=1, epoch=2, skip=3)
    data = pickle.dumps(batches[1::2])
    assert len(data) < 2000  # a few ints, not the 2,000 rounds' arrays
    again = pickle.loads(data)
    assert list(again) == list(batches[1::2])
