"""yuv420 shards (``encoding: yuv420``, format version 5): the layout a stranger reads with numpy, exact sizes
for odd sides, a truncated or oversized shard refused naming it, the version rule, and the conversion against
the exact BT.601 equations in float.

Stated bounds (``shardio.format.yuv_shard``): the stored Y, Cb, Cr are the real equations' (2×2 means for
chroma) within 1 level; the RGB read back from stored planes is the exact inverse of those planes within 1
level per channel (measured on every (Y, Cb, Cr) triple: max 0 for R, 1 for G and B)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import shardio
from dataset_fixtures import write_inputs
from shardio import ShardDataset
from shardio.errors import ShardFormatError, ShardIntegrityError
from shardio.format import YUV420_FORMAT_VERSION, dataset_format_version
from shardio.format.manifests import load_manifest
from shardio.format.yuv_shard import (parse_yuv_header, rgb_to_yuv420, split_planes, yuv420_to_rgb, yuv_header,
                                      yuv_sample_bytes, yuv_shard_nbytes)
from shardio.read import yuv_pixels
from tests.legacy_format import legacy_doc, write_legacy

ODD = (7, 9)  # H, W: both sides odd, so the chroma planes round up (4 x 5)


def random_images(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def yuv_dataset(directory: str, images: np.ndarray, inputs: tuple[int, ...] = (8, 5), per_shard: int = 4) -> None:
    height, width = images.shape[1:3]

    def meta_for(index: int, number: int, name: str) -> dict:
        return {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg", "width": width, "height": height,
                "cls": index}

    write_inputs(directory, inputs, meta_for, height=height, width=width, samples_per_shard=per_shard,
                 config={"height": height, "width": width, "encoding": "yuv420"},
                 pixels_for=lambda index: images[index], encoding="yuv420")


def exact_forward(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The real equations in float64: Y per pixel, Cb and Cr the mean over each 2×2 block's pixels."""
    f = rgb.astype(np.float64)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    y = 0.299 * r + 0.587 * g + 0.114 * b
    cb = -0.168736 * r - 0.331264 * g + 0.5 * b + 128
    cr = 0.5 * r - 0.418688 * g - 0.081312 * b + 128
    height, width = y.shape
    rows = np.minimum(np.arange(2 * ((height + 1) // 2)), height - 1)
    cols = np.minimum(np.arange(2 * ((width + 1) // 2)), width - 1)

    def block_mean(c: np.ndarray) -> np.ndarray:
        return c[rows][:, cols].reshape(len(rows) // 2, 2, len(cols) // 2, 2).mean(axis=(1, 3))

    return y, block_mean(cb), block_mean(cr)


def exact_inverse(y: np.ndarray, cb: np.ndarray, cr: np.ndarray) -> np.ndarray:
    """RGB from planes in float64, each chroma sample over its 2×2 block, rounded and clamped."""
    height, width = y.shape
    up = lambda c: np.repeat(np.repeat(c.astype(np.float64) - 128, 2, 0), 2, 1)[:height, :width]  # noqa: E731
    u, v, luma = up(cb), up(cr), y.astype(np.float64)
    rgb = np.stack([luma + 1.402 * v, luma - 0.344136 * u - 0.714136 * v, luma + 1.772 * u], axis=-1)
    return np.clip(np.floor(rgb + 0.5), 0, 255)


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 1), ODD, (16, 16), (33, 2)])
def test_sizes_hold_for_odd_sides(shape):
    height, width = shape
    chroma = ((height + 1) // 2) * ((width + 1) // 2)
    assert yuv_sample_bytes(height, width) == height * width + 2 * chroma
    assert yuv_shard_nbytes(5, height, width) == 128 + 5 * (height * width + 2 * chroma)
    header = yuv_header(5, height, width)
    assert len(header) == 128 and parse_yuv_header(header, "x") == (5, yuv_sample_bytes(height, width))
    planes = rgb_to_yuv420(random_images(1, height, width)[0])
    y, cb, cr = split_planes(planes, height, width)
    assert y.shape == (height, width) and cb.shape == cr.shape == ((height + 1) // 2, (width + 1) // 2)
    assert yuv_sample_bytes(256, 256) * 2 == 256 * 256 * 3  # 1.5 bytes a pixel at even sides


@pytest.mark.parametrize("shape", [ODD, (16, 16), (31, 64)])
def test_the_stored_planes_are_the_exact_equations_within_one_level(shape):
    for rgb in random_images(6, *shape, seed=shape[0]):
        y, cb, cr = split_planes(rgb_to_yuv420(rgb), *shape)
        for stored, exact in zip((y, cb, cr), exact_forward(rgb)):
            assert np.abs(stored.astype(np.float64) - np.clip(exact, 0, 255)).max() <= 1


def test_the_conversion_back_is_the_exact_inverse_within_one_level_on_every_triple():
    # Every (Y, Cb, Cr): 2 x 512 samples, one Cr each, Cb over the chroma columns, four Y values per block.
    height, width, count = 2, 512, 256 * 64
    planes = np.zeros((count, yuv_sample_bytes(height, width)), np.uint8)
    luma = np.empty((count, height, width), np.uint8)
    k = np.tile(np.arange(64), 256)
    for row in range(2):
        for parity in range(2):
            luma[:, row, parity::2] = ((4 * k + 2 * row + parity) % 256)[:, None]
    y, cb, cr = split_planes(planes, height, width)
    y[...] = luma
    cb[...] = np.arange(256, dtype=np.uint8)
    cr[...] = np.repeat(np.arange(256), 64).astype(np.uint8)[:, None, None]
    native = np.empty((count, height, width, 3), np.uint8)
    yuv_pixels.convert_batch([yuv_pixels.YuvPixels("t", planes, height, width)], native, threads=2)
    fallback = yuv420_to_rgb(planes, height, width)
    assert np.array_equal(native, fallback), "the native conversion and numpy's differ"
    worst = np.zeros(3)
    for n in range(0, count, 1024):
        exact = np.stack([exact_inverse(y[i], cb[i], cr[i]) for i in range(n, n + 1024)])
        worst = np.maximum(worst, np.abs(native[n:n + 1024] - exact).reshape(-1, 3).max(axis=0))
    assert worst.max() <= 1, f"max abs error per channel {worst}"


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), ODD, (16, 17), (40, 40)])
def test_native_and_numpy_give_identical_bytes_over_pieces(shape):
    if not yuv_pixels.native():
        pytest.skip("the native gather is not built here")
    images = random_images(9, *shape, seed=3)
    planes = np.stack([rgb_to_yuv420(i) for i in images])
    pieces = [yuv_pixels.YuvPixels("t", planes[a:b], *shape) for a, b in ((0, 2), (2, 3), (3, 9))]
    native = np.empty((9, *shape, 3), np.uint8)
    fallback = np.empty_like(native)
    yuv_pixels.convert_batch(pieces, native, threads=3)
    yuv_pixels._convert_numpy([p.planes for p in pieces], fallback, *shape)
    assert np.array_equal(native, fallback)
    # A grey image survives exactly: Cb = Cr = 128 adds nothing back.
    grey = np.repeat(images[..., :1], 3, axis=-1)
    assert np.array_equal(yuv420_to_rgb(rgb_to_yuv420(grey[0]), *shape), grey[0])


def test_a_stranger_reads_a_shard_with_numpy_and_the_reader_agrees(tmp_path):
    images = random_images(13, *ODD)
    directory = str(tmp_path / "ds")
    yuv_dataset(directory, images)
    entry = load_manifest(directory).shards[0]
    path = os.path.join(directory, entry.path)
    assert path.endswith(".yuv.npy")
    planes = np.load(path, mmap_mode="r")
    assert planes.shape == (4, yuv_sample_bytes(*ODD)) and planes.dtype == np.uint8
    assert os.path.getsize(path) == yuv_shard_nbytes(4, *ODD) == entry.bytes
    ds = ShardDataset(directory, 4)
    assert np.array_equal(ds.sample(0)["image"], yuv420_to_rgb(np.asarray(planes[0]), *ODD))
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as f:
        root = json.load(f)
    assert root["format_version"] == YUV420_FORMAT_VERSION == 5 and "buckets" not in root
    assert root["config"]["encoding"] == "yuv420"


@pytest.mark.parametrize("change", ["truncated", "oversized"])
def test_a_shard_of_the_wrong_size_is_refused_naming_it(tmp_path, change):
    directory = str(tmp_path / "ds")
    yuv_dataset(directory, random_images(13, *ODD))
    path = os.path.join(directory, load_manifest(directory).shards[1].path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if change == "truncated":
            f.truncate(size - 1)
        else:
            f.seek(size)
            f.write(b"\0")
    found = size + (1 if change == "oversized" else -1)
    with pytest.raises(ShardIntegrityError, match=rf"{os.path.basename(path)}: {found} bytes"):
        ShardDataset(directory, 4)


def test_a_header_that_disagrees_with_the_index_is_refused_naming_the_shard(tmp_path):
    directory = str(tmp_path / "ds")
    yuv_dataset(directory, random_images(13, *ODD))
    path = os.path.join(directory, load_manifest(directory).shards[0].path)
    with open(path, "r+b") as f:  # same size, the header of another shape: a shard from elsewhere
        f.write(yuv_header(2, 7, 9 * 2))
    with pytest.raises(ShardIntegrityError, match=rf"{os.path.basename(path)}: header says 2 samples"):
        ShardDataset(directory, 4)
    with open(path, "r+b") as f:
        f.write(b"\0" * 8)
    with pytest.raises(ShardFormatError, match=rf"{os.path.basename(path)}: not a shardio yuv420 shard"):
        ShardDataset(directory, 4)


def test_the_version_rule_makes_yuv420_version_5_and_refuses_a_root_that_breaks_it(tmp_path):
    assert dataset_format_version({"encoding": "yuv420"}) == 5
    assert dataset_format_version({"encoding": "yuv420", "mode": "bucket"}) == 5
    assert dataset_format_version({"encoding": "jpeg"}) == 3 and dataset_format_version({"mode": "bucket"}) == 4
    directory = str(tmp_path / "ds")
    yuv_dataset(directory, random_images(13, *ODD))
    root_path = os.path.join(directory, "manifest.json")
    with open(root_path, encoding="utf-8") as f:
        root = json.load(f)
    for version in (3, 4):  # what an edit would make readable by an older reader: refused here
        with open(root_path, "w", encoding="utf-8") as f:
            json.dump({**root, "format_version": version}, f)
        with pytest.raises(ShardFormatError, match=rf"format_version {version} with config encoding 'yuv420'"):
            shardio.open_dataset(directory)
    with open(root_path, "w", encoding="utf-8") as f:  # version 5 over a raw config
        json.dump({**root, "config": {"height": 7, "width": 9}}, f)
    with pytest.raises(ShardFormatError, match=r"format_version 5 with a config whose encoding is not 'yuv420'"):
        shardio.open_dataset(directory)
    with open(root_path, "w", encoding="utf-8") as f:
        json.dump(root, f)
    write_legacy(directory, legacy_doc(directory))  # the one-document form an older reader accepts
    with pytest.raises(ShardFormatError, match=r"format_version 2 with config encoding 'yuv420'"):
        shardio.open_dataset(directory)


def test_the_writer_refuses_planes_of_another_size(tmp_path):
    from shardio.write.shard_writer import YuvShardWriter

    writer = YuvShardWriter(str(tmp_path), "x-00000", *ODD)
    try:
        with pytest.raises(ValueError, match=r"not the \(103,\) uint8 planes of a 7x9 image"):
            writer.add(np.zeros(102, np.uint8), {})
    finally:
        writer.abort()
