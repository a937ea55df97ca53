"""Reading a yuv420 dataset: batches are uint8 RGB [B, H, W, 3] equal to the conversion of the stored planes
(every sample once, shuffled, across partial shards), the numpy fallback gives the same bytes as the native
conversion, ``decode="device"`` hands out the stored planes (in DataLoader workers too), and ``sample(i)``
converts one sample."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dataset_fixtures import assert_exactly_once, write_inputs
from shardio import ShardDataset
from shardio.format.manifests import load_manifest
from shardio.format.yuv_shard import rgb_to_yuv420, yuv420_to_rgb
from shardio.read import yuv_pixels
from shardio.read.yuv_pixels import YuvPlanes
from shardio.train.loader import ShardLoader

HEIGHT, WIDTH = 11, 13  # odd sides: chroma planes 6 x 7
INPUTS = (20, 17, 9)  # 46 samples in shards of 8: every input ends in a partial shard
TOTAL = sum(INPUTS)


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (TOTAL, HEIGHT, WIDTH, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def yuv_dir(tmp_path_factory, images) -> str:
    directory = str(tmp_path_factory.mktemp("yuv") / "ds")

    def meta_for(index: int, number: int, name: str) -> dict:
        return {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg", "width": WIDTH, "height": HEIGHT,
                "cls": index, "txt": f"caption {index}"}

    write_inputs(directory, INPUTS, meta_for, height=HEIGHT, width=WIDTH, samples_per_shard=8,
                 config={"height": HEIGHT, "width": WIDTH, "encoding": "yuv420"},
                 pixels_for=lambda index: images[index], encoding="yuv420")
    return directory


@pytest.fixture(scope="module")
def stored_rgb(yuv_dir) -> np.ndarray:
    """Each sample's RGB as the numpy reference converts its stored planes, by its index (= its label)."""
    rows = [np.load(os.path.join(yuv_dir, entry.path)) for entry in load_manifest(yuv_dir).shards]
    planes = np.concatenate(rows)
    return yuv420_to_rgb(planes, HEIGHT, WIDTH)


def epoch(ds: ShardDataset) -> list[dict]:
    return list(ds)


def check_batches(batches: list[dict], stored_rgb: np.ndarray) -> None:
    seen = []
    for batch in batches:
        image = batch["image"]
        assert image.dtype == torch.uint8 and tuple(image.shape[1:]) == (HEIGHT, WIDTH, 3)
        labels = batch["cls"].numpy()
        assert np.array_equal(image.numpy(), stored_rgb[labels]), "a batch differs from its stored planes"
        assert batch["__key__"] == [f"s{i:06d}" for i in labels]
        seen.extend(labels.tolist())
    assert_exactly_once(np.array(seen), TOTAL)


def test_shuffled_batches_are_the_conversion_of_the_stored_planes(yuv_dir, stored_rgb):
    check_batches(epoch(ShardDataset(yuv_dir, 7, shuffle=True, seed=5)), stored_rgb)
    check_batches(epoch(ShardDataset(yuv_dir, 8, shuffle=False)), stored_rgb)  # one-slice batches too


def test_sample_converts_one_sample(yuv_dir, stored_rgb):
    ds = ShardDataset(yuv_dir, 4)
    for index in (0, 9, TOTAL - 1):
        sample = ds.sample(index)
        assert sample["image"].shape == (HEIGHT, WIDTH, 3) and sample["cls"] == index
        assert np.array_equal(sample["image"], stored_rgb[index])


def test_the_numpy_fallback_gives_the_same_batches(yuv_dir, stored_rgb, monkeypatch):
    native = [b["image"].clone() for b in ShardDataset(yuv_dir, 7, shuffle=True, seed=2)]
    monkeypatch.setattr(yuv_pixels, "_gather", None)
    assert not yuv_pixels.native()
    fallback = epoch(ShardDataset(yuv_dir, 7, shuffle=True, seed=2))
    assert all(torch.equal(a, b["image"]) for a, b in zip(native, fallback))
    check_batches(fallback, stored_rgb)


def test_device_batches_hand_out_the_stored_planes(yuv_dir, stored_rgb, images):
    ds = ShardDataset(yuv_dir, 7, shuffle=True, seed=5, decode="device")
    converted = epoch(ShardDataset(yuv_dir, 7, shuffle=True, seed=5))
    for planes_batch, rgb_batch in zip(epoch(ds), converted):
        planes = planes_batch["image"]
        assert isinstance(planes, YuvPlanes) and planes.shape == (len(planes), HEIGHT, WIDTH, 3)
        labels = planes_batch["cls"].numpy()
        expected = np.stack([rgb_to_yuv420(images[i]) for i in labels])
        assert np.array_equal(planes.planes.numpy(), expected), "the planes are not the stored ones"
        assert planes.nbytes() * 2 < images[:len(labels)].nbytes * 1.1
        assert np.array_equal(planes.convert(), rgb_batch["image"].numpy())
        assert np.array_equal(rgb_batch["image"].numpy(), stored_rgb[labels])


def test_dataloader_workers_send_planes_and_converted_batches(yuv_dir, stored_rgb):
    for decode in ("cpu", "device"):
        loader = ShardLoader(ShardDataset(yuv_dir, 6, shuffle=True, seed=1, decode=decode), num_workers=2)
        batches = list(loader)
        if decode == "device":
            assert all(isinstance(b["image"], YuvPlanes) for b in batches)
            batches = [{**b, "image": torch.from_numpy(b["image"].convert())} for b in batches]
        check_batches(batches, stored_rgb)


def test_a_raw_dataset_still_refuses_device_batches(tmp_path):
    directory = str(tmp_path / "raw")
    write_inputs(directory, (4,), lambda i, n, name: {"key": f"s{i}", "tar": name, "member": "m", "width": 4,
                                                       "height": 4}, height=4, width=4)
    with pytest.raises(ValueError, match=r"decode='device' is for JPEG datasets .*this one is raw"):
        ShardDataset(directory, 2, decode="device")
