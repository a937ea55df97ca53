"""DeviceLoader, augmentation and the device decode over real bucketed datasets (``tests/bucket_fixtures.py``,
raw and JPEG): one bucket's shape per batch, every sample once, each sample its own epoch position (so its
own crop), mid-epoch resume through the prefetching loader."""

from __future__ import annotations

import pytest
import torch
from bucket_fixtures import BUCKETS, key_bucket, key_index, make_bucketed_dataset
from test_bucket_training import IDENTITY, PillowDecode

from shardio import DeviceLoader, ShardDataset, ShardLoader
from shardio.train.augment import TrainAugment
from shardio.train.device_decode import DeviceDecoder


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("bucketed") / "ds"))  # 60 samples, 3 shapes


@pytest.fixture(scope="module")
def bucketed_jpeg(tmp_path_factory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("bucketed-jpeg") / "ds"), encoding="jpeg")


class PositionNoter:
    """A transform that notes each batch's positions around a ``TrainAugment``."""

    def __init__(self, inner) -> None:
        self.inner, self.positions = inner, []

    def __call__(self, image, *, epoch, positions, content_box=None):
        self.positions.append(positions.tolist())
        return self.inner(image, epoch=epoch, positions=positions, content_box=content_box)


def check_epoch(batches: list[dict], fixed: tuple[int, int] | None = None) -> None:
    keys = [key for batch in batches for key in batch["__key__"]]
    assert sorted(key_index(k) for k in keys) == list(range(60)), "every sample once"
    for batch in batches:
        assert {key_bucket(k) for k in batch["__key__"]} == {batch["bucket"]}, "one bucket per batch"
        assert tuple(batch["image"].shape[2:]) == (fixed or BUCKETS[batch["bucket"]])
    assert len({batch["bucket"] for batch in batches}) == 3


@pytest.mark.parametrize("wrap", ["dataset", "loader"])
@pytest.mark.parametrize("size", [None, 10])
def test_device_loader_with_augment_over_a_bucketed_dataset(bucketed, wrap, size):
    dataset = ShardDataset(bucketed, 8, shuffle=True, drop_last=False)
    source = dataset if wrap == "dataset" else ShardLoader(dataset)
    augment = PositionNoter(TrainAugment(size, seed=0))
    batches = list(DeviceLoader(source, "cpu", transform=augment, prefetch=2))
    check_epoch(batches, None if size is None else (size, size))
    positions = [p for batch in augment.positions for p in batch]
    assert sorted(positions) == list(range(60)), "each sample its own epoch position: its own crop"


def test_device_loader_over_a_bucketed_dataset_resumes_at_the_next_batch(bucketed):
    def loader() -> DeviceLoader:
        return DeviceLoader(ShardDataset(bucketed, 8, shuffle=True, drop_last=False), "cpu", prefetch=3,
                            **IDENTITY)

    reference = [(b["bucket"], b["__key__"]) for b in loader()]
    interrupted = loader()
    iterator = iter(interrupted)
    taken = [next(iterator) for _ in range(4)]
    resumed = loader()
    resumed.load_state_dict(interrupted.state_dict())
    rest = [(b["bucket"], b["__key__"]) for b in resumed]
    assert [(b["bucket"], b["__key__"]) for b in taken] + rest == reference


def test_a_bucketed_jpeg_dataset_decoded_on_the_device(bucketed_jpeg):
    cpu = list(DeviceLoader(ShardDataset(bucketed_jpeg, 8, shuffle=True), "cpu", **IDENTITY))
    decode = PillowDecode()
    loader = DeviceLoader(ShardDataset(bucketed_jpeg, 8, shuffle=True), "cpu",
                          device_decoder=DeviceDecoder("cpu", decode=decode), **IDENTITY)
    device = list(loader)
    loader.passes.join_ahead()  # the next epoch's first two batches, decoded at this one's end
    assert len(decode.calls) == len(device) + 2 and len(device) == len(cpu), "one decode call per batch"
    for on_cpu, on_device in zip(cpu, device):
        assert on_device["__key__"] == on_cpu["__key__"] and on_device["bucket"] == on_cpu["bucket"]
        assert tuple(on_device["image"].shape[2:]) == BUCKETS[on_device["bucket"]]
        assert torch.equal(on_device["image"], on_cpu["image"])  # libjpeg-turbo on both sides here
