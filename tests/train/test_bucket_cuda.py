"""Bucketed datasets on a real GPU (skipped without CUDA; ``make gpu-check`` runs them on a GPU machine):
DeviceLoader stages unpinned batches of every bucket's shape in its pinned pools and reuses them, the bytes
arriving intact; augmentation keeps each batch's shape on the device; a bucketed JPEG dataset decodes with
nvJPEG batch by batch at each bucket's shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bucket_fixtures import BUCKETS, key_bucket, make_bucketed_dataset

from shardio import DeviceLoader, ShardDataset, ShardLoader
from shardio.train.augment import TrainAugment

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore:decoding JPEG batches on the device with torchvision")]

IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
SAMPLES = (100, 150, 60)


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("cuda-buckets") / "ds"), samples=SAMPLES)


@pytest.fixture(scope="module")
def jpeg_dir(tmp_path_factory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("cuda-buckets-jpeg") / "ds"), samples=SAMPLES,
                                 encoding="jpeg")


def dataset(path: str) -> ShardDataset:
    return ShardDataset(path, 8, shuffle=True, drop_last=False)


def test_unpinned_bucketed_batches_are_staged_in_a_pool_per_shape_and_arrive_intact(raw_dir):
    reference = [(b["__key__"], b["image"].clone()) for b in dataset(raw_dir)]
    loader = DeviceLoader(ShardLoader(dataset(raw_dir)), "cuda", prefetch=2, **IDENTITY)  # not pinned
    got = [(b["__key__"], b["image"]) for b in loader]
    torch.cuda.synchronize()
    assert len(got) == len(reference) > 30
    for (keys, image), (ref_keys, ref_image) in zip(got, reference):
        assert keys == ref_keys and image.is_cuda
        assert torch.equal(image.permute(0, 2, 3, 1).to(torch.uint8).cpu(), ref_image)
    staging = loader.staging
    assert staging is not None and set(staging.shapes()) == {(h, w, 3) for h, w in BUCKETS}
    # at most depth buffers a shape, each made again at most once (a short batch of a shape came first)
    assert staging.allocations <= 2 * len(BUCKETS) * staging.depth < len(got), "reused, not made per step"
    assert all(slot.buffer.is_pinned() for pool in staging.pools.values() for slot in pool)


def test_augment_keeps_each_bucketed_batchs_shape_on_the_gpu(raw_dir):
    for batch in DeviceLoader(dataset(raw_dir), "cuda", transform=TrainAugment(seed=0)):
        bucket = batch["bucket"]
        assert {key_bucket(k) for k in batch["__key__"]} == {bucket}
        assert batch["image"].is_cuda and tuple(batch["image"].shape[2:]) == BUCKETS[bucket]


def test_a_bucketed_jpeg_dataset_decodes_on_the_gpu_at_each_buckets_shape(jpeg_dir):
    from shardio.train import device_decode

    if not device_decode.available():
        pytest.skip("neither torchcodec nor torchvision decodes here")
    cpu = [b["image"].clone() for b in dataset(jpeg_dir)]
    gpu = list(DeviceLoader(dataset(jpeg_dir), "cuda", decode_on_device=True, **IDENTITY))
    assert len(gpu) == len(cpu)
    for batch, reference in zip(gpu, cpu):
        assert tuple(batch["image"].shape[2:]) == BUCKETS[batch["bucket"]]
        difference = (batch["image"].permute(0, 2, 3, 1).cpu() - reference.float()).abs()
        # docs/reader.md, "Decoding JPEG batches on the GPU": every pixel within 8 levels, mean under 1
        assert float(difference.max()) <= 8 and float(difference.mean()) < 1.0
    assert np.isfinite(float(gpu[-1]["image"].mean().cpu()))
