"""JPEG data that libjpeg only *warns* about is a failed sample, and every valid JPEG still decodes exactly.

libjpeg pads a scan that runs out of data with zeros and carries on (Pillow drops the warning), so these
came out as good images with a grey bottom: a JPEG cut mid-scan with an EOI appended, a header claiming
more pixels than the data holds, a scan with bytes lost in the middle, a progressive JPEG cut between
scans. The valid side compares pixels with Pillow's plain decode path (the strict decoder switched off).
TIFF: without libtiff only uncompressed TIFF decodes, so compressed TIFF is refused by name.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image, features

from preprocess.image import jpeg_region, transform
from preprocess.config import JobConfig
from preprocess.image.jpeg_markers import jpeg_layout
from preprocess.image.transform import process_image
from shardio.errors import SampleError
from tests.tar_factory import jpeg_bytes

CFG = JobConfig(height=32, width=32)
SCAN_ENDS_EARLY = "JPEG scan data ends early"


@pytest.fixture(autouse=True)
def _restore_pillow_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)


@pytest.fixture(autouse=True, params=["region decoder", "Pillow decoder"])
def _decoder(request, monkeypatch):
    """Every test here under both JPEG paths: the compiled region decoder (what make install builds) and
    Pillow's load, which a machine without the compiled module uses. Same verdicts, same pixels."""
    if request.param == "Pillow decoder":
        monkeypatch.setattr(jpeg_region, "_decode_region", None)
    else:
        assert jpeg_region.available(), "preprocess.image._jpeg_region is not built (make install builds it)"


def noise(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    # Noise, not flat colour: a long scan, so a cut lands well inside it.
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def reason(data: bytes, cfg: JobConfig = CFG) -> str:
    with pytest.raises(SampleError) as caught:
        process_image(data, cfg)
    return str(caught.value)


def cut_with_eoi(data: bytes, fraction: float) -> bytes:
    return data[: int(len(data) * fraction)] + b"\xff\xd9"


BASELINE = jpeg_bytes(noise(160, 120), quality=90, subsampling=2)
PROGRESSIVE = jpeg_bytes(noise(160, 120, seed=1), quality=90, progressive=True, subsampling=2)


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9, 0.99])
def test_baseline_jpeg_cut_mid_scan_with_eoi_appended(fraction):
    assert SCAN_ENDS_EARLY in reason(cut_with_eoi(BASELINE, fraction))


RESTARTS = jpeg_bytes(noise(160, 120), quality=90, subsampling=1, restart_marker_blocks=5)


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("eoi", [True, False], ids=["EOI appended", "no EOI"])
def test_jpeg_with_restart_markers_cut_mid_scan(fraction, eoi):
    # With restart markers, libjpeg looks for the next RSTn through the probe's zero bytes instead of
    # decoding them, so Pillow's path once finished such a JPEG at the EOI, the rest filled with grey.
    assert b"\xff\xdd" in RESTARTS  # a DRI segment: restart markers in the scan
    data = RESTARTS[: int(len(RESTARTS) * fraction)] + (b"\xff\xd9" if eoi else b"")
    assert "JPEG scan data ends early" in reason(data) or "truncated JPEG" in reason(data)


def test_progressive_jpeg_cut_inside_its_last_scan_with_eoi_appended():
    layout = jpeg_layout(PROGRESSIVE)
    assert layout is not None and layout.scans == 10
    last_sos = PROGRESSIVE.rindex(b"\xff\xda")
    for fraction in (0.3, 0.6, 0.9):
        cut = last_sos + 20 + int((len(PROGRESSIVE) - last_sos - 22) * fraction)
        assert SCAN_ENDS_EARLY in reason(PROGRESSIVE[:cut] + b"\xff\xd9")


def test_progressive_jpeg_cut_between_scans():
    # Whole scans missing, the last one complete: no decoder warning at all, a blurry or colourless image.
    sixth_sos = [i for i in range(len(PROGRESSIVE) - 1) if PROGRESSIVE[i:i + 2] == b"\xff\xda"][5]
    assert "incomplete JPEG" in reason(PROGRESSIVE[:sixth_sos] + b"\xff\xd9")
    assert "truncated JPEG" in reason(PROGRESSIVE[:sixth_sos])


