"""yuv420 on the device, run on the CPU device with torch's ops (the code CUDA runs): the planes converted by
``shardio.train.yuv_device`` are the CPU reader's bytes, ``DeviceLoader(decode_on_device=True)`` gives the
normalised batches of the CPU conversion + ``to_device`` (equal, and so within float tolerance), an augmenting
``transform`` sees the same converted images, and planes are staged as (B, S) batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dataset_fixtures import write_inputs
from shardio import DeviceLoader, ShardDataset
from shardio.format.yuv_shard import rgb_to_yuv420, yuv420_to_rgb, yuv_sample_bytes
from shardio.read.yuv_pixels import YuvPlanes
from shardio.train.augment import TrainAugment
from shardio.train.loader import _affine, to_device
from shardio.train.staging import StagingPools
from shardio.train.yuv_device import yuv420_normalized, yuv420_rgb

HEIGHT, WIDTH = 15, 10


@pytest.fixture(scope="module")
def yuv_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("yuv") / "ds")
    rng = np.random.default_rng(11)
    images = rng.integers(0, 256, (30, HEIGHT, WIDTH, 3), dtype=np.uint8)

    def meta_for(index: int, number: int, name: str) -> dict:
        return {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg", "width": WIDTH, "height": HEIGHT,
                "cls": index}

    write_inputs(directory, (17, 13), meta_for, height=HEIGHT, width=WIDTH, samples_per_shard=6,
                 config={"height": HEIGHT, "width": WIDTH, "encoding": "yuv420"},
                 pixels_for=lambda index: images[index], encoding="yuv420")
    return directory


@pytest.mark.parametrize("shape", [(1, 1), (7, 9), (16, 16), (9, 32)])
def test_the_torch_conversion_is_the_readers_bytes(shape):
    rng = np.random.default_rng(shape[0])
    images = rng.integers(0, 256, (5, *shape, 3), dtype=np.uint8)
    planes = np.stack([rgb_to_yuv420(image) for image in images])
    expected = yuv420_to_rgb(planes, *shape)
    assert torch.equal(yuv420_rgb(torch.from_numpy(planes), *shape), torch.from_numpy(expected))
    # Every extreme chroma pair on a dark and a bright Y: the clamps and the arithmetic shift of negatives.
    extremes = np.zeros((4, yuv_sample_bytes(2, 2)), np.uint8)
    extremes[:, :4] = [[0] * 4, [255] * 4, [0] * 4, [255] * 4]
    extremes[:, 4:] = [[0, 255], [0, 255], [255, 0], [255, 0]]
    assert torch.equal(yuv420_rgb(torch.from_numpy(extremes), 2, 2), torch.from_numpy(yuv420_to_rgb(extremes, 2, 2)))


def test_normalised_planes_equal_to_device_of_the_cpu_conversion():
    images = np.random.default_rng(3).integers(0, 256, (4, 7, 9, 3), dtype=np.uint8)
    planes = torch.from_numpy(np.stack([rgb_to_yuv420(image) for image in images]))
    rgb = torch.from_numpy(yuv420_to_rgb(planes.numpy(), 7, 9))
    reference = to_device({"image": rgb}, "cpu")["image"]
    scale, shift = _affine(tuple(np.array([0.485, 0.456, 0.406]) * 255), tuple(np.array([0.229, 0.224, 0.225]) * 255),
                           torch.device("cpu"), torch.float32)
    fused = yuv420_normalized(planes, 7, 9, scale, shift)
    assert fused.shape == reference.shape == (4, 3, 7, 9)
    assert fused.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-6)
    assert torch.equal(to_device({"image": YuvPlanes(planes, 7, 9)}, "cpu")["image"], reference)


def test_the_device_loader_converts_planes_as_the_cpu_path_does(yuv_dir):
    on_device = list(DeviceLoader(ShardDataset(yuv_dir, 8, shuffle=True, seed=4), "cpu", decode_on_device=True))
    on_cpu = list(DeviceLoader(ShardDataset(yuv_dir, 8, shuffle=True, seed=4), "cpu"))
    assert len(on_device) == len(on_cpu) == 4
    for a, b in zip(on_device, on_cpu):
        assert torch.equal(a["cls"], b["cls"])
        assert a["image"].dtype == torch.float32 and a["image"].shape == b["image"].shape
        torch.testing.assert_close(a["image"], b["image"], rtol=0, atol=1e-6)


def test_an_augmenting_transform_crops_the_converted_images(yuv_dir):
    def loader(on_device: bool) -> list[dict]:
        ds = ShardDataset(yuv_dir, 8, shuffle=True, seed=4)
        augment = TrainAugment(8, scale=(0.3, 1.0), seed=9)
        return list(DeviceLoader(ds, "cpu", transform=augment, decode_on_device=on_device))

    for a, b in zip(loader(True), loader(False)):
        assert a["image"].shape == (len(a["cls"]), 3, 8, 8)
        torch.testing.assert_close(a["image"], b["image"], rtol=0, atol=1e-6)


def test_planes_are_staged_as_a_batch_of_rows(yuv_dir):
    loader = DeviceLoader(ShardDataset(yuv_dir, 8, decode="device"), "cpu", decode_on_device=True)
    loader.staging = StagingPools(2, allocate=lambda shape, dtype: torch.empty(shape, dtype=dtype))
    batch = next(iter(ShardDataset(yuv_dir, 8, shuffle=True, seed=1, decode="device")))
    staged_batch, staged = loader._staged(batch)
    assert isinstance(staged_batch["image"], YuvPlanes) and staged is not None
    assert loader.staging.shapes() == [(yuv_sample_bytes(HEIGHT, WIDTH),)]
    assert torch.equal(staged_batch["image"].planes, batch["image"].planes)
    loader.staging.release(staged, None)


def test_a_jpeg_decoder_is_refused_for_a_yuv420_dataset(yuv_dir):
    with pytest.raises(ValueError, match=r"device_decoder= decodes JPEG batches; this dataset is yuv420"):
        DeviceLoader(ShardDataset(yuv_dir, 8), "cpu", device_decoder=lambda images: images)
