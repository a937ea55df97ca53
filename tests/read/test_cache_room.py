"""Room a download waits for is given back at once (shardio/read/cache/shard_cache.py, cached_reading.py): before
each batch a reader lets go of its maps of the shards the pass reads no more, so the next window's downloads take
their room while this batch is assembled (a JPEG batch's decode took long enough for the next window to be fetched
one shard at a time, on demand); maps a reader drops are counted free then, not when a download thread next
polls; the download threads take the sequence's shards at once, each woken one with work waking the next."""

from __future__ import annotations

import os
import threading

import numpy as np

from shardio import ShardDataset
from shardio.read.cache.cache_dir import cache_key
from shardio.read.cache.shard_cache import ShardCache
from tests.dataset_fixtures import make_dataset
from tests.read.test_reader_s3 import upload
from tests.read.test_shard_cache import FolderStore, dataset, local_pixels, units_of  # noqa: F401


def doom(cache: ShardCache, key: str) -> None:
    """What a download thread making room does to a file a reader still maps (``ShardCache._reserve``)."""
    with cache._cond:
        cache._set(key, "doomed")
        cache.dooms += 1


def test_a_map_of_a_shard_the_pass_reads_no_more_is_let_go_before_the_next_batch(s3_server, s3_bucket, tmp_path):
    local = str(tmp_path / "local")
    make_dataset(local, inputs=(24,), samples_per_shard=8, height=8, width=8)  # shards 0, 1, 2 of 8 samples
    url = upload(s3_server, s3_bucket, local)
    # Batches of 4 in order: 0 and 1 read shard 0, 2 and 3 shard 1, 4 and 5 shard 2. No prefetch thread, so
    # each batch is assembled when asked for.
    ds = ShardDataset(url, 4, cache_dir=str(tmp_path / "cache"), prefetch=0)
    batches = iter(ds)
    next(batches)
    assembler, cache = ds._assembler, ds._cache
    first = cache_key(ds.snapshot.shards[0])
    next(batches)
    assert set(assembler.cache) == {0}  # shard 0 is read again by this batch: kept
    batch = next(batches)  # shard 1: shard 0 is read no more this pass
    assert set(assembler.cache) == {1}
    cache.maps_dropped()
    assert not cache._maps.get(first) and first in cache._state  # still cached, mapped by no one: room to take
    assert batch["image"][:, 0, 0, 0].tolist() == [8, 9, 10, 11]  # self-identifying pixels: samples 8-11
    assert [b["image"][:, 0, 0, 0].tolist() for b in batches] == [[12, 13, 14, 15], [16, 17, 18, 19],
                                                                  [20, 21, 22, 23]]


def test_dropped_maps_free_their_room_when_the_reader_says_so(dataset, tmp_path):  # noqa: F811
    units, shape = units_of(dataset)
    cache = ShardCache(units, FolderStore(dataset), str(tmp_path / "cache"), sum(u.size for u in units), shape=shape)
    try:
        cache.plan([[0], [1]])
        pixels = cache.pixels(0)
        cache.advance(1)  # shard 0 is read no more: a download thread's scan would keep a doomed shard still read
        key = units[0].key
        doom(cache, key)
        assert key in cache.doomed() and os.path.exists(cache.path(key))  # kept while mapped
        del pixels  # the map's finalizer only notes it (it takes no lock); the reader then says so
        cache.maps_dropped()
        assert key not in cache.doomed() and not os.path.exists(cache.path(key))
        assert bytes(np.ascontiguousarray(cache.pixels(1))) == local_pixels(dataset, units[1]).tobytes()
    finally:
        cache.close()


class MeetingStore(FolderStore):
    """Each download waits until ``parties`` downloads are under way at once (a barrier): one at a time, the
    first would wait for the others and break it."""

    def __init__(self, root: str, parties: int) -> None:
        super().__init__(root)
        self.barrier = threading.Barrier(parties, timeout=60)
        self.lock = threading.Lock()
        self.started = 0

    def download(self, path: str, local_path: str, algorithm: str) -> str:
        with self.lock:
            meets, self.started = self.started < self.barrier.parties, self.started + 1
        if meets:  # the first ``parties`` downloads
            self.barrier.wait()
        return super().download(path, local_path, algorithm)


def test_the_download_threads_fetch_the_sequence_at_once(dataset, tmp_path):  # noqa: F811
    units, shape = units_of(dataset)
    store = MeetingStore(dataset, parties=4)
    cache = ShardCache(units, store, str(tmp_path / "cache"), sum(u.size for u in units), shape=shape, threads=4)
    try:
        cache.plan([[shard] for shard in range(len(units))])
        for shard in range(len(units)):
            cache.advance(shard)
            assert bytes(np.ascontiguousarray(cache.pixels(shard))) == local_pixels(dataset, units[shard]).tobytes()
        assert store.started >= len(units) and not store.barrier.broken  # each unit: its .npy and its .jsonl
    finally:
        cache.close()