def test_header_claiming_9000x9000_over_64x64_of_data():
    data = bytearray(jpeg_bytes(noise(64, 64, seed=2), quality=90))
    sof = data.index(b"\xff\xc0")
    data[sof + 5: sof + 9] = struct.pack(">HH", 9000, 9000)
    assert SCAN_ENDS_EARLY in reason(bytes(data))


def test_header_claiming_9000x9000_with_a_stray_marker_in_the_scan():
    # libjpeg stops the scan at FF 01, fills 9000x9000 with grey and skips the rest as "extraneous bytes":
    # both decoders stored an all-grey image (issue 22, E).
    data = bytearray(jpeg_bytes(noise(64, 64, seed=2), quality=90))
    sof = data.index(b"\xff\xc0")
    data[sof + 5: sof + 9] = struct.pack(">HH", 9000, 9000)
    at = data.index(b"\xff\xda") + 2 + struct.unpack_from(">H", data, data.index(b"\xff\xda") + 2)[0] + 16
    assert SCAN_ENDS_EARLY in reason(bytes(data[:at] + b"\xff\x01" + data[at:]))


def test_restart_interval_jpeg_widened_past_its_data():
    # Each restart interval runs out of data at the next RST marker and libjpeg resynchronises there, so
    # only the final EOI tells: the region path alone accepted it, 99% grey (issue 22, E).
    data = bytearray(jpeg_bytes(noise(16, 16, seed=3), quality=90, restart_marker_blocks=1))
    assert b"\xff\xdd" in data
    sof = data.index(b"\xff\xc0")
    data[sof + 7: sof + 9] = struct.pack(">H", 1000)
    assert SCAN_ENDS_EARLY in reason(bytes(data))


def scan_data_start(data: bytes, scan: int = 0) -> int:
    sos = [i for i in range(len(data) - 1) if data[i:i + 2] == b"\xff\xda"][scan]
    return sos + 2 + struct.unpack_from(">H", data, sos + 2)[0]


@pytest.mark.parametrize("marker", [b"\xff\x01", b"\xff\x02", b"\xff\xbf", b"\xff\xd3", b"\xff\xff\x01"],
                         ids=["TEM", "reserved 02", "reserved BF", "RST3 without restart interval", "fill, TEM"])
@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("kind", ["baseline", "progressive, first scan", "progressive, last scan"])
def test_a_stray_marker_inside_scan_data_ends_it(marker, where, kind):
    """Followed by more data, a stray marker is no end of scan: whatever comes after it is skipped."""
    if kind == "baseline":
        data, start = BASELINE, scan_data_start(BASELINE)
        end = len(BASELINE) - 2
    else:
        scan = 0 if kind.endswith("first scan") else -1
        data, start = PROGRESSIVE, scan_data_start(PROGRESSIVE, scan)
        end = data.index(b"\xff", start + 1) if scan == 0 else len(data) - 2
        while data[end + 1] == 0 or data[end + 1] in range(0xD0, 0xD8) or data[end + 1] == 0xFF:
            end = data.index(b"\xff", end + 1)
    at = start + int((end - start) * where)
    if data[at - 1] == 0xFF:
        at += 1  # not between an FF and its stuffed 00
    assert SCAN_ENDS_EARLY in reason(data[:at] + marker + data[at:])


def test_a_stray_marker_after_the_scan_data_is_harmless(monkeypatch):
    # The scan is complete: libjpeg skips the marker like trailing bytes; same pixels as without it.
    eoi = len(BASELINE) - 2
    expected = process_image(BASELINE, CFG).pixels
    assert np.array_equal(process_image(BASELINE[:eoi] + b"\xff\x01" + BASELINE[eoi:], CFG).pixels, expected)


def test_scan_with_bytes_lost_in_the_middle():
    sos = BASELINE.index(b"\xff\xda")
    middle = (sos + len(BASELINE)) // 2
    lost = BASELINE[:middle] + BASELINE[middle + 400:]  # a lost block of a download, EOI still there
    assert SCAN_ENDS_EARLY in reason(lost)


