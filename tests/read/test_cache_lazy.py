"""The shard cache over a ``ShardTable`` costs O(shards touched), not O(shards in the dataset)
(shardio/read/cache/cache_units.py, shardio/read/cache/shard_cache.py; issue 24): opening makes no unit, a plan or a
read makes the units of the shards it names and no other, a new pass forgets the last one's, and the
whole-dataset figures (the default limit, the two largest shards, the checksum algorithms) come from
columns and agree with what a list of units gives.

A 200k-shard synthetic index (``bench.synthetic_index``: no shard files) for the scale; a small real
dataset read through a folder posing as the store for the bytes.
"""

from __future__ import annotations

import os
import pickle
import sys

import numpy as np
import pytest

from bench.synthetic_index import write_index
from shardio.errors import MissingExtra
from shardio.format.manifests import load_index, load_manifest
from shardio.format.shard_table import ShardTable
from shardio.read.cache.cache_dir import CachedShard
from shardio.read.cache.cache_setup import cache_for
from shardio.read.cache.cache_units import ShardUnits
from shardio.read.cache.shard_cache import ShardCache
from tests.read.test_shard_cache import BASE, FolderStore, _join, dataset, read_all, read_bytes  # noqa: F401

SHARDS = 200_000
SHAPE = (2, 2, 3)


class NeverStore:
    """A downloader that must not be asked: opening and planning without threads download nothing."""

    def download(self, path: str, local_path: str, algorithm: str) -> str:
        raise AssertionError(f"downloaded {path}")


@pytest.fixture(scope="module")
def big_table(tmp_path_factory) -> tuple[str, ShardTable]:
    directory = str(tmp_path_factory.mktemp("big"))
    write_index(directory, SHARDS)
    return directory, load_index(directory).shards


def unit_size(table: ShardTable, shard: int) -> int:
    entry = table[shard]
    return entry.bytes + entry.meta_bytes


def test_opening_over_a_large_table_makes_no_unit(big_table, tmp_path):
    directory, table = big_table
    cache = cache_for(directory, table, SHAPE, str(tmp_path / "cache"), "50GB", NeverStore())
    try:
        assert len(cache.units) == SHARDS
        assert cache._units == {} and cache._by_key == {} and cache._state == {}
        assert cache.largest_sizes == (unit_size(table, 0), unit_size(table, 1))
    finally:
        cache.close()


def test_a_plan_and_a_read_make_exactly_the_units_they_name(big_table, tmp_path):
    directory, table = big_table
    cache = ShardCache(ShardUnits(directory, table), NeverStore(), str(tmp_path / "cache"), 10**9, shape=SHAPE,
                       threads=0)
    try:
        unit = cache.unit(123_456)
        assert list(cache._units) == [123_456]
        assert unit.key == f"{table[123_456].checksum}-{table[123_456].meta_checksum}"
        assert cache.unit(123_456) is unit  # kept, not made again
        cache.plan([[5, 7], [7, 199_999], [42]])
        assert sorted(cache._units) == [5, 7, 42, 199_999]  # the last plan's; the lone read is forgotten
        cache.plan([[1_000], [1_001, 1_002]])
        assert sorted(cache._units) == [1_000, 1_001, 1_002]  # a new pass keeps only its own
        assert len(cache._by_key) == 3
    finally:
        cache.close()


def test_a_pickled_cache_arrives_empty_over_the_same_table(big_table, tmp_path):
    directory, table = big_table
    cache = cache_for(directory, table, SHAPE, str(tmp_path / "cache"), "50GB", NeverStore())
    cache.unit(9)
    copy = pickle.loads(pickle.dumps(cache))
    try:
        assert copy._units == {} and len(copy.units) == SHARDS
        assert copy.unit(9) == cache.unit(9)
    finally:
        cache.close()
        copy.close()


def test_the_limit_is_checked_against_the_two_largest_shards_from_the_columns(big_table, tmp_path):
    directory, table = big_table
    two = unit_size(table, 0) + unit_size(table, 1)  # every synthetic shard is the same size
    with pytest.raises(ValueError, match="cannot hold the two largest shards"):
        cache_for(directory, table, SHAPE, str(tmp_path / "cache"), two - 1, NeverStore())


def test_a_missing_hasher_fails_at_open_from_the_algorithm_column(big_table, tmp_path, monkeypatch):
    directory, table = big_table
    assert table.checksum_algorithms() == {"xxh3_128"}
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(MissingExtra, match="pip install xxhash"):
        cache_for(directory, table, SHAPE, str(tmp_path / "cache"), "50GB", NeverStore())


@pytest.mark.parametrize("as_list", [False, True], ids=["table", "list"])
def test_the_default_limit_is_the_datasets_bytes_from_a_table_or_a_list(dataset, tmp_path, as_list):
    shards = load_index(dataset).shards
    entries = list(shards) if as_list else shards
    cache = cache_for(dataset, entries, (8, 8, 3), str(tmp_path / "cache"), None, NeverStore())
    try:
        assert cache.limit == sum(e.bytes + e.meta_bytes for e in load_manifest(dataset).shards)
        assert cache._units == {}
    finally:
        cache.close()


def test_reading_through_table_units_gives_the_shards_bytes_and_downloads_only_those(dataset, tmp_path):
    table = load_index(dataset).shards
    shape = load_manifest(dataset).shape
    store = FolderStore(dataset)
    cache = ShardCache(ShardUnits(BASE, table, _join), store, str(tmp_path / "cache"), 10**9, shape=shape)
    try:
        sequence = [3, 11, 3, 0]
        got = read_all(cache, sequence)
    finally:
        cache.close()
    for shard, data in zip(sequence, got):
        unit = CachedShard.of(BASE, table[shard], _join)
        local = np.load(os.path.join(dataset, table[shard].path))
        assert data == bytes(local) + read_bytes(os.path.join(dataset, table[shard].meta_path))
        assert store.calls[unit.npy_url] == 1
    assert sorted(cache._units) == [0, 3, 11]
    assert len(store.calls) == 2 * 3  # each read shard's .npy and .jsonl, nothing else
