"""The bucketed epoch order without a dataset: rounds of one bucket, ranks in step, resume, interleave."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardio.read.bucket_order import BucketPlan, BucketRankBatches, bucket_seed, interleave
from shardio.read.epoch_plan import EpochPlan
from shardio.read.shuffle_quality import permutation_quality, runs_order, shuffle_quality

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
    import pickle
    sizes = [256 * 1000, 256 * 3000 + 7]
    batches = BucketRankBatches(sizes, 256, 1, 2, False, shuffle=True, seed=1, epoch=2, skip=3)
    data = pickle.dumps(batches[1::2])
    assert len(data) < 2000  # a few ints, not the 2,000 rounds' arrays
    again = pickle.loads(data)
    assert list(again) == list(batches[1::2])
