"""``mode: bucket`` in the transform: each image is stored at the bucket nearest its upright aspect ratio,
with exactly the pixels a centre crop to that shape gives (same draft, region decode and resampling)."""

from __future__ import annotations

import functools
import io
import struct

import numpy as np
import pytest
from PIL import Image

from preprocess.image import jpeg_region
from preprocess.image.buckets import nearest_bucket
from preprocess.config import JobConfig
from preprocess.image.jpeg_markers import jpeg_layout
from preprocess.sample_data import photo_like
from preprocess.image.transform import process_image
from tests.tar_factory import centre_crop_top_left, jpeg_bytes, png_bytes

# (stored width, height): landscape and portrait, near a bucket and between two, past the largest ratio.
SIZES = [(1280, 853), (853, 1280), (1000, 1000), (2000, 700), (700, 2000), (1920, 1080), (640, 1500),
         (5000, 800), (333, 999), (97, 61)]


@functools.lru_cache(maxsize=None)
def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    return photo_like(np.random.default_rng(seed), width, height)


def exif(orientation: int) -> bytes:
    tags = Image.Exif()
    tags[0x0112] = orientation
    return tags.tobytes()


def with_xmp(data: bytes) -> bytes:
    """An XMP segment after the SOI: the header is no longer plain, so Pillow opens it (its other path)."""
    payload = b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta xmlns:x='adobe:ns:meta/'/>"
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + data[2:]


def centre_crop_to(cfg: JobConfig, height: int, width: int) -> JobConfig:
    """A centre-crop config of the shape, made independently of ``JobConfig.bucket_config``."""
    return JobConfig(height=height, width=width, mode="center_crop", resample=cfg.resample, draft=cfg.draft)


CFG = JobConfig(mode="bucket")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("path", ["plain", "pillow header", "pillow load", "png"])
def test_stored_shape_is_the_nearest_buckets_with_centre_crop_pixels(size, path, monkeypatch) -> None:
    width, height = size
    image = photo(width, height)
    data = png_bytes(image) if path == "png" else jpeg_bytes(image, quality=90, subsampling=2)
    if path == "pillow header":
        data = with_xmp(data)
        assert not jpeg_layout(data).plain_header
    if path == "pillow load":
        monkeypatch.setattr(jpeg_region, "_decode_region", None)
    out = process_image(data, CFG)
    bucket = nearest_bucket(width, height, CFG.buckets)
    assert out.bucket == bucket
    bh, bw = CFG.buckets[bucket]
    assert out.pixels.shape == (bh, bw, 3)
    assert (out.width, out.height) == (width, height) and out.content_box is None
    reference = process_image(data, centre_crop_to(CFG, bh, bw))
    assert np.array_equal(out.pixels, reference.pixels)
    assert (out.draft_scale, out.upscaled) == (reference.draft_scale, reference.upscaled)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("encode", ["jpeg", "png"])
def test_rotated_images_choose_by_their_upright_aspect(orientation: int, encode: str) -> None:
    image = photo(1600, 700, seed=orientation)  # stored landscape; upright portrait for orientations 5-8
    if encode == "jpeg":
        data = jpeg_bytes(image, quality=90, exif=exif(orientation))
    else:
        buffer = io.BytesIO()
        image.save(buffer, "PNG", exif=exif(orientation))
        data = buffer.getvalue()
    out = process_image(data, CFG)
    upright = (700, 1600) if orientation >= 5 else (1600, 700)
    assert (out.width, out.height) == upright
    bh, bw = CFG.buckets[out.bucket]
    assert out.bucket == nearest_bucket(*upright, CFG.buckets)
    assert (bh > bw) == (orientation >= 5)  # portrait buckets for the images shown upright as portraits
    assert out.pixels.shape == (bh, bw, 3)
    assert np.array_equal(out.pixels, process_image(data, centre_crop_to(CFG, bh, bw)).pixels)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("path", ["plain", "pillow header", "pillow load", "png"])
def test_crop_top_left_is_the_bucket_crops_corner_in_the_upright_source(orientation, path, monkeypatch) -> None:
    if path == "pillow load":
        monkeypatch.setattr(jpeg_region, "_decode_region", None)
    for width, height in SIZES:
        image = photo(width, height)
        if path == "png":
            buffer = io.BytesIO()
            image.save(buffer, "PNG", exif=exif(orientation))
            data = buffer.getvalue()
        else:
            data = jpeg_bytes(image, quality=90, exif=exif(orientation))
            data = with_xmp(data) if path == "pillow header" else data
        out = process_image(data, CFG)
        upright = (height, width) if orientation >= 5 else (width, height)
        bh, bw = CFG.buckets[out.bucket]
        assert out.crop_top_left == centre_crop_top_left(upright, (bw, bh)), (width, height, out.draft_scale)


def test_the_draft_serves_the_buckets_shape_not_the_budget() -> None:
    # 2000x700 goes to 144x432: decoded at 1/4 (2000 // 432 = 4, 700 // 144 = 4), where a 256x256 target
    # would allow only 1/2 (700 // 256 = 2).
    data = jpeg_bytes(photo(2000, 700), quality=90)
    out = process_image(data, CFG)
    assert CFG.buckets[out.bucket] == (144, 432) and out.draft_scale == 4
    assert process_image(data, JobConfig()).draft_scale == 2


def test_an_explicit_list_takes_ids_in_its_order() -> None:
    cfg = JobConfig(mode="bucket", buckets=[[192, 320], [256, 256], [320, 192]], resample="bilinear")
    shapes = {process_image(jpeg_bytes(photo(w, h)), cfg).bucket for w, h in [(1600, 900), (900, 900), (900, 1600)]}
    assert shapes == {0, 1, 2}
    out = process_image(jpeg_bytes(photo(900, 1600)), cfg)
    assert out.bucket == 2 and out.pixels.shape == (320, 192, 3)
