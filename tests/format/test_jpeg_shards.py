"""JPEG shards (``encoding: jpeg``): the layout a stranger reads with numpy, bad input named by shard and
sample, the missing extension said plainly, and decoded pixels within the documented error of raw."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from PIL import Image

import shardio
from shardio.format.jpeg_shard import jpeg_frame_size
from shardio.format.manifests import load_manifest
from tests.legacy_format import legacy_doc, write_legacy
from dataset_fixtures import encode_jpeg, make_dataset, photo_like, write_inputs
from shardio import ShardDataset
from shardio.errors import MissingExtra, ShardFormatError, ShardIntegrityError
from shardio.format.jpeg_shard import jpeg_data_start
from shardio.read import jpeg_pixels


def shard_files(directory: str) -> list[str]:
    return [os.path.join(directory, entry.path) for entry in load_manifest(directory).shards]


@pytest.fixture
def jpeg_dir(tmp_path) -> str:
    directory = str(tmp_path / "ds")
    make_dataset(directory, (20,), encoding="jpeg", height=16, width=16)
    return directory


def test_a_stranger_reads_a_shard_with_numpy_and_pillow(jpeg_dir):
    path = shard_files(jpeg_dir)[0]
    assert path.endswith(".jpg.npy")
    offsets = np.load(path, mmap_mode="r")  # the header describes the offsets; numpy ignores the data after
    assert offsets.dtype == np.dtype("<u8") and len(offsets) == 9 and offsets[0] == 0
    data = np.memmap(path, np.uint8, "r", offset=jpeg_data_start(8))
    assert int(offsets[-1]) == len(data) == os.path.getsize(path) - jpeg_data_start(8)
    snapshot = shardio.open_dataset(jpeg_dir)
    decoded = np.asarray(snapshot.pixels(0))
    for i in range(8):
        by_pillow = np.asarray(Image.open(io.BytesIO(bytes(data[offsets[i]:offsets[i + 1]]))).convert("RGB"))
        assert np.array_equal(by_pillow, decoded[i]), f"sample {i}: the reader and Pillow disagree"


def test_the_manifest_says_version_3_and_an_older_version_with_jpeg_is_refused(jpeg_dir):
    with open(os.path.join(jpeg_dir, "manifest.json"), encoding="utf-8") as f:
        root = json.load(f)
    assert root["format_version"] == 3 and root["config"]["encoding"] == "jpeg"
    # The one-document form of versions 1-2, which an older reader accepts and would map JPEG bytes as
    # pixels: a JPEG dataset in it is refused.
    write_legacy(jpeg_dir, legacy_doc(jpeg_dir))
    with pytest.raises(ShardFormatError, match=r"format_version 2 with encoding jpeg"):
        shardio.open_dataset(jpeg_dir)


def test_a_truncated_shard_fails_at_open_naming_it(jpeg_dir):
    path = shard_files(jpeg_dir)[1]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ShardIntegrityError, match=rf"{os.path.basename(path)}.*truncated"):
        ShardDataset(jpeg_dir, 4)


def test_offsets_that_do_not_end_the_file_fail_at_open(jpeg_dir):
    path = shard_files(jpeg_dir)[0]
    with open(path, "r+b") as f:  # same size, last offset one short: a torn or forged shard
        f.seek(jpeg_data_start(8) - 8)
        last = int.from_bytes(f.read(8), "little")
        f.seek(jpeg_data_start(8) - 8)
        f.write((last - 1).to_bytes(8, "little"))
    with pytest.raises(ShardIntegrityError, match=rf"{os.path.basename(path)}: the offsets end at"):
        ShardDataset(jpeg_dir, 4)


def test_a_corrupt_jpeg_inside_a_shard_names_shard_and_sample(jpeg_dir):
    path = shard_files(jpeg_dir)[1]
    offsets = np.load(path)
    with open(path, "r+b") as f:  # sample 5's bytes overwritten after its headers; size unchanged
        start = jpeg_data_start(8) + int(offsets[5])
        length = int(offsets[6] - offsets[5])
        f.seek(start + length // 2)
        f.write(b"\xff\x00" * 4 + b"\x13" * (length // 2 - 10))
    ds = ShardDataset(jpeg_dir, 20)  # sizes agree: found when the batch is decoded, not silently grey
    with pytest.raises(ShardIntegrityError, match=rf"{os.path.basename(path)}: sample 5: corrupt JPEG"):
        next(iter(ds))


def test_without_the_extension_a_jpeg_dataset_says_what_to_install(jpeg_dir, monkeypatch):
    monkeypatch.setattr(jpeg_pixels, "_jpeg_batch", None)
    with pytest.raises(MissingExtra, match=r"shardio\.read\._jpeg_batch.*libjpeg-turbo headers"):
        next(iter(ShardDataset(jpeg_dir, 4)))


def test_raw_datasets_read_without_the_extension(tmp_path, monkeypatch):
    monkeypatch.setattr(jpeg_pixels, "_jpeg_batch", None)
    make_dataset(str(tmp_path / "raw"), (10,))
    assert sum(len(batch["image"]) for batch in ShardDataset(str(tmp_path / "raw"), 4)) == 10


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_the_batch_decode_is_the_same_on_any_number_of_threads(tmp_path, threads):
    def meta_for(index, number, name):
        return {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg", "width": 64, "height": 64}

    write_inputs(str(tmp_path), (13,), meta_for, height=64, width=64, samples_per_shard=13,
                 pixels_for=photo_like, encoding="jpeg")
    pieces = shardio.open_dataset(str(tmp_path)).pixels(0)
    one = np.empty((13, 64, 64, 3), np.uint8)
    jpeg_pixels.decode_batch([pieces], one, threads=1)
    many = np.empty_like(one)
    jpeg_pixels.decode_batch([pieces[:4], pieces[4:13]], many, threads=threads)
    assert np.array_equal(one, many)
    for i in range(13):  # each equals a single decode by Pillow of its own bytes
        assert np.array_equal(many[i], np.asarray(Image.open(io.BytesIO(encode_jpeg(photo_like(i)))).convert("RGB")))


def test_decoded_pixels_are_within_the_documented_error_of_raw(tmp_path):
    """Gradients with σ=3 Gaussian noise (incompressible: harder than the bench corpus's photos, whose median
    is ~40 dB at q90 4:4:4): each sample >= 37 dB (measured 38.3-38.6), and never grey or shifted."""
    def meta_for(index, number, name):
        return {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg", "width": 64, "height": 64}

    for encoding in ("raw", "jpeg"):
        write_inputs(str(tmp_path / encoding), (30,), meta_for, height=64, width=64, samples_per_shard=8,
                     pixels_for=photo_like, encoding=encoding)
    raw = next(iter(ShardDataset(str(tmp_path / "raw"), 30)))["image"].numpy().astype(np.float64)
    jpeg = next(iter(ShardDataset(str(tmp_path / "jpeg"), 30)))["image"].numpy().astype(np.float64)
    mse = ((raw - jpeg) ** 2).reshape(30, -1).mean(axis=1)
    psnr = 10 * np.log10(255.0**2 / mse)
    assert psnr.min() >= 37.0, f"PSNR {psnr.min():.1f} dB"
    assert 0 < np.abs(raw - jpeg).max() <= 32  # lossy, but no sample is grey or shifted


def test_info_shows_the_encoding_bytes_per_image_and_the_projection(jpeg_dir):
    from shardio.tools.info import dataset_info, format_info

    info = dataset_info(jpeg_dir)
    pixel_bytes = sum(os.path.getsize(p) for p in shard_files(jpeg_dir))
    assert info["encoding"] == "jpeg" and info["bytes_per_image"] == pixel_bytes / 20
    assert info["raw_bytes_per_image"] == 16 * 16 * 3
    line = next(line for line in format_info(info).splitlines() if line.startswith("encoding"))
    assert "jpeg" in line and "smaller than raw" in line and "1 M images" in line and "this dataset raw" in line


# --- a root's shape sizes what a reader allocates: bounded before anything is --------------------------------


def _claim_shape(directory: str, height: int, width: int) -> None:
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        root = json.load(f)
    root["shape"] = [height, width, 3]
    with open(path, "w") as f:
        json.dump(root, f)


def test_a_root_claiming_images_larger_than_any_writer_makes_is_refused_naming_it(jpeg_dir):
    """20000x20000 over small shards: 1.2 GB per sample decoded. Refused at open, before a byte is
    allocated, naming the root (the writer never writes a side over 8192)."""
    _claim_shape(jpeg_dir, 20000, 20000)
    words = rf"{os.path.join(jpeg_dir, 'manifest.json')}: shape \[20000, 20000, 3\] has a side outside 0\.\.8192"
    with pytest.raises(ShardFormatError, match=words):
        shardio.open_dataset(jpeg_dir)
    with pytest.raises(ShardFormatError, match=words):
        ShardDataset(jpeg_dir, 4)


def test_a_decode_over_the_budget_is_refused_naming_the_dataset_or_the_shard(jpeg_dir, monkeypatch):
    height, width, _ = shardio.open_dataset(jpeg_dir).shape
    monkeypatch.setenv("SHARDIO_MAX_DECODED_BYTES", str(3 * height * width * 3))  # three images
    with pytest.raises(ValueError, match=rf"{jpeg_dir}: decoding 4 JPEG image\(s\) of {height}x{width} takes .* over "
                                         r"the budget"):
        ShardDataset(jpeg_dir, 4)
    assert sum(len(b["__key__"]) for b in ShardDataset(jpeg_dir, 3, drop_last=False)) == len(
        shardio.open_dataset(jpeg_dir))
    snapshot = shardio.open_dataset(jpeg_dir)
    with pytest.raises(ValueError, match=rf"{snapshot.shards[0].path}: decoding \d+ JPEG image\(s\)"):
        np.asarray(snapshot.pixels(0))  # a whole shard at once


def test_a_jpegs_frame_size_is_read_from_its_header_without_decoding():
    """What verify checks a JPEG shard's first image by: the SOF's height and width, past any segment before it
    (EXIF, a progressive frame), and None for bytes that hold no frame header."""
    for options in ({}, {"progressive": True, "exif": b"Exif\x00\x00" + bytes(300)}):
        data = io.BytesIO()
        Image.new("RGB", (300, 20), (10, 20, 30)).save(data, "JPEG", **options)
        assert jpeg_frame_size(data.getvalue()) == (20, 300)
        assert jpeg_frame_size(data.getvalue()[:40]) is None  # cut before its frame header
    assert jpeg_frame_size(b"\x93NUMPY") is None
