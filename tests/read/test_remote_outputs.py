"""A dataset with model outputs on object storage reads through the shard cache as it reads locally (spec, "Model
outputs"): a unit is a shard's pixels, metadata and output files, downloaded, checked, counted, held and evicted
together. Checked: the same batches (outputs and pixels, one shape and buckets, ``encoding: none``) as the local
copy, shuffled, under a limit that forces evictions and is never exceeded; a batch of one slice copies its outputs
out of the maps; a corrupt output object and a missing one are errors naming its URL; a warm cache downloads
nothing; the cache key of a shard without outputs is the one it always was, with outputs it names them too."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from shardio.errors import ShardError, ShardIntegrityError
from shardio.format import ShardEntry
from shardio.format.manifests import load_manifest
from shardio.format.model_outputs import output_path, shard_files
from shardio.read.cache import shard_cache
from shardio.read.cache.cache_dir import CachedShard, cache_key
from shardio.read.cache.cache_units import ShardUnits
from shardio.read.dataset import ShardDataset
from shardio.read.snapshot import open_dataset
from shardio.read.subset import SubsetDataset
from shardio.train.loader import ShardLoader
from tests.output_datasets import expected, make_output_dataset, output_specs
from tests.read.test_reader_s3 import upload

NAMES = ("latent", "embed", "bits")
INPUTS = (7, 5, 9, 6)  # 27 samples in shards of 3 (partial last shards): 10 shards, more with buckets
SETTINGS = {"shuffle": True, "seed": 3, "shuffle_window": 1, "shuffle_block": 2, "drop_last": False}


@pytest.fixture(params=[(False, "raw"), (True, "raw"), (False, "none"), (True, "none")],
                ids=["single", "buckets", "none", "none-buckets"])
def kind(request) -> tuple[bool, str]:
    return request.param


@pytest.fixture
def local(tmp_path, kind) -> str:
    bucketed, encoding = kind
    directory = str(tmp_path / "local")
    make_output_dataset(directory, INPUTS, bucketed=bucketed, encoding=encoding)
    return directory


@pytest.fixture
def remote(s3_server, s3_bucket, local) -> str:
    return upload(s3_server, s3_bucket, local, prefix="out")


def unit_bytes(directory: str) -> list[int]:
    """Each shard's files on disk, its output files included: what its cache unit holds."""
    manifest = load_manifest(directory)
    names = [o.name for o in manifest.outputs]
    return [sum(os.path.getsize(os.path.join(directory, p)) for p in shard_files(e.path, e.meta_path, names))
            for e in manifest.shards]


