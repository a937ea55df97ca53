"""A yuv420 dataset on object storage reads through the shard cache as it reads locally: the same converted
batches and the same planes (``decode="device"``), the cached file's header checked against its shape."""

from __future__ import annotations

import numpy as np
import torch

from shardio import ShardDataset
from shardio.read.yuv_pixels import YuvPlanes
from tests.read.test_reader_s3 import upload
from tests.read.test_yuv_reader import yuv_dir, images  # noqa: F401 - the module's dataset fixtures


def test_batches_from_the_bucket_equal_the_local_ones(s3_server, s3_bucket, yuv_dir, tmp_path):  # noqa: F811
    url = upload(s3_server, s3_bucket, yuv_dir, prefix="yuv")
    for decode in ("cpu", "device"):
        local = list(ShardDataset(yuv_dir, 7, shuffle=True, seed=3, decode=decode))
        remote = list(ShardDataset(url, 7, shuffle=True, seed=3, decode=decode, cache_dir=str(tmp_path / decode)))
        assert len(local) == len(remote) > 0
        for a, b in zip(local, remote):
            assert a["__key__"] == b["__key__"]
            if decode == "device":
                assert isinstance(b["image"], YuvPlanes)
                assert torch.equal(a["image"].planes, b["image"].planes)
            else:
                assert torch.equal(a["image"], b["image"])
    assert np.array_equal(ShardDataset(url, 4, cache_dir=str(tmp_path / "one")).sample(3)["image"],
                          ShardDataset(yuv_dir, 4).sample(3)["image"])
