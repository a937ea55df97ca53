"""JPEG batches handed out encoded (``ShardDataset(decode="device")``): the same samples, order, rank split and
resume as decoded batches; each sample's bytes are the shard's own, viewed in place; decoding them on the CPU
gives the decoded batch's pixels exactly (a bucketed dataset's at each batch's bucket shape); bad input is named by
shard and sample."""

from __future__ import annotations

import os

import numpy as np
import pytest
from dataset_fixtures import make_dataset
from layout_fixtures import Layout, LayoutDataset

from shardio import ShardDataset, ShardLoader
from shardio.errors import ShardIntegrityError
from shardio.format.jpeg_shard import jpeg_data_start
from shardio.format.manifests import load_manifest
from shardio.read.jpeg_pixels import EncodedImages


@pytest.fixture(scope="module")
def jpeg_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("jpeg-encoded"))
    make_dataset(directory, encoding="jpeg", height=16, width=16)  # 117 samples, shards of 8, partial ends
    return directory


def pairs(jpeg_dir: str, batch_size: int = 10, **options) -> list[tuple[dict, dict]]:
    """An epoch's batches decoded and encoded, side by side."""
    decoded = list(ShardDataset(jpeg_dir, batch_size, **options))
    encoded = list(ShardDataset(jpeg_dir, batch_size, decode="device", **options))
    assert len(decoded) == len(encoded) > 0
    return list(zip(decoded, encoded))


@pytest.fixture(scope="module")
def jpeg_layouts(tmp_path_factory: pytest.TempPathFactory, jpeg_dir: str) -> dict[str, LayoutDataset]:
    """This suite's JPEG dataset (16x16) and a bucketed JPEG dataset (three shapes)."""
    single = LayoutDataset(jpeg_dir, "single", "jpeg", [(16, 16)], [117])
    return {"single": single, "buckets": Layout("buckets").make(str(tmp_path_factory.mktemp("jpeg-buckets")), "jpeg")}


@pytest.mark.parametrize("layout_name", ["single", "buckets"])
@pytest.mark.parametrize("options", [{}, {"shuffle": True, "seed": 3}, {"shuffle": True, "rank": 1, "world_size": 3},
                                     {"shuffle": True, "drop_last": True, "world_size": 2},
                                     {"shuffle": True, "seed": 6, "batch_size": 4}])
def test_encoded_batches_hold_the_decoded_batches_samples_and_pixels(jpeg_layouts, layout_name, options):
    """Also in a bucketed dataset: an encoded batch carries its bucket and that bucket's shape."""
    data = jpeg_layouts[layout_name]
    for decoded, encoded in pairs(data.path, **options):
        images = encoded["image"]
        assert isinstance(images, EncodedImages) and images.shape == tuple(decoded["image"].shape)
        assert encoded["__key__"] == decoded["__key__"] and encoded["txt"] == decoded["txt"]
        assert encoded.get("bucket") == decoded.get("bucket")
        data.check(decoded)  # one bucket's shape, every sample of it
        assert images.shape == (len(decoded["__key__"]), *data.shapes[decoded.get("bucket", 0)], 3)
        assert np.array_equal(encoded["cls"].numpy(), decoded["cls"].numpy())
        assert np.array_equal(images.decode(), decoded["image"].numpy())