def plain_pillow(data: bytes, monkeypatch) -> np.ndarray:
    with monkeypatch.context() as patch:
        patch.setattr(transform, "use_strict_decoder", lambda im, layout, data: None)
        return process_image(data, CFG).pixels


VALID = {
    "baseline 4:2:0": lambda: jpeg_bytes(noise(97, 61), quality=85, subsampling=2),
    "baseline 4:4:4": lambda: jpeg_bytes(noise(97, 61), quality=95),
    "optimized tables": lambda: jpeg_bytes(noise(97, 61), quality=80, optimize=True, subsampling=2),
    "progressive 4:2:0": lambda: jpeg_bytes(noise(97, 61), progressive=True, subsampling=2),
    "progressive 4:4:4": lambda: jpeg_bytes(noise(97, 61), progressive=True),
    "grayscale": lambda: jpeg_bytes(noise(97, 61, mode="L")),
    "grayscale progressive": lambda: jpeg_bytes(noise(97, 61, mode="L"), progressive=True),
    "CMYK": lambda: jpeg_bytes(noise(97, 61, mode="CMYK")),
    "CMYK progressive": lambda: jpeg_bytes(noise(97, 61, mode="CMYK"), progressive=True),
    "restart markers": lambda: jpeg_bytes(noise(97, 61), restart_marker_blocks=2),
    "progressive, restart markers": lambda: jpeg_bytes(noise(97, 61), progressive=True,
                                                       restart_marker_blocks=2),
    "large, drafted to 1/8": lambda: jpeg_bytes(noise(800, 600), quality=90, subsampling=2),
}


@pytest.mark.parametrize("name", VALID)
@pytest.mark.parametrize("tail", [b"", b"trailing garbage \xff\xd9 after EOI" * 20, None])
def test_valid_jpegs_decode_to_the_same_pixels(name, tail, monkeypatch):
    data = VALID[name]()
    expected = plain_pillow(data, monkeypatch)
    # None: the EOI missing after complete scans, which Pillow alone reported as truncated.
    variant = data[:-2] if tail is None else data + tail
    assert np.array_equal(process_image(variant, CFG).pixels, expected)


def test_the_marker_walk_crosses_restart_markers():
    # RST markers (FF D0-D7) inside a scan are part of it: the walk must not take them for its end.
    data = VALID["progressive, restart markers"]()
    assert data.count(b"\xff\xd0") > 1
    layout = jpeg_layout(data)
    assert layout is not None and layout.scans == 10 and layout.complete and layout.eoi == len(data) - 2


def tiff_with_compression(code: int) -> bytes:
    """An uncompressed TIFF whose Compression tag (259) is patched to ``code`` (8: Adobe deflate)."""
    out = io.BytesIO()
    noise(40, 30).save(out, "TIFF")
    data = bytearray(out.getvalue())
    assert data[:4] == b"II*\x00"
    (ifd,) = struct.unpack_from("<I", data, 4)
    (count,) = struct.unpack_from("<H", data, ifd)
    for i in range(count):
        entry = ifd + 2 + 12 * i
        if struct.unpack_from("<H", data, entry)[0] == 259:
            struct.pack_into("<H", data, entry + 8, code)
            return bytes(data)
    raise AssertionError("no Compression tag")


@pytest.mark.skipif(features.check("libtiff"), reason="this Pillow has libtiff: compressed TIFF is decoded")
@pytest.mark.parametrize("code, name", [(8, "tiff_adobe_deflate"), (32946, "tiff_deflate"), (5, "tiff_lzw")])
def test_compressed_tiff_without_libtiff_is_refused_by_name(code, name):
    message = reason(tiff_with_compression(code))
    assert f"TIFF compression not supported ({name}: this Pillow build has no libtiff" in message


def test_uncompressed_tiff_decodes():
    assert process_image(tiff_with_compression(1), CFG).pixels.shape == (32, 32, 3)
