"""process_image: draft scale, EXIF orientation, colour modes, resize modes, real-world JPEG oddities; ``mode:
bucket`` stores each image at the bucket nearest its upright aspect ratio, with exactly the pixels a centre crop to
that shape gives (same draft, region decode and resampling).

Orientation is checked against Pillow's own ``ImageOps.exif_transpose`` followed by a plain full-size
resize, on a quadrant image (four colours) so any wrong rotation or flip moves a quadrant and fails.
"""

from __future__ import annotations

import functools
import io
import struct
from functools import lru_cache

import numpy as np
import pytest
from PIL import Image, ImageOps, features

from preprocess.config import RESAMPLE_FILTERS, RESIZE_MODES, JobConfig
from preprocess.image import jpeg_region
from preprocess.image.buckets import nearest_bucket
from preprocess.image.jpeg_markers import jpeg_layout
from preprocess.image.transform import process_image
from preprocess.sample_data import photo_like
from tests.tar_factory import centre_crop_top_left, decode_index, index_image, jpeg_bytes, png_bytes

# The modes of one output shape (mode: bucket picks a shape per image: its tests are at the end of this file).
SINGLE_SHAPE_MODES = [mode for mode in RESIZE_MODES if mode != "bucket"]
QUADRANTS = ((220, 30, 30), (30, 200, 30), (30, 30, 220), (230, 220, 40))  # TL, TR, BL, BR


@pytest.fixture(autouse=True)
def _restore_pillow_limit(monkeypatch):
    # process_image sets Pillow's process-wide limit to the config's; keep other tests' Pillow default.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)


def quadrant_image(width: int, height: int, mode: str = "RGB") -> Image.Image:
    im = Image.new("RGB", (width, height))
    half_w, half_h = width // 2, height // 2
    for colour, (x, y) in zip(QUADRANTS, [(0, 0), (half_w, 0), (0, half_h), (half_w, half_h)]):
        im.paste(colour, (x, y, x + half_w, y + half_h))
    return im if mode == "RGB" else im.convert(mode)


def exif_orientation(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def reference(data: bytes, cfg: JobConfig) -> np.ndarray:
    """Pillow's upright image at full size, then the same resize done the obvious way."""
    im = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    size, method = (cfg.width, cfg.height), getattr(Image.Resampling, cfg.resample.upper())
    if cfg.mode == "center_crop":
        im = ImageOps.fit(im, size, method)
    elif cfg.mode == "pad":
        im = ImageOps.pad(im, size, method, color=cfg.fill)
    else:
        im = im.resize(size, method)
    return np.asarray(im)


def mean_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


@lru_cache(maxsize=None)
def noise_jpeg(width: int, height: int, **save_args) -> bytes:
    rng = np.random.default_rng(width * 7919 + height)
    return jpeg_bytes(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)), **save_args)


# --- draft ---------------------------------------------------------------------------------------------


def test_2000x1500_jpeg_to_256_center_crop_decodes_at_quarter_scale():
    data = jpeg_bytes(quadrant_image(2000, 1500), quality=80)
    out = process_image(data, JobConfig(height=256, width=256))
    assert out.draft_scale == 4
    assert (out.width, out.height, out.format) == (2000, 1500, "JPEG")
    assert out.pixels.shape == (256, 256, 3) and out.pixels.dtype == np.uint8
    # The kept 1500x1500 centre decodes as 375x375 >= 256: downscaled, never upscaled.
    assert 1500 / out.draft_scale >= 256


def _best_scale(size: tuple[int, int], target: tuple[int, int], mode: str) -> int:
    (w, h), (tw, th) = size, target
    if mode == "pad":  # only the side that fits must stay >= its target
        fits = (w, tw) if tw / w <= th / h else (h, th)
        return max(s for s in (8, 4, 2, 1) if s == 1 or fits[0] / s >= fits[1])
    return max(s for s in (8, 4, 2, 1) if s == 1 or (w / s >= tw and h / s >= th))


@pytest.mark.parametrize("mode", SINGLE_SHAPE_MODES)
@pytest.mark.parametrize("size", [(1024, 1025), (1025, 1024), (2047, 520), (640, 480), (300, 200), (90, 60),
                                  (4000, 50)])
def test_draft_scale_is_the_largest_that_keeps_the_target(size, mode):
    cfg = JobConfig(height=96, width=128, mode=mode)
    out = process_image(noise_jpeg(*size), cfg)
    assert out.draft_scale == _best_scale(size, (128, 96), mode)
    kept_w, kept_h = size[0] / out.draft_scale, size[1] / out.draft_scale  # decoded picture extent
    if mode == "pad":
        assert min(128 / kept_w, 96 / kept_h) <= 1 or out.draft_scale == 1, "letterboxed content upscaled"
    else:
        assert (kept_w >= 128 and kept_h >= 96) or out.draft_scale == 1, "kept region upscaled"


