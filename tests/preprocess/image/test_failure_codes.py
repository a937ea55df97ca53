"""Each place that refuses one image raises ``SampleError`` with its code (``shardio.failure_reasons``):
real bad bytes through ``process_image``, under both JPEG paths (the compiled region decoder and Pillow's
load), and the code survives into ``process_input``'s failure records. The tar-level codes (a missing
image, a key seen twice, unsafe or oversized members, ``.cls`` / ``.json``) are in
tests/preprocess/test_failure_reasons.py; a stuck decode's in tests/preprocess/image/test_stuck_decode.py.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
import pytest
from PIL import Image, features

from preprocess.image import jpeg_region, transform
from preprocess.config import JobConfig
from preprocess.image.resize_modes import resize_mode
from preprocess.image.transform import process_image
from preprocess.worker import process_input
from shardio.store.backends import for_path
from shardio.errors import SampleError
from shardio.failure_reasons import FailureCode
from tests.tar_factory import Member, index_image, jpeg_bytes, png_bytes
from tests.preprocess.image.test_image_limits import THUMBNAIL, png_header, progressive_with_scans
from tests.preprocess.image.test_jpeg_integrity import BASELINE, PROGRESSIVE, cut_with_eoi, tiff_with_compression

CFG = JobConfig(height=32, width=32)
NOISE_PNG = png_bytes(Image.fromarray(np.random.default_rng(5).integers(0, 256, (60, 80, 3), dtype=np.uint8)))


@pytest.fixture(autouse=True)
def _restore_pillow_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # process_image sets it


@pytest.fixture(autouse=True, params=["region decoder", "Pillow decoder"])
def _decoder(request, monkeypatch):
    if request.param == "Pillow decoder":
        monkeypatch.setattr(jpeg_region, "_decode_region", None)
    else:
        assert jpeg_region.available(), "preprocess.image._jpeg_region is not built (make install builds it)"


def _sixth_sos_cut() -> bytes:
    """A progressive JPEG cut before its sixth scan, no EOI after: the marker walk sees the data end."""
    sos = [i for i in range(len(PROGRESSIVE) - 1) if PROGRESSIVE[i:i + 2] == b"\xff\xda"][5]
    return PROGRESSIVE[:sos]


def _corrupt_png() -> bytes:
    data = bytearray(NOISE_PNG)
    idat = data.index(b"IDAT")
    data[idat + 200: idat + 260] = bytes(b ^ 0x55 for b in data[idat + 200: idat + 260])
    return bytes(data)


def _cut_jpeg_header() -> bytes:
    """The first 20% of a JPEG: Pillow runs out of data ("Truncated File Read")."""
    data = jpeg_bytes(index_image(9, 160, 120))
    return data[: len(data) // 5]


# (what, the bytes, the config, the code); each row one raise site in preprocess/image/transform.py
CASES: list[tuple[str, Callable[[], bytes], JobConfig, FailureCode]] = [
    ("empty member", lambda: b"", CFG, FailureCode.EMPTY_MEMBER),
    ("html saved as .jpg", lambda: b"<html>404 Not Found</html>", CFG, FailureCode.NOT_AN_IMAGE),
    ("JPEG signature, no header", lambda: b"\xff\xd8\xff" + bytes(40), CFG, FailureCode.BAD_JPEG_HEADER),
    ("random bytes", lambda: bytes(range(256)) * 4, CFG, FailureCode.UNKNOWN_FORMAT),
    ("PNG header of 30000x30000", lambda: png_header(30000, 30000), CFG, FailureCode.TOO_MANY_PIXELS),
    ("PNG in Pillow's warning band", lambda: png_header(10000, 9500), CFG, FailureCode.TOO_MANY_PIXELS),
    ("JPEG over max_image_pixels", lambda: THUMBNAIL, JobConfig(height=32, width=32, max_image_pixels=1000),
     FailureCode.TOO_MANY_PIXELS),
    ("90x160 under min_image_size", lambda: THUMBNAIL, JobConfig(height=32, width=32, min_image_size=100),
     FailureCode.TOO_SMALL),
    ("90x160 over max_aspect_ratio", lambda: THUMBNAIL, JobConfig(height=32, width=32, max_aspect_ratio=1.7),
     FailureCode.ASPECT_RATIO),
    ("150 scans", lambda: progressive_with_scans(140), CFG, FailureCode.TOO_MANY_SCANS),
    ("16-bit RGBA PNG of 9000x9000", lambda: png_header(9000, 9000, bit_depth=16, colour_type=6), CFG,
     FailureCode.DECODED_BYTES),
    ("JPEG cut inside a scan", lambda: BASELINE[: int(len(BASELINE) * 0.9)], CFG, FailureCode.TRUNCATED),
    ("JPEG cut before a scan", _sixth_sos_cut, CFG, FailureCode.TRUNCATED),
    ("JPEG cut in its header", _cut_jpeg_header, CFG, FailureCode.TRUNCATED),
    ("PNG cut in half", lambda: NOISE_PNG[: len(NOISE_PNG) // 2], CFG, FailureCode.TRUNCATED),
    ("JPEG cut between scans, EOI appended", lambda: _sixth_sos_cut() + b"\xff\xd9", CFG,
     FailureCode.INCOMPLETE_JPEG),
    ("JPEG cut mid-scan, EOI appended", lambda: cut_with_eoi(BASELINE, 0.6), CFG,
     FailureCode.SCAN_ENDS_EARLY),
    ("stray marker inside a scan", lambda: BASELINE[:BASELINE.index(b"\xff\xda") + 40] + b"\xff\x01"
     + BASELINE[BASELINE.index(b"\xff\xda") + 40:], CFG, FailureCode.SCAN_ENDS_EARLY),
    ("PNG with corrupt data", _corrupt_png, CFG, FailureCode.DECODE_ERROR),
    ("any decode over max_decode_seconds", lambda: THUMBNAIL,
     JobConfig(height=32, width=32, max_decode_seconds=1e-9), FailureCode.DECODE_TIMEOUT),
]


@pytest.mark.parametrize("what, data, cfg, code", CASES, ids=[c[0] for c in CASES])
def test_each_refusal_carries_its_code(what, data, cfg, code):
    with pytest.raises(SampleError) as caught:
        process_image(data(), cfg)
    assert caught.value.code is code, (what, str(caught.value))
    assert str(caught.value) == caught.value.detail and caught.value.detail


@pytest.mark.skipif(features.check("libtiff"), reason="this Pillow has libtiff: compressed TIFF is decoded")
def test_compressed_tiff_without_libtiff_is_unsupported_format():
    with pytest.raises(SampleError) as caught:
        process_image(tiff_with_compression(8), CFG)
    assert caught.value.code is FailureCode.UNSUPPORTED_FORMAT


def test_an_image_of_empty_size_is_refused_by_code(monkeypatch):
    # No format Pillow opens here reaches this guard with 0 on a side (each refuses the header itself: a
    # 0x5 PNG is "unknown signature"); it stays for a plugin that does, and still carries its code.
    opened = Image.open(io.BytesIO(NOISE_PNG))
    opened._size = (0, 5)
    monkeypatch.setattr(transform.Image, "open", lambda *args, **kwargs: opened)
    with pytest.raises(SampleError) as caught:
        process_image(NOISE_PNG, CFG)
    assert caught.value.code is FailureCode.EMPTY_SIZE and "PNG with an empty size 0x5" in str(caught.value)


def test_a_wrong_output_shape_is_internal(monkeypatch):
    # The shape check guards against a bug in the resize arithmetic: one is injected here.
    row = resize_mode(CFG.mode)
    place = row.place
    monkeypatch.setattr(type(row), "place", lambda self, *args: place(*args).crop((0, 0, 31, 32)))
    with pytest.raises(SampleError) as caught:
        process_image(NOISE_PNG, CFG)
    assert caught.value.code is FailureCode.INTERNAL


def test_the_code_reaches_the_failure_records(tars, tmp_path):
    members = [Member("000000.png", NOISE_PNG[: len(NOISE_PNG) // 2]), Member("000001.jpg", THUMBNAIL),
               Member("000002.jpg", progressive_with_scans(140))]
    path = tars.write("codes.tar", members)
    result = process_input(path, str(tmp_path / "out"), JobConfig(height=32, width=32, max_aspect_ratio=1.7),
                           for_path(path).stat_fingerprint(path))
    assert [(f["key"], f["code"]) for f in result.failures] == [
        ("000000", "truncated"), ("000001", "aspect_ratio"), ("000002", "too_many_scans")]
    assert result.failures[0]["reason"].startswith("000000.png: cannot decode: OSError: image file is")


def _tiff(width: int, height: int, bits: tuple[int, ...], photometric: int, extra: tuple[int, ...]) -> bytes:
    """An uncompressed little-endian TIFF, one strip, written field by field (Pillow writes only the layouts
    it reads): ``bits`` per sample, ``extra`` the ExtraSamples tag (338)."""
    import struct

    samples = len(bits)
    pixels = bytes(range(256)) * (width * height * samples * max(bits) // 8 // 256 + 1)
    pixels = pixels[: width * height * samples * max(bits) // 8]
    bits_at = 8 + len(pixels)
    bits_field = struct.pack(f"<{samples}H", *bits)
    extra_at = bits_at + len(bits_field)
    extra_field = struct.pack(f"<{len(extra)}H", *extra)
    ifd_at = extra_at + len(extra_field) + (extra_at + len(extra_field)) % 2

    def entry(tag: int, kind: int, count: int, value: int | bytes) -> bytes:
        inline = value if isinstance(value, bytes) else (struct.pack("<HH", value, 0) if kind == 3 and count == 1
                                                          else struct.pack("<I", value))
        return struct.pack("<HHI", tag, kind, count) + inline.ljust(4, b"\0")

    entries = [entry(256, 3, 1, width), entry(257, 3, 1, height),
               entry(258, 3, samples, bits_at if samples > 2 else b"".join(struct.pack("<H", b) for b in bits)),
               entry(259, 3, 1, 1), entry(262, 3, 1, photometric), entry(273, 4, 1, 8),
               entry(277, 3, 1, samples), entry(278, 3, 1, height), entry(279, 4, 1, len(pixels)),
               entry(284, 3, 1, 1)]
    if extra:
        entries.append(entry(338, 3, len(extra), extra_at if len(extra) > 2 else extra_field))
    body = b"II*\x00" + struct.pack("<I", ifd_at) + pixels + bits_field + extra_field
    body = body.ljust(ifd_at, b"\0")
    return body + struct.pack("<H", len(entries)) + b"".join(entries) + struct.pack("<I", 0)


@pytest.mark.parametrize("bits, photometric, extra, layout", [
    ((8, 8), 1, (0,), "grey; 2 sample(s) per pixel of 8/8 bits; extra samples: unspecified"),
    ((16, 16, 16, 16, 16), 2, (2, 0), "RGB; 5 sample(s) per pixel of 16/16/16/16/16 bits; extra samples: "
                                      "unassociated alpha, unspecified"),
])
def test_a_tiff_the_decoder_cannot_read_is_named_as_one_with_its_layout(bits, photometric, extra, layout):
    """It was "unknown signature 49492a00": that is the TIFF magic."""
    assert _tiff(8, 8, (8, 8, 8), 2, ()) and process_image(_tiff(8, 8, (8, 8, 8), 2, ()), CFG)  # one it reads
    with pytest.raises(SampleError) as caught:
        process_image(_tiff(8, 8, bits, photometric, extra), CFG)
    message = str(caught.value)
    assert caught.value.code is FailureCode.UNREADABLE_TIFF, message
    assert "a TIFF the decoder cannot read: unknown pixel mode" in message and layout in message, message
    assert "signature" not in message and "convert it to RGB or RGBA" in message, message


@pytest.mark.skipif(features.check("littlecms2"), reason="this Pillow has littleCMS: Lab converts to RGB")
def test_a_lab_tiff_without_littlecms_says_so():
    """It was decode_error "ImportError: cannot import name '_imagingcms'"."""
    out = io.BytesIO()
    Image.new("LAB", (40, 30), (50, 10, 10)).save(out, "TIFF")
    with pytest.raises(SampleError) as caught:
        process_image(out.getvalue(), CFG)
    message = str(caught.value)
    assert caught.value.code is FailureCode.UNSUPPORTED_COLOUR, message
    assert "TIFF in Lab colour (CIELAB)" in message and "littleCMS" in message, message
    assert "_imagingcms" not in message and "ImportError" not in message, message