def same_batch(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[name].dtype and torch.equal(value, b[name]), name
        elif isinstance(value, np.ndarray):  # ``ds.sample(i)``'s
            assert value.dtype == b[name].dtype and np.array_equal(value, b[name]), name
        else:
            assert value == b[name], name


def check_outputs(batch: dict, bucketed: bool) -> list[int]:
    indices = [int(key[1:]) for key in batch["__key__"]]
    for name in NAMES:
        for row, index in zip(batch[name], indices):
            assert torch.equal(row, expected(name, index, bucketed)), (name, index)
    return indices


def test_units_count_their_output_files(local, remote, kind, tmp_path):
    sizes = unit_bytes(local)
    ds = ShardDataset(remote, 4, cache_dir=str(tmp_path / "cache"), cache_limit=4 * max(sizes), **SETTINGS)
    units = ds._cache.units
    assert isinstance(units, ShardUnits)
    assert units.sizes().tolist() == sizes == [units[i].size for i in range(len(units))]  # columns, and each unit
    assert ds._cache.dataset_bytes == sum(sizes)


def test_batches_from_the_bucket_equal_the_local_ones(local, remote, kind, tmp_path):
    bucketed, encoding = kind
    sizes = unit_bytes(local)
    limit = 4 * max(sizes)  # 4 of 10 (or more) shards: evictions every epoch
    assert limit < sum(sizes)
    here = ShardDataset(local, 4, **SETTINGS)
    there = ShardDataset(remote, 4, cache_dir=str(tmp_path / "cache"), cache_limit=limit, **SETTINGS)
    for epoch in range(2):
        here.set_epoch(epoch)
        there.set_epoch(epoch)
        seen = []
        for a, b in zip(list(here), list(there), strict=True):
            same_batch(a, b)
            assert ("image" in b) == (encoding == "raw")
            seen += check_outputs(b, bucketed)
        assert sorted(seen) == list(range(sum(INPUTS)))
    stats = there.cache_stats()
    assert stats is not None and 0 < stats["peak_bytes"] <= limit
    assert stats["evictions"] > 0 and stats["downloads"] > len(sizes)
    assert stats["bytes_downloaded"] > sum(sizes)  # output files counted as downloaded, more than once
    for index in (0, 13, sum(INPUTS) - 1):
        same_batch(here.sample(index), there.sample(index))
    names = os.listdir(tmp_path / "cache")
    assert not [n for n in names if n.startswith(".tmp-")]
    assert any(n.endswith(".latent.npy") for n in names)


def test_batches_of_one_slice_copy_their_outputs_out_of_the_maps(local, remote, kind, tmp_path, monkeypatch):
    # A batch of one slice whose outputs were views of the maps would keep every unit it read: a list of all the
    # batches could not stay under the limit, and the reader would wait for room (given up on after 5 s here).
    bucketed, _ = kind
    monkeypatch.setattr(shard_cache, "STUCK_TIMEOUT_S", 5.0)
    limit = 2 * max(unit_bytes(local))
    ds = ShardDataset(remote, 1, shuffle=False, cache_dir=str(tmp_path / "cache"), cache_limit=limit)
    batches = list(ds)
    assert sorted(i for b in batches for i in check_outputs(b, bucketed)) == list(range(sum(INPUTS)))
    assert ds.cache_stats()["peak_bytes"] <= limit


@pytest.mark.parametrize("kind", [(True, "raw")], ids=["buckets"])
def test_a_subset_and_spawned_workers_keep_outputs_with_their_samples(local, remote, tmp_path):
    limit = 4 * max(unit_bytes(local))
    keys = [f"s{i}" for i in (1, 2, 5, 8, 11, 20, 26)]
    subset = SubsetDataset(remote, batch_size=3, keys=keys, cache_dir=str(tmp_path / "cache"), cache_limit=limit,
                           **SETTINGS)
    assert sorted(i for batch in subset for i in check_outputs(batch, True)) == [1, 2, 5, 8, 11, 20, 26]
    # Spawned: each worker its own cache over the shared directory, with half the limit.
    loader = ShardLoader(ShardDataset(remote, 4, cache_dir=str(tmp_path / "cache"), cache_limit=2 * limit,
                                      **SETTINGS), num_workers=2)
    assert sorted(i for batch in loader for i in check_outputs(batch, True)) == list(range(sum(INPUTS)))


def test_the_snapshot_maps_the_cached_output_files(local, remote, kind, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDIO_CACHE_DIR", str(tmp_path / "default"))  # the snapshot's own default cache
    here, there = open_dataset(local), open_dataset(remote)
    for shard in range(len(here.shards)):
        mine, theirs = here.output_arrays(shard), there.output_arrays(shard)
        assert mine.keys() == theirs.keys() == set(NAMES)
        for name in NAMES:
            assert theirs[name].dtype == mine[name].dtype and np.array_equal(theirs[name], mine[name])
        assert np.array_equal(here.pixels(shard), there.pixels(shard))  # ``encoding: none``: (N, 0, 0, 3)
    assert there.cache is not None and there.cache.stats["downloads"] == len(here.shards)


def corrupt(s3_server, bucket: str, local: str, entry: ShardEntry, name: str, change) -> str:
    """Put output ``name`` of ``entry`` back in the bucket with ``change`` applied to its bytes; its URL."""
    rel = output_path(entry.path, name)
    with open(os.path.join(local, rel), "rb") as f:
        data = bytearray(f.read())
    change(data)
    s3_server.client().put_object(Bucket=bucket, Key=f"out/{rel}", Body=bytes(data))
    return f"s3://{bucket}/out/{rel}"


@pytest.mark.parametrize("kind", [(False, "raw")], ids=["single"])
def test_a_corrupt_output_object_is_refused_naming_its_url(s3_server, s3_bucket, local, remote, tmp_path):
    entry = load_manifest(local).shards[4]

    def flip_last(data: bytearray) -> None:
        data[-1] ^= 0xFF  # same size, one bit off: only the checksum can tell

    url = corrupt(s3_server, s3_bucket, local, entry, "embed", flip_last)
    ds = ShardDataset(remote, 4, cache_dir=str(tmp_path / "cache"))  # sizes are right: opens
    with pytest.raises(ShardError, match=f"{url}: xxh3_128 differs from the manifest"):
        list(ds)
    assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(entry.checksum)]  # nothing half-cached

    def another_header(data: bytearray) -> None:
        data[:128] = bytes(data[:128]).replace(b"'<i4'", b"'<f4'")  # a header of another dtype, same size

    url = corrupt(s3_server, s3_bucket, local, entry, "embed", another_header)
    with pytest.raises(ShardError, match=f"{url}: header says <f4 .*, the index says <i4"):
        list(ShardDataset(remote, 4, cache_dir=str(tmp_path / "cache")))


@pytest.mark.parametrize("kind", [(False, "raw")], ids=["single"])
def test_a_missing_output_object_is_an_error_naming_its_url(s3_server, s3_bucket, local, remote, tmp_path):
    entries = load_manifest(local).shards
    rel = output_path(entries[6].path, "latent")
    s3_server.client().delete_object(Bucket=s3_bucket, Key=f"out/{rel}")
    with pytest.raises(ShardIntegrityError, match=f"{remote}/{rel}: listed in the manifest but missing"):
        ShardDataset(remote, 4, cache_dir=str(tmp_path / "cache"))  # the open's LIST sees it
    s3_server.client().upload_file(os.path.join(local, rel), s3_bucket, f"out/{rel}")  # back again
    ds = ShardDataset(remote, 4, cache_dir=str(tmp_path / "cache"))
    rel = output_path(entries[2].path, "bits")
    s3_server.client().delete_object(Bucket=s3_bucket, Key=f"out/{rel}")  # gone after the open
    with pytest.raises(ShardError, match=f"{remote}/{rel}: listed in the manifest but missing"):
        list(ds)


@pytest.mark.parametrize("kind", [(True, "raw")], ids=["buckets"])
def test_a_warm_cache_downloads_nothing_and_reads_the_same(local, remote, tmp_path):
    cache = str(tmp_path / "cache")
    shards = len(load_manifest(local).shards)
    first = ShardDataset(remote, 4, cache_dir=cache, **SETTINGS)
    cold = list(first)
    assert first.cache_stats()["downloads"] == shards
    second = ShardDataset(remote, 4, cache_dir=cache, **SETTINGS)
    warm = list(second)
    stats = second.cache_stats()
    assert stats["downloads"] == 0 and stats["adopted"] == shards and stats["bytes_downloaded"] == 0
    for a, b in zip(cold, warm, strict=True):
        same_batch(a, b)


def test_cache_keys_name_the_outputs_only_where_there_are_some(tmp_path):
    entry = ShardEntry("shards/a-00000.npy", "shards/a-00000.jsonl", 3, 236, "0123456789abcdef" * 2, 10,
                       "fedcba9876543210" * 2, "a.tar", "xxh3_128")
    # The key every cache directory holds for a shard without outputs: unchanged, so a warm cache stays warm.
    assert cache_key(entry) == f"{'0123456789abcdef' * 2}-{'fedcba9876543210' * 2}"
    with_outputs = replace(entry, outputs=("11" * 16, "22" * 16, "33" * 16))
    key = cache_key(with_outputs)
    assert key.startswith(f"{cache_key(entry)}-") and "." not in key
    assert cache_key(replace(with_outputs, outputs=("11" * 16, "22" * 16, "34" * 16))) != key  # another model's
    unit = CachedShard.of("s3://b/ds", with_outputs, lambda *parts: "/".join(parts), output_specs(False))
    assert unit.key == key and [o.url for o in unit.outputs] == [
        f"s3://b/ds/shards/a-00000.{name}.npy" for name in NAMES]
    # A dataset written without outputs: every unit's key is its two checksums.
    manifest = make_output_dataset(str(tmp_path / "plain"), with_outputs=False)
    for e in manifest.shards:
        assert cache_key(e) == f"{e.checksum}-{e.meta_checksum}"
