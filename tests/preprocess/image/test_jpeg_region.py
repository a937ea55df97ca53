"""The region decoder (``preprocess.image.jpeg_region``) gives exactly Pillow's pixels, decodes less, and fails
where Pillow's path fails.

Every case runs ``process_image`` twice, once through the compiled region decoder and once through
Pillow's ``load`` (the path a machine without the compiled module takes), and compares bytes: the crop and
skip must never reach a pixel the resize reads, whatever the subsampling, scan layout, size, orientation,
mode or filter.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from preprocess.image import jpeg_region
from preprocess.config import JobConfig
from preprocess.image.jpeg_markers import ScanDataEnded
from preprocess.image.transform import process_image
from shardio.errors import SampleError


@pytest.fixture(autouse=True)
def _region_decoder_built():
    assert jpeg_region.available(), "preprocess.image._jpeg_region is not built (make install builds it)"


def photo(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """Smooth gradients plus noise: edges and detail everywhere, so a wrong pixel anywhere shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) % 97 * 2.6], axis=-1)
    pixels = np.clip(base + rng.normal(0, 24, (height, width, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert(mode)


def encode(image: Image.Image, orientation: int = 1, **save_args) -> bytes:
    out = io.BytesIO()
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        save_args["exif"] = exif.tobytes()
    image.save(out, "JPEG", **{"quality": 90, **save_args})
    return out.getvalue()


def both_paths(data: bytes, cfg: JobConfig, monkeypatch) -> tuple[np.ndarray, np.ndarray]:
    region = process_image(data, cfg).pixels
    with monkeypatch.context() as patch:
        patch.setattr(jpeg_region, "_decode_region", None)
        pillow = process_image(data, cfg).pixels
    return region, pillow


VARIANTS = {
    "4:2:0 landscape": encode(photo(1001, 677, 0), subsampling=2),
    "4:2:2 portrait": encode(photo(677, 1001, 1), subsampling=1),
    "4:4:4 square": encode(photo(640, 640, 2), subsampling=0),
    "progressive": encode(photo(1203, 805, 3), subsampling=2, progressive=True),
    "optimized tables, wide": encode(photo(2000, 700, 4), subsampling=2, optimize=True),
    "grayscale": encode(photo(900, 611, 5, "L")),
    "small (upscaled)": encode(photo(300, 190, 6), subsampling=2),
    "odd size, not a multiple of the MCU": encode(photo(1021, 767, 7), subsampling=2),
    "EXIF orientation 6": encode(photo(1100, 733, 8), orientation=6, subsampling=2),
    "EXIF orientation 3": encode(photo(733, 1100, 9), orientation=3, subsampling=2),
    "restart markers": encode(photo(1100, 700, 20), subsampling=2, restart_marker_blocks=7),
    "progressive, restart markers": encode(photo(700, 1100, 21), progressive=True, restart_marker_rows=2),
}
CONFIGS = [
    dict(mode="center_crop", resample="bicubic"),
    dict(mode="center_crop", resample="lanczos", height=192, width=256),
    dict(mode="center_crop", resample="nearest", height=256, width=160),
    dict(mode="center_crop", resample="box", height=64, width=64),
    dict(mode="center_crop", resample="bilinear", draft=False),
    dict(mode="center_crop", resample="hamming", height=333, width=500),
    dict(mode="stretch", resample="bilinear", height=200, width=300),
    dict(mode="pad", resample="bicubic", height=256, width=192),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_same_pixels_as_pillows_path(variant, config, monkeypatch):
    cfg = JobConfig(**config)
    region, pillow = both_paths(VARIANTS[variant], cfg, monkeypatch)
    assert region.shape == (cfg.height, cfg.width, 3)
    np.testing.assert_array_equal(region, pillow)


def test_a_centre_crop_decodes_only_the_columns_it_needs():
    data = encode(photo(1600, 800, 10), subsampling=2)
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (256, 256))  # 1/2: 800 x 400
    end = data.rindex(b"\xff\xd9")
    pixels, full_width, full_height, x, width, y, height = jpeg_region._decode_region(
        data, end, 2, 800, 400, 150, 650, 0, 400)
    assert (full_width, full_height) == (800, 400)
    assert 0 < x <= 150 and 650 <= x + width < 800  # the left edge moves down to an iMCU boundary
    assert (y, height) == (0, 400)
    assert len(pixels) == 800 * 400 * 4
    full = np.asarray(im.convert("RGB"))
    got = np.frombuffer(pixels, np.uint8).reshape(400, 800, 4)[..., :3]
    # In place, and inside, away from the crop's edges (no neighbour there for fancy upsampling), Pillow's.
    np.testing.assert_array_equal(got[:, x + 16: x + width - 16], full[:, x + 16: x + width - 16])


def test_rows_outside_the_region_are_skipped_but_a_cut_below_it_is_still_found():
    data = encode(photo(600, 1200, 11), subsampling=2)
    end = data.rindex(b"\xff\xd9")
    region = jpeg_region._decode_region(data, end, 1, 600, 1200, 0, 600, 300, 900)
    assert region[1:] == (600, 1200, 0, 600, 300, 600)
    cut = data[: int(len(data) * 0.95)]  # the data of the bottom rows, below the region, is gone
    with pytest.raises(ScanDataEnded):
        jpeg_region._decode_region(cut, len(cut), 1, 600, 1200, 0, 600, 300, 900)


@pytest.mark.parametrize("damage", ["cut at 60% with EOI", "cut at 97% with EOI", "cut at 40%",
                                    "scan noise", "bad Huffman table", "progressive cut between scans"])
def test_damaged_jpegs_fail_the_same_way_on_both_paths(damage, monkeypatch):
    good = encode(photo(800, 600, 12), subsampling=2)
    sos = good.index(b"\xff\xda")
    if damage.startswith("cut at"):
        fraction = float(damage.split()[2].rstrip("%")) / 100
        data = good[: int(len(good) * fraction)] + (b"\xff\xd9" if damage.endswith("EOI") else b"")
    elif damage == "scan noise":
        noise = np.random.default_rng(13).integers(0, 256, len(good) - sos - 40, dtype=np.uint8).tobytes()
        data = good[: sos + 20] + noise + b"\xff\xd9"
    elif damage == "bad Huffman table":
        dht = good.index(b"\xff\xc4")
        data = good[: dht + 5] + b"\xff" * 16 + good[dht + 21:]
    else:
        progressive = encode(photo(800, 600, 14), progressive=True)
        scans = [i for i in range(len(progressive) - 1) if progressive[i: i + 2] == b"\xff\xda"]
        data = progressive[: scans[3]] + b"\xff\xd9"
    cfg = JobConfig()
    reasons = []
    for region in (True, False):
        with monkeypatch.context() as patch:
            if not region:
                patch.setattr(jpeg_region, "_decode_region", None)
            with pytest.raises(SampleError) as caught:
                process_image(data, cfg)
        reasons.append(str(caught.value))
    # The same verdict; the words after "cannot decode: OSError:" are the decoder's own (libjpeg's
    # message on the region path, Pillow's summary on the other).
    assert reasons[0].split(":")[0] == reasons[1].split(":")[0], reasons


def test_cmyk_jpegs_stay_on_pillows_path(monkeypatch):
    data = encode(photo(400, 300, 15).convert("CMYK"))
    calls = []
    real = jpeg_region._decode_region
    monkeypatch.setattr(jpeg_region, "_decode_region", lambda *args: calls.append(args) or real(*args))
    assert process_image(data, JobConfig()).pixels.shape == (256, 256, 3)
    assert calls == []


def test_a_size_other_than_the_checked_one_is_refused_before_decoding():
    data = encode(photo(640, 480, 16))
    end = data.rindex(b"\xff\xd9")
    with pytest.raises(ValueError, match="libjpeg reads a 320x240 image where the header said 160x120"):
        jpeg_region._decode_region(data, end, 2, 160, 120, 0, 160, 0, 120)


def with_segment(data: bytes, marker: int, payload: bytes) -> bytes:
    """``data`` with one more marker segment right after the SOI."""
    return data[:2] + bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload + data[2:]


XMP_ROTATED = b'http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'


@pytest.mark.parametrize("case", ["XMP orientation", "two Exif segments", "corrupt Exif", "Exif and XMP"])
def test_headers_pillow_reads_more_of_give_the_same_pixels(case, monkeypatch):
    base = encode(photo(900, 600, 17), orientation=3 if "Exif" in case else 1, subsampling=2)
    data = {
        "XMP orientation": lambda: with_segment(base, 0xE1, XMP_ROTATED),
        "two Exif segments": lambda: with_segment(base, 0xE1, b"Exif\0\0MM\0*\0\0\0\x08\0\0"),
        "corrupt Exif": lambda: with_segment(encode(photo(900, 600, 17)), 0xE1, b"Exif\0\0II*\0\xff\xff\xff\x7f"),
        "Exif and XMP": lambda: with_segment(base, 0xE1, XMP_ROTATED),
    }[case]()
    cfg = JobConfig(height=192, width=256)
    region, pillow = both_paths(data, cfg, monkeypatch)
    np.testing.assert_array_equal(region, pillow)
    if case == "XMP orientation":  # Pillow's getexif reads the XMP orientation: 6 turns the picture
        assert process_image(data, cfg).width == 600


def test_a_plain_jpeg_is_never_opened_with_pillow(monkeypatch):
    data = encode(photo(800, 600, 18), orientation=6, subsampling=2)
    expected = process_image(data, JobConfig())
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("Image.open on a plain JPEG"))
    got = process_image(data, JobConfig())
    np.testing.assert_array_equal(got.pixels, expected.pixels)
    assert (got.width, got.height, got.format, got.mode, got.draft_scale) == (600, 800, "JPEG", "RGB", 2)


@pytest.mark.parametrize("config, words", [
    (dict(max_image_pixels=400 * 300 - 1), "pixel bomb: 120000 pixels > max_image_pixels 119999"),
    (dict(min_image_size=301), "image too small (400x300: short side < min_image_size 301)"),
    (dict(max_aspect_ratio=1.2), "aspect ratio too large (400x300 is 1.33:1 > max_aspect_ratio 1.2)"),
    (dict(max_decoded_bytes=50_000), "decoded size too large (~0 MiB for 100x75 RGB"),
])
def test_limits_refuse_in_the_same_words_on_both_paths(config, words, monkeypatch):
    data = encode(photo(400, 300, 19))
    reasons = []
    for region in (True, False):
        with monkeypatch.context() as patch:
            patch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
            if not region:
                patch.setattr(jpeg_region, "_decode_region", None)
            with pytest.raises(SampleError) as caught:
                process_image(data, JobConfig(height=64, width=64, **config))
        reasons.append(str(caught.value))
    assert words in reasons[0] and reasons[0] == reasons[1]


@pytest.mark.parametrize("seed", range(4))
def test_randomly_damaged_jpegs_never_differ_in_pixels_and_cuts_fail_on_both_paths(seed, monkeypatch):
    """Byte flips, cuts (with and without an EOI) and insertions over four encodings: whenever both paths
    accept, the pixels are the same; a cut is refused by both."""
    rng = np.random.default_rng(seed)
    kinds = [dict(subsampling=2), dict(progressive=True), dict(subsampling=1, restart_marker_blocks=5),
             dict(subsampling=0, quality=97)]
    good = encode(photo(320 + 16 * seed, 240 - 8 * seed, 30 + seed), **kinds[seed])
    cfg = JobConfig(height=64, width=64)
    for _ in range(40):
        data = bytearray(good)
        damage = int(rng.integers(3))
        if damage == 0:
            for _ in range(int(rng.integers(1, 6))):
                data[int(rng.integers(2, len(data)))] = int(rng.integers(256))
        elif damage == 1:
            data = data[: int(rng.integers(len(good) // 20, len(good) - 64))]
            if rng.random() < 0.5:
                data += b"\xff\xd9"
        else:
            at = int(rng.integers(2, len(data)))
            data[at:at] = rng.integers(0, 256, int(rng.integers(1, 30)), dtype=np.uint8).tobytes()
        outcomes = []
        for region in (True, False):
            with monkeypatch.context() as patch:
                if not region:
                    patch.setattr(jpeg_region, "_decode_region", None)
                try:
                    outcomes.append(process_image(bytes(data), cfg).pixels)
                except SampleError as e:
                    outcomes.append(str(e))
        if damage == 1:
            assert all(isinstance(o, str) for o in outcomes), "a cut JPEG was accepted"
        if all(isinstance(o, np.ndarray) for o in outcomes):
            np.testing.assert_array_equal(outcomes[0], outcomes[1])
