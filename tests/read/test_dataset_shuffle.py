"""shuffle=True: deterministic per (seed, epoch), different between epochs, every sample once (one bucket a batch
in a bucketed dataset), mixed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from dataset_fixtures import assert_exactly_once, indices, make_dataset
from layout_fixtures import LayoutDataset, batch_bucket

from shardio import ShardDataset
from shardio.read.dataset import epoch_runs
from shardio.read.order import ORDER_VERSIONS, epoch_windows, window_runs


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("shuffle"))
    make_dataset(directory)
    return directory


def read_epoch(ds: ShardDataset, epoch: int) -> np.ndarray:
    ds.set_epoch(epoch)
    return np.concatenate([indices(b) for b in ds])


@pytest.mark.parametrize("batch_size", [4, 10])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_one_shape_a_batch(layout_dataset: LayoutDataset, shuffle: bool, batch_size: int) -> None:
    """Each epoch reads every sample once, in ``sample_order``; a batch is one bucket (a single-shape dataset
    is one), and each bucket gives its own samples in its own batches."""
    data = layout_dataset
    ds = ShardDataset(data.path, batch_size, shuffle=shuffle, seed=3)
    assert ds.buckets == data.shapes and ds.bucket_sizes == data.sizes
    every = Counter(ds.sample(i)["__key__"] for i in range(ds.num_samples))
    stored = data.stored_numbers(ds)
    for epoch in range(3):
        ds.set_epoch(epoch)
        batches = list(ds)
        assert len(batches) == len(ds) == sum(-(-n // batch_size) for n in data.sizes)
        order = np.concatenate([data.check(b) for b in batches])
        assert_exactly_once(order, data.samples)
        # sample_order lists a bucketed epoch bucket after bucket: each bucket's samples come in its order
        # (a single-shape dataset's, its one bucket, is the whole read order)
        planned = stored[ds.sample_order(epoch)]
        for bucket in range(len(data.sizes)):
            mine = [data.bucket_of(int(i)) == bucket for i in order]
            assert (order[mine] == planned[[data.bucket_of(int(i)) == bucket for i in planned]]).all()
        assert Counter(k for b in batches for k in b["__key__"]) == every
        per_bucket = Counter()
        for batch in batches:
            per_bucket[batch_bucket(batch)] += len(batch["__key__"])
        assert [per_bucket[b] for b in range(len(data.sizes))] == data.sizes


def test_deterministic_per_seed_and_epoch(dataset_dir: str) -> None:
    a = ShardDataset(dataset_dir, 10, shuffle=True, seed=1)
    b = ShardDataset(dataset_dir, 10, shuffle=True, seed=1)
    other_seed = ShardDataset(dataset_dir, 10, shuffle=True, seed=2)
    assert (read_epoch(a, 4) == read_epoch(b, 4)).all()
    assert (read_epoch(a, 4) == read_epoch(a, 4)).all()  # iterating again repeats the epoch
    assert not (read_epoch(a, 4) == read_epoch(a, 5)).all()
    assert not (read_epoch(a, 4) == read_epoch(other_seed, 4)).all()
    assert not (read_epoch(a, 0) == np.arange(117)).all()


@pytest.mark.parametrize("window,block", [(1, 1), (1, 16), (2, 3), (8, 16), (100, 1), (3, 1000)])
def test_runs_cover_each_sample_once(window: int, block: int) -> None:
    counts = np.array([8, 8, 8, 8, 8, 5, 8, 8, 8, 8, 8, 8, 5, 8, 8, 8, 3, 0, 1])
    for epoch in range(3):
        runs = epoch_runs(counts, shuffle=True, seed=0, epoch=epoch, shuffle_window=window,
                          shuffle_block=block)
        assert (runs[:, 1] < runs[:, 2]).all()
        offsets = np.concatenate([[0], np.cumsum(counts)])
        order = np.concatenate([np.arange(offsets[s] + a, offsets[s] + b) for s, a, b in runs])
        assert_exactly_once(order, int(counts.sum()))


def test_window_bounds_how_far_samples_move() -> None:
    """A window of 1 shard keeps each shard's samples together; a larger one mixes shards."""
    counts = np.full(32, 64)
    narrow = epoch_runs(counts, shuffle=True, seed=0, epoch=0, shuffle_window=1, shuffle_block=4)
    wide = epoch_runs(counts, shuffle=True, seed=0, epoch=0, shuffle_window=8, shuffle_block=4)
    first_64 = [set(np.repeat(runs[:, 0], runs[:, 2] - runs[:, 1])[:64]) for runs in (narrow, wide)]
    assert len(first_64[0]) == 1 and len(first_64[1]) >= 6