def test_draft_off_decodes_full_size_and_agrees_with_draft():
    data = jpeg_bytes(quadrant_image(1200, 900))
    drafted = process_image(data, JobConfig(height=64, width=64))
    full = process_image(data, JobConfig(height=64, width=64, draft=False))
    assert (drafted.draft_scale, full.draft_scale) == (8, 1)
    assert mean_diff(drafted.pixels, full.pixels) < 2.0  # same geometry: only the DCT smoothing differs


def test_png_and_webp_are_never_drafted():
    im = quadrant_image(640, 480)
    assert process_image(png_bytes(im), JobConfig(height=32, width=32)).draft_scale == 1
    if features.check("webp"):
        out = io.BytesIO()
        im.save(out, "WEBP", lossless=True)
        result = process_image(out.getvalue(), JobConfig(height=32, width=32))
        assert (result.format, result.draft_scale) == ("WEBP", 1)


# --- EXIF orientation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", SINGLE_SHAPE_MODES)
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillow_exif_transpose(orientation, mode):
    # 256x128 stored, 64x48 target: both orientations' letterbox margins are even, so the reference's
    # rounding of the centring agrees with ours to the pixel.
    data = jpeg_bytes(quadrant_image(256, 128), exif=exif_orientation(orientation))
    cfg = JobConfig(height=48, width=64, mode=mode)
    out = process_image(data, cfg)
    expected = reference(data, cfg)
    upright = (128, 256) if orientation >= 5 else (256, 128)
    assert (out.width, out.height) == upright
    assert mean_diff(out.pixels, expected) < 4.0, f"orientation {orientation} {mode}: wrong transpose"
    if mode == "center_crop":  # the four quadrants' centres, exactly where Pillow puts them
        for y, x in [(12, 16), (12, 48), (36, 16), (36, 48)]:
            assert np.abs(out.pixels[y, x].astype(int) - expected[y, x]).max() <= 12


def test_grayscale_jpeg_with_orientation_6():
    data = jpeg_bytes(quadrant_image(256, 128, "L"), exif=exif_orientation(6))
    cfg = JobConfig(height=48, width=64)
    out = process_image(data, cfg)
    assert (out.mode, out.width, out.height) == ("L", 128, 256)
    assert mean_diff(out.pixels, reference(data, cfg)) < 4.0


def test_png_exif_orientation_is_applied():
    out_png = io.BytesIO()
    quadrant_image(256, 128).save(out_png, "PNG", exif=exif_orientation(8))
    cfg = JobConfig(height=48, width=64)
    out = process_image(out_png.getvalue(), cfg)
    assert (out.width, out.height) == (128, 256)
    assert mean_diff(out.pixels, reference(out_png.getvalue(), cfg)) < 2.0


@pytest.mark.parametrize("exif", [
    b"Exif\x00\x00" + bytes(range(256)),  # garbage after the header
    b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff\x01\x12",  # an IFD claiming 65535 entries, cut short
])
def test_corrupt_exif_still_decodes_upright(exif):
    plain = process_image(jpeg_bytes(quadrant_image(256, 128)), JobConfig(height=48, width=64))
    out = process_image(jpeg_bytes(quadrant_image(256, 128), exif=exif), JobConfig(height=48, width=64))
    assert (out.width, out.height) == (256, 128)
    assert mean_diff(out.pixels, plain.pixels) < 1.0


# --- colour modes --------------------------------------------------------------------------------------


