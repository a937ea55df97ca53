"""A bucketed dataset through ShardDataset: one bucket per batch, the same bucket on every rank at each step,
every sample once an epoch, len on every rank, buffers reused, workers, sample access."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from bucket_fixtures import key_bucket, key_index, make_bucketed_dataset
from dataset_fixtures import pixel_indices

from shardio import ShardDataset, ShardLoader

BUCKETS = [(8, 12), (12, 8), (10, 10)]
SIZES = [23, 41, 9]
BATCH = 4


@pytest.fixture(scope="module", params=["raw", "jpeg"])
def bucketed(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> str:
    directory = str(tmp_path_factory.mktemp(f"buckets-{request.param}"))
    return make_bucketed_dataset(directory, buckets=BUCKETS, samples=SIZES, samples_per_shard=6,
                                 encoding=request.param)


def all_keys(ds: ShardDataset) -> Counter:
    return Counter(ds.sample(i)["__key__"] for i in range(ds.num_samples))


def check_batch(ds: ShardDataset, batch: dict) -> int:
    """The batch is one bucket: its image has that bucket's shape, each key names that bucket, and each
    row's pixels are the sample its key names."""
    bucket = batch["bucket"]
    image = batch["image"]
    assert image.dtype == torch.uint8 and tuple(image.shape[1:]) == (*ds.buckets[bucket], 3)
    keys = batch["__key__"]
    assert len(keys) == image.shape[0] and {key_bucket(k) for k in keys} == {bucket}
    assert pixel_indices(image).tolist() == [key_index(k) for k in keys]
    return bucket


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_epoch_is_every_key_once_one_bucket_a_batch(bucketed: str, shuffle: bool) -> None:
    ds = ShardDataset(bucketed, BATCH, shuffle=shuffle, seed=5)
    assert ds.buckets == BUCKETS and ds.bucket_sizes == SIZES
    batches = list(ds)
    assert len(batches) == len(ds) == sum(-(-n // BATCH) for n in SIZES)
    keys = Counter()
    per_bucket = Counter()
    for batch in batches:
        bucket = check_batch(ds, batch)
        per_bucket[bucket] += len(batch["__key__"])
        keys.update(batch["__key__"])
    assert keys == all_keys(ds)
    assert [per_bucket[b] for b in range(3)] == SIZES


def test_sample_access_is_at_the_samples_own_shape(bucketed: str) -> None:
    ds = ShardDataset(bucketed, BATCH)
    shapes = Counter(tuple(ds.sample(i)["image"].shape[:2]) for i in range(ds.num_samples))
    assert shapes == Counter({shape: n for shape, n in zip(BUCKETS, SIZES)})


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_take_the_same_bucket_at_each_step(bucketed: str, world_size: int, drop_last: bool) -> None:
    ranks = [ShardDataset(bucketed, BATCH, shuffle=True, seed=1, rank=r, world_size=world_size,
                          drop_last=drop_last) for r in range(world_size)]
    for ds in ranks:
        ds.set_epoch(2)
    epochs = [list(ds) for ds in ranks]
    assert len({len(e) for e in epochs}) == 1 and len(epochs[0]) == len(ranks[0])
    seen = Counter()
    for step in range(len(epochs[0])):
        buckets = {check_batch(ranks[r], epochs[r][step]) for r in range(world_size)}
        assert len(buckets) == 1, f"step {step}: ranks read buckets {buckets}"
        for r in range(world_size):
            seen.update(epochs[r][step]["__key__"])
    every = all_keys(ranks[0])
    per_round = BATCH * world_size
    if drop_last:  # each bucket's rest is dropped: exactly those samples are missing, the others once
        assert set(seen.values()) == {1} and set(seen) <= set(every)
        assert len(every) - len(seen) == sum(n % per_round for n in SIZES)
    else:  # every sample; a rank left with nothing in a bucket's short round repeats one of its samples
        assert set(seen) == set(every)
        repeats = sum(seen.values()) - len(every)
        assert repeats == sum(max(0, world_size - n % per_round) for n in SIZES if n % per_round)


def test_buffers_are_reused_across_buckets(bucketed: str) -> None:
    ds = ShardDataset(bucketed, BATCH, shuffle=True, prefetch=0)
    for _ in range(2):
        for batch in ds:
            del batch
    pool = ds._assembler.buffers
    assert pool.allocations <= pool.size  # made once, then reused whatever the bucket


def test_workers_keep_order_and_counts(bucketed: str) -> None:
    direct = [b["__key__"] for b in ShardDataset(bucketed, BATCH, shuffle=True, seed=3)]
    ds = ShardDataset(bucketed, BATCH, shuffle=True, seed=3)
    loader = ShardLoader(ds, num_workers=2)
    through = []
    for batch in loader:
        through.append(batch["__key__"])
        assert tuple(batch["image"].shape[1:3]) == ds.buckets[batch["bucket"]]
    assert through == direct
    assert ds.batches_seen == len(ds)


def test_a_single_shape_batch_has_no_bucket_key(tmp_path) -> None:
    from dataset_fixtures import make_dataset
    make_dataset(str(tmp_path))
    ds = ShardDataset(str(tmp_path), BATCH)
    assert ds.buckets == [(8, 8)] and ds.bucket_sizes == [ds.num_samples]
    assert "bucket" not in next(iter(ds)) and "bucket_positions" not in ds.state_dict()


def test_a_subset_keeps_each_samples_bucket(bucketed: str) -> None:
    from shardio.read.selection import SampleSelection
    whole = ShardDataset(bucketed, BATCH)
    keys = sorted(all_keys(whole))[::3]
    ds = ShardDataset(bucketed, BATCH, shuffle=True, selection=SampleSelection(keys=tuple(keys)))
    seen = Counter()
    for batch in ds:
        bucket = check_batch(ds, batch)
        for key in batch["__key__"]:
            assert tuple(whole.sample(whole.find(key))["image"].shape[:2]) == ds.buckets[bucket]
        seen.update(batch["__key__"])
    assert seen == Counter(keys)


def test_mixing_bucketed_datasets_gives_one_bucket_a_batch(bucketed: str, tmp_path) -> None:
    from shardio.errors import DatasetIncompatibleError
    from shardio.read.mixing import MixedDataset
    other = make_bucketed_dataset(str(tmp_path / "other"), buckets=BUCKETS, samples=[5, 7, 11],
                                  samples_per_shard=4)
    a, b = ShardDataset(bucketed, BATCH, shuffle=True), ShardDataset(other, BATCH, shuffle=True)
    mixed = MixedDataset([a, b], [1, 1], seed=2)
    for batch in mixed:
        source = (a, b)[batch["__source__"]]
        check_batch(source, batch)
    different = make_bucketed_dataset(str(tmp_path / "different"), buckets=[(8, 12), (12, 8)], samples=[5, 7],
                                      samples_per_shard=4)
    with pytest.raises(DatasetIncompatibleError, match="bucket"):
        MixedDataset([a, ShardDataset(different, BATCH)], [1, 1])


def test_a_bucketed_dataset_on_object_storage_reads_as_the_local_copy(s3_server, s3_bucket, tmp_path) -> None:
    from object_stores import CloudBucket
    local = make_bucketed_dataset(str(tmp_path / "local"), buckets=BUCKETS, samples=SIZES, samples_per_shard=6)
    remote = CloudBucket(s3_server, s3_bucket).upload_dir(local)
    here = list(ShardDataset(local, BATCH, shuffle=True, seed=4, shuffle_window=3))
    there_ds = ShardDataset(remote, BATCH, shuffle=True, seed=4, shuffle_window=3, cache_dir=str(tmp_path / "cache"),
                            cache_limit=10**6)
    there = list(there_ds)
    assert len(there) == len(here)
    for a, b in zip(here, there):
        assert a["bucket"] == b["bucket"] and a["__key__"] == b["__key__"]
        assert torch.equal(a["image"], b["image"])
        check_batch(there_ds, b)


def test_encoded_batches_carry_their_buckets_shape(tmp_path) -> None:
    directory = make_bucketed_dataset(str(tmp_path), buckets=BUCKETS, samples=SIZES, samples_per_shard=6,
                                      encoding="jpeg")
    encoded = list(ShardDataset(directory, BATCH, shuffle=True, seed=6, decode="device"))
    decoded = list(ShardDataset(directory, BATCH, shuffle=True, seed=6))
    assert len(encoded) == len(decoded)
    for a, b in zip(encoded, decoded):
        assert a["bucket"] == b["bucket"] and a["__key__"] == b["__key__"]
        assert a["image"].shape == tuple(b["image"].shape) == (len(b["__key__"]), *BUCKETS[b["bucket"]], 3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_batches_of_every_bucket_reuse_a_few_blocks(bucketed: str) -> None:
    ds = ShardDataset(bucketed, BATCH, shuffle=True, pin_memory=True, prefetch=0)
    blocks = set()
    buckets = set()
    for _ in range(3):
        for batch in ds:
            assert batch["image"].is_pinned()
            blocks.add(batch["image"].untyped_storage().data_ptr())
            buckets.add(batch["bucket"])
            del batch
    assert len(buckets) == len(BUCKETS) and len(blocks) <= 4  # not one block per bucket shape, nor per step


def test_an_empty_bucket_takes_no_round(tmp_path) -> None:
    directory = make_bucketed_dataset(str(tmp_path), buckets=BUCKETS, samples=[9, 0, 6], samples_per_shard=4)
    for drop_last in (False, True):
        ranks = [ShardDataset(directory, 2, shuffle=True, rank=r, world_size=2, drop_last=drop_last) for r in range(2)]
        assert ranks[0].bucket_sizes == [9, 0, 6]
        epochs = [list(ds) for ds in ranks]
        assert len(epochs[0]) == len(epochs[1]) == len(ranks[0]) == (2 + 1 if drop_last else 3 + 2)
        for a, b in zip(*epochs):
            assert a["bucket"] == b["bucket"] != 1


def test_the_cache_fits_a_window_of_every_bucket(s3_server, s3_bucket, tmp_path) -> None:
    from object_stores import CloudBucket
    local = make_bucketed_dataset(str(tmp_path / "local"), buckets=BUCKETS, samples=SIZES, samples_per_shard=6)
    remote = CloudBucket(s3_server, s3_bucket).upload_dir(local)
    shards = ShardDataset(local, BATCH).snapshot.shards
    largest = max(e.bytes + e.meta_bytes for e in shards)
    # Room for two windows of 4 shards of one bucket, not of all three: the default window is cut to 1.
    with pytest.warns(UserWarning, match="for each of 3 buckets"):
        ds = ShardDataset(remote, BATCH, shuffle=True, cache_dir=str(tmp_path / "cache"), cache_limit=8 * largest)
    assert ds.shuffle_window == 8 // (2 * 3)
    keys = Counter(k for batch in ds for k in batch["__key__"])
    assert keys == all_keys(ShardDataset(local, BATCH))


def test_drop_last_with_no_full_round_in_any_bucket_is_refused(bucketed: str) -> None:
    with pytest.raises(ValueError, match="in any bucket"):
        ShardDataset(bucketed, 16, world_size=3, rank=0, drop_last=True)  # 48 a round, buckets of 23, 41, 9