def test_each_jpeg_is_its_shards_bytes_viewed_in_place(jpeg_dir):
    ds = ShardDataset(jpeg_dir, 8, decode="device")  # unshuffled: batch 0 is shard 0, batch 1 shard 1
    batches = iter(ds)
    next(batches)
    images = next(batches)["image"]
    shard = load_manifest(jpeg_dir).shards[1]
    with open(os.path.join(jpeg_dir, shard.path), "rb") as f:
        whole = f.read()
    offsets = np.frombuffer(whole[128:jpeg_data_start(8)], "<u8")
    data = whole[jpeg_data_start(8):]
    assert [bytes(jpeg) for jpeg in images.jpegs] == [data[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    assert images.sources == [(os.path.join(jpeg_dir, shard.path), 0, 8)]
    mapped = ds.shard(1)[0].data
    assert all(np.shares_memory(jpeg, mapped) for jpeg in images.jpegs), "a JPEG was copied out of the map"


def test_a_resumed_pass_continues_with_the_same_samples_either_way(jpeg_dir):
    for first, second in (("cpu", "device"), ("device", "cpu")):
        ds = ShardDataset(jpeg_dir, 10, shuffle=True, decode=first)
        batches = iter(ds)
        head = [next(batches)["__key__"] for _ in range(4)]
        resumed = ShardDataset(jpeg_dir, 10, shuffle=True, decode=second)
        resumed.load_state_dict(ds.state_dict())
        rest = [batch["__key__"] for batch in resumed]
        whole = [batch["__key__"] for batch in ShardDataset(jpeg_dir, 10, shuffle=True)]
        assert head + rest == whole


def test_workers_hand_out_encoded_batches_of_the_same_samples(jpeg_dir):
    expected = list(ShardDataset(jpeg_dir, 10, shuffle=True))
    ds = ShardDataset(jpeg_dir, 10, shuffle=True, decode="device")
    got = list(ShardLoader(ds, num_workers=2))
    assert [b["__key__"] for b in got] == [b["__key__"] for b in expected]
    for batch, reference in zip(got, expected):
        assert np.array_equal(batch["image"].decode(), reference["image"].numpy())
    assert ds.state_dict()["batches_seen"] == len(expected)


def test_a_loader_can_ask_for_encoded_batches_from_a_decoding_dataset(jpeg_dir):
    for workers in (0, 2):
        loader = ShardLoader(ShardDataset(jpeg_dir, 10), num_workers=workers)
        epoch_pass = loader.begin_pass()
        batches = list(loader.iter_pass(epoch_pass, encoded=True))
        assert all(isinstance(b["image"], EncodedImages) for b in batches)
        assert loader.dataset.decode == "cpu", "the loader's request outlived the pass it was made for"


def test_decode_device_is_refused_for_a_raw_dataset_and_unknown_values(tmp_path, jpeg_dir):
    raw = str(tmp_path / "raw")
    make_dataset(raw, (10,))
    with pytest.raises(ValueError, match=rf"{raw}: decode='device' is for JPEG datasets.*raw"):
        ShardDataset(raw, 4, decode="device")
    ds = ShardDataset(raw, 4)
    with pytest.raises(ValueError, match=rf"{raw}: encoded batches are for JPEG datasets"):
        ds.iter_pass(ds.begin_pass(), encoded=True)
    with pytest.raises(ValueError, match=r"decode must be one of \('cpu', 'device'\), got 'gpu'"):
        ShardDataset(jpeg_dir, 4, decode="gpu")


def test_a_corrupt_sample_decoded_on_the_cpu_is_named_by_shard_and_sample(tmp_path):
    directory = str(tmp_path / "ds")
    make_dataset(directory, (16,), encoding="jpeg", height=16, width=16)
    shard = load_manifest(directory).shards[1]
    path = os.path.join(directory, shard.path)
    offsets = np.load(path)
    with open(path, "r+b") as f:  # sample 5's entropy-coded data overwritten; size unchanged
        start = jpeg_data_start(8) + int(offsets[5])
        length = int(offsets[6] - offsets[5])
        f.seek(start + length // 2)
        f.write(b"\xff\x00" * 4 + b"\x13" * (length // 2 - 10))
    images = next(iter(ShardDataset(directory, 16, decode="device")))["image"]  # handed out undecoded
    with pytest.raises(ShardIntegrityError, match=rf"{shard.path}: sample 5: corrupt JPEG"):
        images.decode()


def test_an_empty_encoded_batch_decodes_to_no_images():
    images = EncodedImages([], 16, 16, [("shards/x.jpg.npy", 0, 0)])
    assert images.decode().shape == (0, 16, 16, 3) and images.nbytes() == 0