def _flat(pixels: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in pixels[pixels.shape[0] // 2, pixels.shape[1] // 2])


def _close(a, b, tolerance: int = 3) -> bool:
    return all(abs(int(x) - int(y)) <= tolerance for x, y in zip(a, b))


def test_cmyk_jpeg_adobe_inverted():
    data = jpeg_bytes(Image.new("CMYK", (320, 240), (0, 255, 255, 0)))  # pure red in CMYK
    assert b"Adobe" in data[:200]  # libjpeg writes CMYK inverted with an APP14 Adobe marker
    out = process_image(data, JobConfig(height=32, width=32))
    assert out.mode == "CMYK" and out.draft_scale == 4
    assert _close(_flat(out.pixels), (255, 0, 0), 8)


def test_grayscale_and_bilevel_png():
    out = process_image(png_bytes(Image.new("L", (40, 30), 100)), JobConfig(height=16, width=16))
    assert out.mode == "L" and (out.pixels == 100).all()
    out = process_image(png_bytes(Image.new("1", (40, 30), 1)), JobConfig(height=16, width=16))
    assert (out.pixels == 255).all()


def test_palette_with_and_without_transparency():
    palette = Image.new("P", (40, 40), 0)
    palette.putpalette([200, 10, 10, 10, 200, 10] + [0] * 762)
    palette.paste(1, (20, 0, 40, 40))  # right half: palette entry 1 (green)
    cfg = JobConfig(height=40, width=40, resample="nearest", background=(0, 0, 250))
    out = process_image(png_bytes(palette), cfg)
    assert out.mode == "P"
    assert _flat(out.pixels[:, :20]) == (200, 10, 10) and _flat(out.pixels[:, 20:]) == (10, 200, 10)
    buffer = io.BytesIO()
    palette.save(buffer, "PNG", transparency=1)  # green is transparent: shows the background
    out = process_image(buffer.getvalue(), cfg)
    assert _flat(out.pixels[:, :20]) == (200, 10, 10) and _flat(out.pixels[:, 20:]) == (0, 0, 250)


@pytest.mark.parametrize("mode, colour", [("RGBA", (200, 100, 0, 128)), ("LA", (200, 128))])
def test_alpha_is_composited_on_the_background(mode, colour):
    background = (0, 40, 250)
    out = process_image(png_bytes(Image.new(mode, (30, 20), colour)), JobConfig(height=8, width=8,
                                                                                 background=background))
    rgb = colour[:3] if mode == "RGBA" else (colour[0],) * 3
    alpha = colour[-1] / 255
    expected = tuple(round(c * alpha + b * (1 - alpha)) for c, b in zip(rgb, background))
    assert _close(_flat(out.pixels), expected, 2)
    opaque = Image.new(mode, (30, 20), colour[:-1] + (0,))  # fully transparent
    assert _flat(process_image(png_bytes(opaque), JobConfig(height=8, width=8,
                                                            background=background)).pixels) == background


def test_rgb_png_colour_key_shows_the_background():
    im = Image.new("RGB", (40, 40), (255, 255, 255))
    im.paste((255, 0, 0), (0, 0, 20, 40))
    buffer = io.BytesIO()
    im.save(buffer, "PNG", transparency=(255, 255, 255))  # tRNS: white is transparent
    out = process_image(buffer.getvalue(), JobConfig(height=40, width=40, resample="nearest",
                                                     background=(0, 0, 255)))
    assert _flat(out.pixels[:, :20]) == (255, 0, 0) and _flat(out.pixels[:, 20:]) == (0, 0, 255)


def test_16_bit_grayscale_png_is_scaled_not_clipped():
    values = np.zeros((30, 90), dtype=np.uint16)
    values[:, 30:60], values[:, 60:] = 32768, 65535
    cfg = JobConfig(height=30, width=90, resample="nearest")
    out = process_image(png_bytes(Image.fromarray(values)), cfg)
    assert out.mode.startswith("I")
    assert [int(out.pixels[15, x, 0]) for x in (15, 45, 75)] == [0, 128, 255]
    assert (out.pixels[..., 0] == out.pixels[..., 2]).all()


# --- resize modes --------------------------------------------------------------------------------------


def test_center_crop_keeps_the_centre():
    im = Image.new("RGB", (300, 100), (0, 255, 0))
    im.paste((255, 0, 0), (90, 0, 210, 100))  # 120 wide red centre: the kept 100x100 is all red
    out = process_image(png_bytes(im), JobConfig(height=32, width=32, mode="center_crop"))
    assert (np.abs(out.pixels.astype(int) - (255, 0, 0)) <= 1).all()


@pytest.mark.parametrize("size, bars_on", [((200, 100), "rows"), ((100, 200), "columns")])
def test_pad_letterboxes_with_fill_and_centres_the_content(size, bars_on):
    fill = (0, 0, 255)
    out = process_image(png_bytes(Image.new("RGB", size, (255, 0, 0))), JobConfig(height=64, width=64,
                                                                                mode="pad", fill=fill))
    pixels = out.pixels if bars_on == "rows" else out.pixels.transpose(1, 0, 2)
    is_fill = (pixels == fill).all(axis=(1, 2))
    is_content = (pixels == (255, 0, 0)).all(axis=(1, 2))
    assert is_fill[:16].all() and is_fill[48:].all(), "bars are not the fill colour"
    assert is_content[16:48].all(), "content is not centred (16 rows/columns of bar each side)"


def test_stretch_fills_the_target_without_cropping():
    im = Image.new("RGB", (200, 100), (255, 0, 0))
    im.paste((0, 255, 0), (100, 0, 200, 100))
    out = process_image(png_bytes(im), JobConfig(height=32, width=32, mode="stretch"))
    assert (out.pixels[:, :15] == (255, 0, 0)).all() and (out.pixels[:, 17:] == (0, 255, 0)).all()


# Stored (width, height): drafted at 1/8 and 1/4 both ways, a half-pixel offset (129x64 to 96x64: 16.5 columns),
# a fractional draft extent (97x61), portrait and landscape.
CROP_SIZES = [(1283, 1000), (1000, 1283), (640, 241), (129, 64), (333, 999), (97, 61)]


@pytest.mark.parametrize("mode", SINGLE_SHAPE_MODES)
@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("codec", ["jpeg", "png"])
def test_crop_top_left_is_in_the_upright_sources_pixels(mode, orientation, codec):
    cfg = JobConfig(height=64, width=96, mode=mode)
    for stored in CROP_SIZES:
        image = quadrant_image(*stored)
        if codec == "jpeg":
            data = jpeg_bytes(image, exif=exif_orientation(orientation))
        else:
            buffer = io.BytesIO()
            image.save(buffer, "PNG", exif=exif_orientation(orientation))
            data = buffer.getvalue()
        out = process_image(data, cfg)
        upright = stored[::-1] if orientation >= 5 else stored
        assert (out.width, out.height) == upright
        # SDXL's c_crop: what was cut from the top and the left of the upright picture; pad and stretch
        # keep the whole picture.
        expected = centre_crop_top_left(upright, (96, 64)) if mode == "center_crop" else (0, 0)
        assert out.crop_top_left == expected, (stored, orientation, out.draft_scale)


def test_resample_filter_is_used():
    data = noise_jpeg(300, 200)
    results = {
        r: process_image(data, JobConfig(height=48, width=48, resample=r)).pixels for r in RESAMPLE_FILTERS
    }
    assert all(p.shape == (48, 48, 3) for p in results.values())
    assert mean_diff(results["nearest"], results["lanczos"]) > 5  # noise: nearest picks, lanczos averages


# --- real-world JPEG oddities --------------------------------------------------------------------------


def test_progressive_and_subsampled_jpegs_decode_alike():
    im = quadrant_image(640, 480)
    cfg = JobConfig(height=48, width=64)  # 640x480 / 8 = 80x60 still covers 64x48
    baseline = process_image(jpeg_bytes(im), cfg)
    for save_args in ({"progressive": True}, {"subsampling": 2}, {"progressive": True, "subsampling": 2}):
        out = process_image(jpeg_bytes(im, **save_args), cfg)
        assert out.draft_scale == baseline.draft_scale == 8
        assert mean_diff(out.pixels, baseline.pixels) < 3.0, save_args


def test_tiny_image_is_upscaled():
    out = process_image(jpeg_bytes(index_image(77, 10, 7)), JobConfig(height=64, width=64))
    assert (out.width, out.height, out.draft_scale) == (10, 7, 1)
    assert out.pixels.shape == (64, 64, 3) and decode_index(out.pixels) == 77


@pytest.mark.parametrize("mode", SINGLE_SHAPE_MODES)
def test_extreme_aspect_ratio(mode):
    out = process_image(jpeg_bytes(index_image(1234, 4000, 50)), JobConfig(height=64, width=64, mode=mode,
                                                                           fill=(0, 0, 0)))
    assert out.pixels.shape == (64, 64, 3)
    assert out.draft_scale == (8 if mode == "pad" else 1)  # 50 rows < 64: only pad may reduce
    if mode == "pad":  # 64 x 0.8 content: one row of content at row (64 - 1) // 2, the rest fill
        assert (out.pixels[:31] == 0).all() and (out.pixels[32:] == 0).all()
        assert decode_index(out.pixels[31:32]) == 1234
    else:
        assert decode_index(out.pixels) == 1234


def test_multi_picture_jpeg_uses_the_first_frame():
    buffer = io.BytesIO()
    index_image(5, 320, 240).save(buffer, "MPO", save_all=True, append_images=[index_image(6, 320, 240)])
    out = process_image(buffer.getvalue(), JobConfig(height=32, width=32))
    assert out.format == "MPO" and out.draft_scale == 4 and decode_index(out.pixels) == 5


def test_timings_are_reported_per_stage():
    timings: dict[str, float] = {}
    process_image(noise_jpeg(300, 200), JobConfig(height=32, width=32), timings)
    assert set(timings) == {"open", "decode", "convert", "resize"} and all(t >= 0 for t in timings.values())


def test_fractional_draft_extent_never_gives_an_invalid_box():
    # 1280x853 at 1/2 is 640x426.5 of picture: 256 / (256 / 426.5) rounds to 426.50000000000006, and an
    # unclamped centre box started at -3e-14, which Pillow refuses (~11% of a LAION-like corpus).
    out = process_image(noise_jpeg(1280, 853), JobConfig(height=256, width=256))
    assert out.draft_scale == 2 and out.pixels.shape == (256, 256, 3)


@pytest.mark.parametrize("mode", SINGLE_SHAPE_MODES)
def test_many_sizes_decode_with_draft(mode):
    rng = np.random.default_rng(11)
    for width, height in rng.integers(40, 700, size=(40, 2)):
        for target in ((17, 23), (32, 32)):
            cfg = JobConfig(height=target[1], width=target[0], mode=mode, fill=(0, 0, 0))
            out = process_image(noise_jpeg(int(width), int(height), quality=50), cfg)
            assert out.pixels.shape == (target[1], target[0], 3), (width, height, target)


# --- mode: bucket --------------------------------------------------------------------------------------------------

# (stored width, height): landscape and portrait, near a bucket and between two, past the largest ratio.
BUCKET_SOURCE_SIZES = [(1280, 853), (853, 1280), (1000, 1000), (2000, 700), (700, 2000), (1920, 1080), (640, 1500),
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


BUCKET_CFG = JobConfig(mode="bucket")


@pytest.mark.parametrize("size", BUCKET_SOURCE_SIZES)
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
    out = process_image(data, BUCKET_CFG)
    bucket = nearest_bucket(width, height, BUCKET_CFG.buckets)
    assert out.bucket == bucket
    bh, bw = BUCKET_CFG.buckets[bucket]
    assert out.pixels.shape == (bh, bw, 3)
    assert (out.width, out.height) == (width, height) and out.content_box is None
    reference = process_image(data, centre_crop_to(BUCKET_CFG, bh, bw))
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
    out = process_image(data, BUCKET_CFG)
    upright = (700, 1600) if orientation >= 5 else (1600, 700)
    assert (out.width, out.height) == upright
    bh, bw = BUCKET_CFG.buckets[out.bucket]
    assert out.bucket == nearest_bucket(*upright, BUCKET_CFG.buckets)
    assert (bh > bw) == (orientation >= 5)  # portrait buckets for the images shown upright as portraits
    assert out.pixels.shape == (bh, bw, 3)
    assert np.array_equal(out.pixels, process_image(data, centre_crop_to(BUCKET_CFG, bh, bw)).pixels)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("path", ["plain", "pillow header", "pillow load", "png"])
def test_crop_top_left_is_the_bucket_crops_corner_in_the_upright_source(orientation, path, monkeypatch) -> None:
    if path == "pillow load":
        monkeypatch.setattr(jpeg_region, "_decode_region", None)
    for width, height in BUCKET_SOURCE_SIZES:
        image = photo(width, height)
        if path == "png":
            buffer = io.BytesIO()
            image.save(buffer, "PNG", exif=exif(orientation))
            data = buffer.getvalue()
        else:
            data = jpeg_bytes(image, quality=90, exif=exif(orientation))
            data = with_xmp(data) if path == "pillow header" else data
        out = process_image(data, BUCKET_CFG)
        upright = (height, width) if orientation >= 5 else (width, height)
        bh, bw = BUCKET_CFG.buckets[out.bucket]
        assert out.crop_top_left == centre_crop_top_left(upright, (bw, bh)), (width, height, out.draft_scale)


def test_the_draft_serves_the_buckets_shape_not_the_budget() -> None:
    # 2000x700 goes to 144x432: decoded at 1/4 (2000 // 432 = 4, 700 // 144 = 4), where a 256x256 target
    # would allow only 1/2 (700 // 256 = 2).
    data = jpeg_bytes(photo(2000, 700), quality=90)
    out = process_image(data, BUCKET_CFG)
    assert BUCKET_CFG.buckets[out.bucket] == (144, 432) and out.draft_scale == 4
    assert process_image(data, JobConfig()).draft_scale == 2


def test_an_explicit_list_takes_ids_in_its_order() -> None:
    cfg = JobConfig(mode="bucket", buckets=[[192, 320], [256, 256], [320, 192]], resample="bilinear")
    shapes = {process_image(jpeg_bytes(photo(w, h)), cfg).bucket for w, h in [(1600, 900), (900, 900), (900, 1600)]}
    assert shapes == {0, 1, 2}
    out = process_image(jpeg_bytes(photo(900, 1600)), cfg)
    assert out.bucket == 2 and out.pixels.shape == (320, 192, 3)
