"""A bucketed dataset on object storage (the session's SeaweedFS): opened by URL, its sizes checked per
bucket from the listing, each shard read through the shard cache at its own bucket's shape, the same
pixels and keys as the local copy; a shard whose header says another bucket is refused at download."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from bucket_fixtures import BUCKETS, make_bucketed_dataset
from shardio.errors import ShardError
from shardio.read.dataset import ShardDataset
from shardio.read.snapshot import open_dataset
from tests.read.test_reader_s3 import upload


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_a_bucketed_dataset_reads_from_a_bucket_at_each_shards_shape(s3_server, s3_bucket, tmp_path, monkeypatch,
                                                                     encoding):
    monkeypatch.setenv("SHARDIO_CACHE_DIR", str(tmp_path / "cache"))
    local = make_bucketed_dataset(str(tmp_path / "local"), BUCKETS, (10, 9, 7), encoding=encoding)
    url = upload(s3_server, s3_bucket, local)
    near, far = open_dataset(local), open_dataset(url)
    assert far.is_bucketed and far.buckets == BUCKETS
    assert far.shard_buckets.tolist() == near.shard_buckets.tolist()
    for shard in range(len(far.shards)):
        pixels = np.asarray(far.pixels(shard))
        assert pixels.shape == (far.shards[shard].samples, *far.shard_shape(shard), 3)
        assert (pixels == np.asarray(near.pixels(shard))).all()
        assert far.meta(shard).keys == near.meta(shard).keys


def test_a_remote_shard_whose_header_says_another_bucket_is_refused(s3_server, s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDIO_CACHE_DIR", str(tmp_path / "cache"))
    local = make_bucketed_dataset(str(tmp_path / "local"), ((8, 12), (12, 8)), (8, 8), inputs=1)
    snapshot = open_dataset(local)
    shard = int(np.flatnonzero(snapshot.shard_buckets == 0)[0])
    entry = snapshot.shards[shard]
    path = os.path.join(local, entry.path)
    data = open(path, "rb").read().replace(b"(8, 8, 12, 3)", b"(8, 12, 8, 3)", 1)
    open(path, "wb").write(data)  # same size; the checksum is checked after the header, so fix it too
    from shardio.store.checksum import file_checksum
    from tests.format.test_bucket_format import rewrite_segment

    digest = bytes.fromhex(file_checksum(path, entry.checksum_algorithm))

    def forge(arrays):
        arrays["shard_digest"] = arrays["shard_digest"].copy()
        arrays["shard_digest"][shard, :len(digest)] = np.frombuffer(digest, np.uint8)

    rewrite_segment(local, forge)
    url = upload(s3_server, s3_bucket, local, prefix="forged")
    far = open_dataset(url)
    with pytest.raises(ShardError, match=r"header says \(8, 12, 8\), the shard's images are \(8, 12\)"):
        far.pixels(shard)


def test_a_bucketed_dataset_the_default_cache_holds_reads_the_local_order(s3_server, s3_bucket, tmp_path):
    """The default cache_limit (the dataset's size) holds every bucket's shards: one window per bucket
    needs no shrinking, so there is no warning and the epoch's batches are the local copy's."""
    local = make_bucketed_dataset(str(tmp_path / "local"), BUCKETS, (23, 41, 9), samples_per_shard=6)
    url = upload(s3_server, s3_bucket, local)
    here = ShardDataset(local, 4, shuffle=True, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        there = ShardDataset(url, 4, shuffle=True, seed=5, cache_dir=str(tmp_path / "cache"))
    assert there.shuffle_window == here.shuffle_window
    near, far = list(here), list(there)
    assert [b["__key__"] for b in far] == [b["__key__"] for b in near]
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(near, far, strict=True))