def test_batches_mix_shards(dataset_dir: str) -> None:
    ds = ShardDataset(dataset_dir, 16, shuffle=True, shuffle_window=8, shuffle_block=2)
    shards_per_batch = [len(set(indices(b) // 8)) for b in ds]
    assert np.mean(shards_per_batch) > 4


def test_held_batches_are_never_overwritten(dataset_dir: str) -> None:
    """Multi-shard batches reuse buffers only once released: batches kept alive keep their samples."""
    ds = ShardDataset(dataset_dir, 10, shuffle=True)
    kept = list(ds)  # all alive at once: more than the pool holds
    tensors_only = [b["image"][1:] for b in ShardDataset(dataset_dir, 10, shuffle=True)]  # views keep theirs
    order = ds.sample_order(0)
    assert (np.concatenate([indices(b) for b in kept]) == order).all()
    heads = np.concatenate([(t.reshape(len(t), -1)[:, 0].numpy().astype(np.int64)) for t in tensors_only])
    expected = np.concatenate([order[i * 10 + 1 : i * 10 + 10] for i in range(len(tensors_only))]) & 255
    assert (heads == expected).all()
    # Released batches' buffers are reused: the pool stays bounded.
    fresh = ShardDataset(dataset_dir, 10, shuffle=True, shuffle_block=1, prefetch=0)
    addresses = {batch["image"].data_ptr() for batch in fresh}
    pool = fresh._assembler.buffers
    assert len(addresses) <= 2 < len(fresh) and len(pool.buffers) <= pool.size
    # Prefetching holds more batches at once (the queue's, the thread's): still a bounded pool.
    ahead = ShardDataset(dataset_dir, 10, shuffle=True, shuffle_block=1, prefetch=3)
    addresses = {batch["image"].data_ptr() for batch in ahead}
    pool = ahead._assembler.buffers
    assert len(addresses) <= pool.size < len(ahead) and len(pool.buffers) <= pool.size


# Order version 1 as shardio computed it before version 2 (seed 5, counts below, window 2, block 3):
# the order an old resume state was cut with, which version 1 must replay exactly.
V1_COUNTS = np.array([8, 8, 5, 3, 0, 1])
V1_EPOCH_0 = [[1, 0, 8], [3, 0, 1], [2, 0, 4], [3, 1, 3], [2, 4, 5], [0, 6, 8], [0, 3, 6], [0, 0, 3],
              [5, 0, 1]]


def test_version_1_replays_the_old_order() -> None:
    runs = epoch_runs(V1_COUNTS, shuffle=True, seed=5, epoch=0, shuffle_window=2, shuffle_block=3,
                      order_version=1)
    assert runs.tolist() == V1_EPOCH_0


@pytest.mark.parametrize("version", ORDER_VERSIONS)
def test_every_version_is_a_permutation_and_deterministic(version: int) -> None:
    counts = np.array([8, 8, 8, 5, 8, 3, 0, 1, 8, 8, 7])
    offsets = np.concatenate([[0], np.cumsum(counts)])
    orders = []
    for epoch in (0, 0, 1):
        runs = epoch_runs(counts, shuffle=True, seed=2, epoch=epoch, shuffle_window=3, shuffle_block=2,
                          order_version=version)
        orders.append(np.concatenate([np.arange(offsets[s] + a, offsets[s] + b) for s, a, b in runs]))
        assert_exactly_once(orders[-1], int(counts.sum()))
    assert (orders[0] == orders[1]).all() and not (orders[0] == orders[2]).all()


def test_each_window_is_computable_on_its_own() -> None:
    """Version 2: window i's runs come from (seed, epoch, i) and the shard permutation alone, so a lazy
    plan can compute one window without the others; the epoch is the windows in order."""
    counts = np.arange(1, 31) % 9 * 7  # 30 shards of 0..56 samples
    windows = epoch_windows(len(counts), seed=4, epoch=3, shuffle_window=8)
    assert [len(w) for w in windows] == [7, 8, 7, 8]  # 30 shards: 4 windows of near-equal size
    assert sorted(np.concatenate(windows).tolist()) == list(range(30))
    last = window_runs(counts, windows[3], seed=4, epoch=3, window=3, shuffle_block=5)
    alone = np.repeat(last[:, 0], last[:, 2] - last[:, 1])
    whole = epoch_runs(counts, shuffle=True, seed=4, epoch=3, shuffle_window=8, shuffle_block=5)
    shards = np.repeat(whole[:, 0], whole[:, 2] - whole[:, 1])
    assert (shards[-len(alone):] == alone).all()
    assert set(alone) == set(windows[3][counts[windows[3]] > 0].tolist())


def test_a_small_dataset_is_one_permutation_by_default(dataset_dir: str) -> None:
    """117 samples in 15 shards, fewer than the default window: each batch draws from the whole dataset."""
    ds = ShardDataset(dataset_dir, 16, shuffle=True)
    assert ds.shuffle_block == 1 and ds.shuffle_window >= 15 and ds.order_version == max(ORDER_VERSIONS)
    shards_per_batch = [len(set(indices(b) // 8)) for b in ds]
    assert np.mean(shards_per_batch[:-1]) > 8  # a permutation: 9.6 of 15 on average
